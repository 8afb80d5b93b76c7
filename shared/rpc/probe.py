"""Health probe for orchestrators that cannot speak mutual TLS (the kubelet's gRPC probe is plaintext):

    python -m shared.rpc.probe HOST:PORT [--service NAME] [--tls-cert C --tls-key K --tls-ca CA] [--timeout 5]

exits 0 when grpc.health.v1 reports SERVING, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.config import add_tls_arguments
from shared.rpc.service import Credentials, channel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shared.rpc.probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address")
    p.add_argument("--service", default="", help="health of one service (default: the whole server)")
    p.add_argument("--timeout", type=float, default=5.0)
    add_tls_arguments(p)
    a = p.parse_args(argv)
    creds = Credentials(None, True, a.tls_cert, a.tls_key, a.tls_ca)
    try:
        with channel(a.address, creds) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=a.service),
                                                         timeout=a.timeout)
    except grpc.RpcError as exc:
        print(f"{a.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{a.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
