"""Mutual TLS on every hop and the KV channel, and KV destinations a prefill accepts only when a
decode instance of the cluster vouched for them (issue: reliability and security).

Every wait is bounded and fails on a hang; nothing asserts how fast the system under test is.
"""

from __future__ import annotations

import socket
import ssl

import grpc
import pytest

from router.cluster import Cluster
from shared.engine import SamplingParams
from shared.rpc.certs import make_cluster_certs
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.rpc.service import Credentials, channel
from shared.transfer.tcp import COMMIT, HEADER, MAGIC, REFUSED, VERSION, read_reply, split_endpoint
from tests.helpers import random_prompts, wait_for

RESERVE = internal_pb2.ReserveRequest(request_id="x", num_prompt_tokens=4, max_tokens=4)


@pytest.fixture(scope="module")
def tls_cluster(served_model, tmp_path_factory):
    with Cluster(str(served_model), dtype="float32", tls=True, log_dir=tmp_path_factory.mktemp("tls-logs")) as c:
        yield c


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """A certificate from a CA that is not the cluster's."""
    return make_cluster_certs(tmp_path_factory.mktemp("other-ca"), name="intruder")


def _reserve(address: str, creds: Credentials | None) -> internal_pb2.ReserveResponse:
    with channel(address, creds) as ch:
        return internal_pb2_grpc.DecodeStub(ch).Reserve(RESERVE, timeout=10)


def test_generate_over_tls_on_every_hop(tls_cluster, served_model):
    """client → router (TLS), router → prefill/decode (mutual TLS), prefill → decode KV (mutual TLS):
    greedy tokens equal the in-process engine's."""
    from shared.engine import LLM

    prompts = random_prompts(3, [5, 17, 30], 512, seed=7)
    want = [o.token_ids for o in LLM(str(served_model), dtype="float32").generate(
        prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
    sp = generation_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with tls_cluster.channel(tls_cluster.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        got = [[t for m in stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=sp),
                                         timeout=60) for t in m.token_ids] for p in prompts]
    assert got == want
    # a client needs only the CA to reach the router's public port (no client certificate)
    ca = tls_cluster.certs.ca.read_bytes()
    with grpc.secure_channel(tls_cluster.address, grpc.ssl_channel_credentials(ca)) as ch:
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=prompts[0], sampling_params=sp), timeout=60))
    assert [t for m in msgs for t in m.token_ids] == want[0]


def test_internal_services_refuse_peers_without_the_cluster_certificate(tls_cluster, other_ca):
    decode = tls_cluster.decode_addrs[0]
    certs = tls_cluster.certs
    cases = {
        "plaintext": None,
        "TLS without a client certificate": "server-only",
        "a certificate from another CA": Credentials(None, False, str(other_ca.cert), str(other_ca.key),
                                                     str(other_ca.ca)),
        "another CA's certificate, trusting the cluster CA": Credentials(None, False, str(other_ca.cert),
                                                                        str(other_ca.key), str(certs.ca)),
    }
    for name, creds in cases.items():
        if creds == "server-only":
            ch = grpc.secure_channel(decode, grpc.ssl_channel_credentials(certs.ca.read_bytes()))
        else:
            ch = channel(decode, creds)
        with ch, pytest.raises(grpc.RpcError) as err:
            internal_pb2_grpc.DecodeStub(ch).Reserve(RESERVE, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name  # the handshake fails: no RPC runs
    # with the cluster's certificate (and no token at all) the call works
    reply = _reserve(decode, Credentials(None, False, str(certs.cert), str(certs.key), str(certs.ca)))
    with tls_cluster.channel(decode) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        assert stub.Release(internal_pb2.ReleaseRequest(lease_id=reply.destination.lease_id), timeout=10).released
        # GetLoad shows the engine's last loop turn: the release shows within a turn
        assert wait_for(lambda: stub.GetLoad(internal_pb2.LoadRequest(), timeout=10).active_leases == 0, 10)


def _commit_frame(dest: internal_pb2.KVDestination) -> bytes:
    return HEADER.pack(MAGIC, VERSION, COMMIT, dest.lease_id.encode(), dest.token, 0, 0, 0, 0, 0)


def test_kv_channel_refuses_an_unauthenticated_peer(tls_cluster, other_ca):
    """Even with a valid lease id and token, the KV port talks only to cluster certificates."""
    dest = _reserve(tls_cluster.decode_addrs[0], tls_cluster.credentials).destination
    host, port = split_endpoint(dest.endpoint)
    # plaintext frames: the receiver expects a TLS handshake and drops the connection
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(_commit_frame(dest))
        sock.settimeout(10)
        try:
            got = sock.recv(64)
        except ConnectionResetError:
            got = b""
        assert got == b""  # closed, no reply
    # TLS with another CA's certificate: the handshake fails
    bad = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bad.load_cert_chain(other_ca.cert, other_ca.key)
    bad.load_verify_locations(tls_cluster.certs.ca)
    with socket.create_connection((host, port), timeout=10) as raw, pytest.raises((ssl.SSLError, OSError)):
        with bad.wrap_socket(raw, server_hostname=host) as sock:
            sock.sendall(_commit_frame(dest))
            if not sock.recv(64):
                raise ConnectionError("closed by the receiver")
    # the cluster's certificate gets an answer (the commit is refused: nothing was written)
    good = tls_cluster.credentials.ssl_context(server=False)
    with socket.create_connection((host, port), timeout=10) as raw, good.wrap_socket(raw, server_hostname=host) as sock:
        sock.sendall(_commit_frame(dest))
        status, message = read_reply(sock)
    assert status == REFUSED and "not fully written" in message
    with tls_cluster.channel(tls_cluster.decode_addrs[0]) as ch:
        internal_pb2_grpc.DecodeStub(ch).Release(internal_pb2.ReleaseRequest(lease_id=dest.lease_id), timeout=10)


def test_prefill_pushes_only_to_destinations_a_decode_instance_signed(served_model, tmp_path):
    """A caller holding the cluster token still cannot aim prefill at an arbitrary host: the
    destination must carry a decode instance's signature over every field."""
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs") as c:
        dest = _reserve(c.decode_addrs[0], c.credentials).destination
        forged = internal_pb2.KVDestination()
        forged.CopyFrom(dest)
        forged.endpoint = "10.255.255.1:9"  # the attacker's choice; the signature no longer matches
        unsigned = internal_pb2.KVDestination()
        unsigned.CopyFrom(dest)
        unsigned.signature = b""
        with c.channel(c.prefill_addrs[0]) as ch:
            stub = internal_pb2_grpc.PrefillStub(ch)
            for bad in (forged, unsigned):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Prefill(internal_pb2.PrefillRequest(request_id="p", prompt_token_ids=[3, 4, 5, 6],
                                                             destination=bad), timeout=30)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "signed" in err.value.details()
            reply = stub.Prefill(internal_pb2.PrefillRequest(request_id="p", prompt_token_ids=[3, 4, 5, 6],
                                                             destination=dest), timeout=30)
        assert 0 <= reply.first_token_id < 512
        with c.channel(c.decode_addrs[0]) as ch:
            internal_pb2_grpc.DecodeStub(ch).Release(internal_pb2.ReleaseRequest(lease_id=dest.lease_id), timeout=10)
