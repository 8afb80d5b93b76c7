"""Fuzzing with hypothesis: the public API through a real `pdserve up`-style cluster, and the KV port.

Generated requests mix valid and hostile values (NaN / inf / denormal floats, out-of-range ids, empty
and odd strings, unknown roles); every answer must be OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED —
never INTERNAL, never a crash — and afterwards every KV block and lease is back. Random frames on
the KV port never stop the receiver. Examples: 500 in CI (derandomized, so a failure reproduces),
more with PDSERVE_FUZZ_EXAMPLES.
"""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.cluster import Cluster
from shared.kvcache import KVCache, KVLayout
from shared.kvcache.lease import LeaseTable
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.transfer import make_sender
from shared.transfer.tcp import HEADER, MAGIC, VERSION, TcpReceiver

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "500"))
FINE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

floats32 = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1e-39, 1e-6, 1e-5, 0.3, 1.0, 7.0, 1e30]))
int32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def sampling(draw) -> generation_pb2.SamplingParams:
    sp = generation_pb2.SamplingParams(
        top_k=draw(st.one_of(st.integers(-3, 600), int32)),
        stop=draw(st.lists(st.text(max_size=6), max_size=3)),
        stop_token_ids=draw(st.lists(st.one_of(st.integers(0, 600), int32), max_size=3)),
        ignore_eos=draw(st.booleans()))
    # max_tokens stays small when valid: the fuzz is about inputs, not long generations
    for name, strategy in (("max_tokens", st.one_of(st.integers(-3, 6), st.sampled_from([2**31 - 1, 600]))),
                           ("temperature", floats32), ("top_p", floats32),
                           ("seed", st.integers(-(2**63), 2**63 - 1)), ("skip_special_tokens", st.booleans())):
        if draw(st.booleans()):
            setattr(sp, name, draw(strategy))
    return sp


roles = st.sampled_from(["user", "assistant", "system", "tool", ""])
messages = st.lists(st.builds(generation_pb2.ChatMessage, role=roles, content=st.text(max_size=30),
                              reasoning_content=st.text(max_size=8)), max_size=3)
plain = st.builds(generation_pb2.SamplingParams, max_tokens=st.integers(1, 6), temperature=st.sampled_from([0.0, 0.7]),
                  ignore_eos=st.booleans())


@st.composite
def requests(draw) -> generation_pb2.GenerateRequest:
    """Mostly one prompt form (as a client would send), sometimes several or none; sampling either
    plain or fuzzed."""
    req = generation_pb2.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=20))),
                                         thinking=draw(st.booleans()),
                                         sampling_params=draw(st.one_of(plain, sampling())))
    forms = draw(st.sampled_from([["prompt"], ["ids"], ["messages"], ["prompt", "ids"], [], ["ids", "messages"]]))
    if "prompt" in forms:
        req.prompt = draw(st.text(max_size=60))
    if "ids" in forms:
        req.prompt_token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 520), int32), max_size=24)))
    if "messages" in forms:
        req.messages.extend(draw(messages))
    return req


@pytest.fixture(scope="module")
def cluster(served_model, tmp_path_factory):
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path_factory.mktemp("logs"),
                 extra_decode=["--block-size", "4", "--kv-cache-tokens", "256"],
                 extra_prefill=["--block-size", "4"]) as c:
        yield c


def _load(cluster) -> internal_pb2.LoadReport:
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=10)


@pytest.mark.timeout(1200)
def test_public_api_fuzz(cluster):
    seen: dict[str, int] = {}
    with grpc.insecure_channel(cluster.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(request: generation_pb2.GenerateRequest) -> None:
            try:
                for _ in stub.Generate(request, timeout=60):
                    pass
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in FINE, (code, exc.details(), request)
            seen[code.name] = seen.get(code.name, 0) + 1

        one()
    print(f"\nfuzzed {sum(seen.values())} requests: {seen}")
    assert sum(seen.values()) >= min(EXAMPLES, 500) and seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_load(cluster).free_blocks != _load(cluster).total_blocks
                                           or _load(cluster).active_leases):
        time.sleep(0.2)
    load = _load(cluster)
    assert load.free_blocks == load.total_blocks and load.active_leases == 0 and load.running == 0


@pytest.mark.timeout(600)
def test_kv_port_fuzz(ckpt):
    """Random bytes and random well-formed headers (live lease ids, wrong tokens, odd sizes, unknown
    types): the receiver refuses or drops them and still takes a valid push afterwards."""
    from shared.config import ModelConfig

    cfg = ModelConfig.from_pretrained(ckpt("v32_sparse"))
    layout = KVLayout.from_model_config(cfg, 4, torch.float32)
    kv = KVCache(layout, 32, torch.device("cpu"))
    leases = LeaseTable(kv.ledger, 4, cfg.num_hidden_layers, ("mla", "index"), ttl_seconds=60)
    rx = TcpReceiver(kv, leases)
    live = leases.reserve("fuzz", 8)
    frames = st.one_of(
        st.binary(max_size=200),
        st.builds(lambda t, lid, tok, layer, kind, first, count, nbytes, tail: HEADER.pack(
            MAGIC, VERSION, t, lid, tok, layer, kind, first, count, nbytes) + tail,
            st.integers(0, 255), st.one_of(st.just(live.lease_id.encode()), st.binary(min_size=32, max_size=32)),
            st.one_of(st.just(live.token), st.binary(min_size=16, max_size=16)), st.integers(0, 65535),
            st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
            st.binary(max_size=64)))
    try:
        @settings(max_examples=min(EXAMPLES, 300), deadline=None, derandomize=True, database=None)
        @given(frames)
        def one(data: bytes) -> None:
            with socket.create_connection(("127.0.0.1", rx.port), timeout=10) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                try:
                    while s.recv(4096):
                        pass
                except OSError:
                    pass

        one()
        assert live.writers == 0
        src = KVCache(layout, 8, torch.device("cpu"))
        src.mla.normal_()
        fresh = leases.reserve("after", 8)
        push = make_sender("tcp", src).open(rx.destination(fresh))
        for layer in range(cfg.num_hidden_layers):
            push.send_layer(layer, [0, 1], 0)
        push.finish()  # committed: every block of every layer arrived
        assert torch.equal(kv.mla[:, fresh.blocks[0]], src.mla[:, 0])
    finally:
        rx.close()
