"""gRPC plumbing shared by the services: server with health + reflection, internal-call
authentication, request conversions.

Internal services (Prefill, Decode) accept only callers presenting the cluster's shared secret
(`authorization: Bearer <token>` metadata; the token comes from `--auth-token-file` or the
PDSERVE_CLUSTER_TOKEN environment variable). Secure by default: a service with no token refuses
every internal call unless started with an explicit `--insecure`. `pdserve up` and the Helm chart
generate one secret per cluster. Health checks and reflection stay open (probes); the router's
public Generate is the front door and needs no token. KV writes need a lease token that only an
authenticated Reserve hands out.
"""

from __future__ import annotations

import hmac
import logging
import os
import sys
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.engine.sampler import SamplingParams
from shared.rpc.pdserve.v1 import generation_pb2, internal_pb2

log = logging.getLogger("pdserve")

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
INTERNAL_SERVICES = ("pdserve.v1.Prefill", "pdserve.v1.Decode")


@dataclass(frozen=True)
class Credentials:
    """The cluster secret this process presents (client) and demands (internal services)."""

    token: str | None = None
    insecure: bool = False

    @classmethod
    def from_args(cls, token_file: str | None, insecure: bool) -> Credentials:
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV) or None
        if token is None and not insecure:
            log.warning("no cluster token (--auth-token-file or %s): internal calls will be refused; "
                        "pass --insecure to accept them without one", TOKEN_ENV)
        return cls(token, insecure)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def allows(self, metadata: tuple) -> bool:
        if self.insecure:
            return True
        if not self.token:
            return False
        got = dict(metadata or ()).get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode())


class _Authenticate(grpc.ServerInterceptor):
    """Internal methods without the cluster secret end with UNAUTHENTICATED before any work."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    def intercept_service(self, continuation, details):  # noqa: ANN001, ANN201
        handler = continuation(details)
        service = details.method.split("/")[1] if details.method.count("/") >= 2 else ""
        if handler is None or service not in INTERNAL_SERVICES or self.credentials.allows(details.invocation_metadata):
            return handler

        def deny(request, context):  # noqa: ANN001, ANN202
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{details.method} needs the cluster's secret")

        kind = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)
        return kind(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class _PresentToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.extra = metadata

    def _details(self, details):  # noqa: ANN001, ANN202
        return details._replace(metadata=tuple(details.metadata or ()) + self.extra)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

DEFAULT_MAX_TOKENS = 16
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def build_server(host: str, port: int, register: Iterable[Callable[[grpc.Server], None]],
                 service_names: list[str], max_workers: int = 64, credentials: Credentials | None = None,
                 ) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A server (not started) with health checking and reflection; returns it with its bound port.

    The GIL switch interval drops from 5 ms to 0.5 ms: handler threads must not wait a whole
    interval behind the engine thread to send a token (latency over a tiny throughput cost)."""
    sys.setswitchinterval(0.0005)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS,
                         interceptors=[_Authenticate(credentials or Credentials())])
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    return server, bound, health_servicer


def write_port_file(path: str | None, port: int) -> None:
    """Report the port a service bound (port 0 = the OS picked one), atomically: a launcher reads it."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(str(port))
        tmp.replace(path)


def set_serving(health_servicer: health.HealthServicer, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    """Proto → SamplingParams with the documented defaults for unset optional fields."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=list(msg.stop_token_ids),
        stop=list(msg.stop),
        ignore_eos=msg.ignore_eos,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
    )


def sampling_to_proto(p: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                        top_k=p.top_k, stop_token_ids=p.stop_token_ids, stop=p.stop,
                                        ignore_eos=p.ignore_eos, skip_special_tokens=p.skip_special_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def fail_process(health_servicer: health.HealthServicer, service_names: list[str], reason: str,
                 grace: float = 1.0) -> None:
    """The engine loop cannot go on: report NOT_SERVING at once, give streams `grace` seconds to end
    with UNAVAILABLE, then exit non-zero so the orchestrator restarts the process."""
    import os
    import threading

    log.error("engine loop failed, exiting in %.1fs: %s", grace, reason)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    timer = threading.Timer(grace, lambda: os._exit(70))
    timer.daemon = True
    timer.start()


def exit_after_drain(server: grpc.Server, health_servicer: health.HealthServicer, service_names: list[str],
                     drain_seconds: float, cleanup: Callable[[], None] = lambda: None) -> None:
    """SIGTERM/SIGINT: stop accepting (NOT_SERVING, new RPCs refused), let in-flight RPCs finish for up
    to `drain_seconds` (then they are cancelled), clean up, exit. A watchdog exits regardless if
    cleanup hangs, so a stop signal always ends the process."""
    import os
    import threading

    watchdog = threading.Timer(drain_seconds + 10, lambda: os._exit(0))
    watchdog.daemon = True
    watchdog.start()
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=drain_seconds).wait(drain_seconds + 1)
    cleanup()
    sys.stdout.flush()
    os._exit(0)


def wait_for_shutdown() -> None:
    """Block until SIGINT or SIGTERM (every service's main loop)."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def channel(address: str, credentials: Credentials | None = None) -> grpc.Channel:
    """A channel to a peer; calls on it present the cluster secret when there is one."""
    ch = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    if credentials is not None and credentials.token:
        ch = grpc.intercept_channel(ch, _PresentToken(credentials.metadata))
    return ch


__all__ = ["build_server", "channel", "generation_pb2", "internal_pb2", "sampling_from_proto", "sampling_to_proto",
           "set_serving"]
