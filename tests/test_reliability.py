"""Hostile-but-fair inputs (issue: reliability): each case reproduces an observed defect.

Every wait here is bounded and fails on a hang; nothing asserts how fast the system under test is.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import grpc
import pytest
import torch

from router.cluster import Cluster, wait_port_file, wait_serving
from shared.engine.sampler import SamplingParams, sample
from shared.kvcache import KVCache, KVLayout
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.protocol.finish import FinishReason
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.transfer.tcp import HEADER, MAGIC, MARK, VERSION, WRITE, TcpReceiver, read_reply
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def model_dir(served_model):
    return served_model


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    # a small decode pool (64 tokens) so "larger than the whole pool" fits in the model's context
    with Cluster(str(model_dir), dtype="float32", log_dir=tmp_path_factory.mktemp("logs"),
                 extra_decode=["--block-size", "4", "--kv-cache-tokens", "64", "--lease-seconds", "5"],
                 extra_prefill=["--block-size", "4"]) as c:
        yield c


def _generate(address: str, timeout: float = 60, **kwargs) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(**kwargs),
                                                                    timeout=timeout))


def _load(cluster) -> internal_pb2.LoadReport:
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)


def _greedy(n: int = 4, **kw) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


HOSTILE = [
    ("temperature", dict(prompt_token_ids=[3, 4], sampling_params=generation_pb2.SamplingParams(
        temperature=2.919e-39))),
    ("temperature", dict(prompt_token_ids=[3, 4], sampling_params=generation_pb2.SamplingParams(
        temperature=float("nan")))),
    ("top_p", dict(prompt_token_ids=[3, 4], sampling_params=generation_pb2.SamplingParams(top_p=float("nan")))),
    ("temperature", dict(prompt_token_ids=[3, 4], sampling_params=generation_pb2.SamplingParams(
        temperature=float("inf")))),
    ("stop", dict(prompt_token_ids=[3, 4], sampling_params=_greedy(stop=[""]))),
    ("stop", dict(prompt_token_ids=[3, 4], sampling_params=_greedy(stop=["x"] * 17))),
    ("stop", dict(prompt_token_ids=[3, 4], sampling_params=_greedy(stop=["x" * 257]))),
    ("request_id", dict(request_id="a" * 129, prompt_token_ids=[3], sampling_params=_greedy())),
    ("request_id", dict(request_id="bad id\n", prompt_token_ids=[3], sampling_params=_greedy())),
    ("prompt", dict(prompt="x" * 40_000, sampling_params=_greedy())),  # > 32 bytes × 512-token context
    ("max_tokens", dict(prompt_token_ids=[3] * 10, sampling_params=_greedy(100))),  # 110 tokens > a 64-token pool
]


@pytest.mark.parametrize("field,kwargs", HOSTILE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(HOSTILE)])
def test_hostile_values_are_invalid_argument(cluster, field, kwargs):
    with pytest.raises(grpc.RpcError) as err:
        _generate(cluster.address, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert field in err.value.details()
    assert len([t for m in _generate(cluster.address, prompt_token_ids=[5, 6], sampling_params=_greedy(3))
                for t in m.token_ids]) == 3  # the service still serves


def test_non_utf8_prompt_is_invalid_argument(cluster):
    """Field 2 (prompt) holding the bytes ff fe: not UTF-8. Sent raw, since protobuf will not encode it."""
    raw = bytes([0x12, 2, 0xFF, 0xFE])
    with grpc.insecure_channel(cluster.address) as ch:
        call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=generation_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()


def test_client_request_ids_are_labels(cluster):
    """Two concurrent requests with the same client request_id both complete and both echo it."""
    out: dict[int, list] = {}

    def run(i: int) -> None:
        out[i] = _generate(cluster.address, request_id="same-id", prompt_token_ids=[5, 6, 7 + i],
                           sampling_params=_greedy(6))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len([t for m in out[i] for t in m.token_ids]) == 6 for i in range(2))
    assert all(m.request_id == "same-id" for i in range(2) for m in out[i])


def test_duplicate_decode_request_id_leaves_the_first_stream_alone(cluster):
    """A second Decode with a request id that is already streaming is refused (ALREADY_EXISTS) and the
    first stream runs to its end."""
    with cluster.channel(cluster.decode_addrs[0]) as dch, cluster.channel(cluster.prefill_addrs[0]) as pch:
        dec, pre = internal_pb2_grpc.DecodeStub(dch), internal_pb2_grpc.PrefillStub(pch)
        prompt, sp = [5, 6, 7, 8], _greedy(12)
        lease = dec.Reserve(internal_pb2.ReserveRequest(request_id="dup", num_prompt_tokens=4, max_tokens=12),
                            timeout=10).destination
        first = pre.Prefill(internal_pb2.PrefillRequest(request_id="dup", prompt_token_ids=prompt, sampling_params=sp,
                                                        destination=lease), timeout=60)
        stream = dec.Decode(internal_pb2.DecodeRequest(request_id="dup", lease_id=lease.lease_id,
                                                       prompt_token_ids=prompt, sampling_params=sp,
                                                       first_token_id=first.first_token_id), timeout=60)
        got = [next(stream)]
        other = dec.Reserve(internal_pb2.ReserveRequest(request_id="dup", num_prompt_tokens=4, max_tokens=4),
                            timeout=10).destination
        with pytest.raises(grpc.RpcError) as err:
            list(dec.Decode(internal_pb2.DecodeRequest(request_id="dup", lease_id=other.lease_id,
                                                       prompt_token_ids=prompt, sampling_params=sp,
                                                       first_token_id=1), timeout=10))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        got += list(stream)
        assert sum(len(m.token_ids) for m in got) == 12 and got[-1].finish_reason == "length"
        assert dec.Release(internal_pb2.ReleaseRequest(lease_id=other.lease_id), timeout=10).released
    assert wait_for(lambda: _load(cluster).free_blocks == _load(cluster).total_blocks)


def test_expired_deadline_does_no_work_and_leaks_nothing(cluster):
    with pytest.raises(grpc.RpcError) as err:
        _generate(cluster.address, timeout=0.001, prompt_token_ids=[5] * 40, sampling_params=_greedy(8))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: _load(cluster).free_blocks == _load(cluster).total_blocks and
                    _load(cluster).active_leases == 0)


def test_sampler_survives_nan_and_inf_rows():
    logits = torch.randn(5, 64)
    logits[0] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    logits[3, :10] = float("nan")
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7), SamplingParams(temperature=0)]
    gen = torch.Generator().manual_seed(0)
    out = sample(logits, params, [gen] * 5)
    assert all(0 <= t < 64 for t in out)
    assert out[1] == 7 and out[4] == int(logits[4].argmax()) and out[3] >= 10


def test_sampling_params_refuse_non_finite_and_tiny_values():
    for bad in (dict(temperature=2.919e-39), dict(temperature=float("nan")), dict(top_p=float("inf")),
                dict(stop=[""]), dict(seed=2**64)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad).validate()


# --- KV receiver: leases are fences ------------------------------------------------------------------

@pytest.fixture()
def receiver(ckpt):
    from shared.config import ModelConfig

    cfg = ModelConfig.from_pretrained(ckpt("v32_sparse"))
    kv = KVCache(KVLayout.from_model_config(cfg, 4, torch.float32), 32, torch.device("cpu"))
    leases = LeaseTable(kv.ledger, 4, cfg.num_hidden_layers, ("mla", "index"), ttl_seconds=30)
    rx = TcpReceiver(kv, leases)
    yield kv, leases, rx
    rx.close()


def _frame(lease_id: bytes, token: bytes, ftype: int = WRITE, layer: int = 0, kind: int = 0, first: int = 0,
           count: int = 0, nbytes: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, ftype, lease_id, token, layer, kind, first, count, nbytes)


def _refusal(rx: TcpReceiver, data: bytes) -> str:
    with socket.create_connection(("127.0.0.1", rx.port), timeout=10) as s:
        s.sendall(data)
        status, message = read_reply(s)
    assert status != 0
    return message


def test_a_write_holds_its_lease(receiver):
    """Released while a write is in flight: the blocks stay allocated until the write ends, so the next
    request cannot get them while bytes still land; the stale write covers nothing."""
    kv, leases, _ = receiver
    lease = leases.reserve("a", 8, prompt_tokens=8)
    held = leases.begin_write(lease.lease_id, lease.token, 0, "mla", 0, 2)
    free_before = kv.allocator.num_free
    assert leases.release(lease.lease_id)
    assert kv.allocator.num_free == free_before  # still fenced by the write
    with pytest.raises(LeaseError):
        leases.begin_write(lease.lease_id, lease.token, 0, "mla", 0, 2)  # no new writes
    leases.end_write(held, 0, "mla", 0, 2, ok=True)
    assert kv.allocator.num_free == free_before + 2 and not held.covered


def test_commit_needs_every_block_of_every_layer(receiver):
    kv, leases, rx = receiver
    lease = leases.reserve("a", 12, prompt_tokens=8)  # 3 blocks, the push must fill 2
    for layer in range(leases.num_layers):
        for kind in ("mla", "index"):
            w = leases.begin_write(lease.lease_id, lease.token, layer, kind, 0, 1)
            leases.end_write(w, layer, kind, 0, 1, ok=True)  # block 1 never written
    assert not leases.commit(lease) and lease.missing == leases.num_layers * 2
    with pytest.raises(LeaseError, match="incomplete"):
        leases.claim(lease.lease_id)


def test_zero_length_writes_marks_and_bad_lease_ids_are_refused(receiver):
    kv, leases, rx = receiver
    lease = leases.reserve("a", 8)
    lid = lease.lease_id.encode()
    assert "does not fit" in _refusal(rx, _frame(lid, lease.token, count=0))  # marks nothing as received
    assert "not accepted" in _refusal(rx, _frame(lid, lease.token, ftype=MARK, count=2))  # tcp: no MARK
    assert "ASCII" in _refusal(rx, _frame(bytes([0xFF]) * 32, lease.token, count=1, nbytes=10))
    assert "carries" in _refusal(rx, _frame(lid, lease.token, count=1, nbytes=3))
    assert lease.missing == leases.num_layers * 2 and lease.writers == 0


def _open_write(rx: TcpReceiver, kv: KVCache, lease) -> socket.socket:
    """A connection that starts a 2-block write of layer 0 and sends half its payload, then nothing."""
    from shared.transfer.base import block_bytes

    size = 2 * block_bytes(kv.layout, "mla")
    s = socket.create_connection(("127.0.0.1", rx.port), timeout=30)
    s.sendall(_frame(lease.lease_id.encode(), lease.token, count=2, nbytes=size) + bytes(size // 2))
    assert wait_for(lambda: lease.writers == 1)
    return s


@pytest.mark.parametrize("how", ["stall", "release", "peer_gone"])
def test_no_lease_outlives_its_writer(receiver, monkeypatch, how):
    """A write open mid-frame: a writer that goes silent for the receiver's stall_seconds, a lease released
    under it (the router let go: its prefill failed), or a peer that goes mid-frame: the blocks are free again
    long before the connection's idle timeout (made huge here) or the lease's expiry (30 s), and a stalled
    writer is told why."""
    import shared.transfer.tcp as tcp

    kv, leases, rx = receiver
    monkeypatch.setattr(tcp, "IDLE_TIMEOUT", 600.0)
    rx.stall_seconds = 0.5 if how == "stall" else 600.0
    free = kv.allocator.num_free
    lease = leases.reserve("a", 16, prompt_tokens=16)
    with _open_write(rx, kv, lease) as s:
        if how == "release":
            assert leases.release(lease.lease_id)
        elif how == "peer_gone":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()  # RST mid-frame
        assert wait_for(lambda: kv.allocator.num_free == free, timeout=20), how
        assert lease.lease_id not in leases and lease.writers == 0 and not lease.covered
        if how == "stall":
            status, message = read_reply(s)
            assert status != 0 and "no byte for 0.5 s" in message
            assert leases.drain_expired() == [lease.lease_id]  # the front forgets its routing
            assert rx.abandoned == 1


# --- engine failures and stop signals ---------------------------------------------------------------

def test_decode_step_failure_fails_only_that_batch(model_dir):
    """A step that raises fails only the request that makes it raise (the batch is bisected down to it;
    its error says "request fault", which the router does not migrate) and the loop goes on; a loop that
    cannot go on ends every stream with the FATAL marker and reports itself (NOT_SERVING, exit) through
    on_fatal."""
    from decode_service.engine import FATAL, DecodeEngineCore
    from decode_service.server import DecodeConfig
    from decode_service.worker import DecodeWorker
    from shared.engine.core import EngineCommand
    from shared.engine.isolation import REQUEST_FAULT
    from shared.engine.step import Poison
    from shared.parallel import ParallelState

    me = DecodeWorker(DecodeConfig(model=str(model_dir), dtype="float32", block_size=4, kv_cache_tokens=256), 0,
                    ParallelState.single())
    fatal: list[str] = []
    coord = DecodeEngineCore(me, on_fatal=fatal.append)

    def admit(rid: str, prompt: list[int], max_tokens: int = 50):
        seq = me.engine.make_sequence(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                      rid)
        seq.block_table = me.engine.kv.allocator.allocate(-(-(len(prompt) + max_tokens) // 4))
        return seq

    def events_of(stream) -> list:
        events = []
        while (ev := stream.get(timeout=30)) is not None:
            events.append(ev)
            if ev.finished:
                break
        return events

    try:
        seq = admit("r1", [5, 6, 7])
        stream = coord.open_stream("r1")
        real_forward = me.engine.policy.forward
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected step failure")
            return real_forward(*args, **kwargs)

        me.engine.policy.forward = flaky
        coord.submit(EngineCommand(), 0)  # unknown command kinds are answered, not fatal
        me.engine.add_prefilled(seq, 9)
        events = events_of(stream)
        assert events[-1].finish_reason is FinishReason.ERROR and "injected" in events[-1].error
        assert events[-1].error.startswith(REQUEST_FAULT)  # the engine computes (its probe did): the request's fault
        assert wait_for(lambda: me.engine.kv.allocator.num_free == me.engine.kv.num_blocks)
        assert coord._thread.is_alive() and not fatal  # the loop went on

        me.engine.poison = Poison(((333, 4),))  # r3 raises from its fourth token on; r4 beside it must not care
        streams = {rid: coord.open_stream(rid) for rid in ("r3", "r4")}
        for rid, prompt in (("r3", [5, 333, 7]), ("r4", [5, 6, 8])):
            me.engine.add_prefilled(admit(rid, prompt, 20), 9)
        got = {rid: events_of(q) for rid, q in streams.items()}
        assert got["r3"][-1].finish_reason is FinishReason.ERROR and got["r3"][-1].error.startswith(REQUEST_FAULT)
        assert len(got["r3"]) == 3 + 1  # three tokens, then the error
        assert got["r4"][-1].finish_reason is FinishReason.LENGTH and len(got["r4"]) == 20 - 1  # 1st: with admit
        assert wait_for(lambda: me.engine.kv.allocator.num_free == me.engine.kv.num_blocks)
        me.engine.poison = None

        stream2 = coord.open_stream("r2")
        me.load = lambda: (_ for _ in ()).throw(RuntimeError("loop broken"))  # the loop itself fails
        assert stream2.get(timeout=30) is FATAL
        assert wait_for(lambda: bool(fatal)) and "loop broken" in fatal[0]
    finally:
        coord.stop()


def _start_decode(model_dir, tmp_path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """A decode service on a port it picked itself (port 0, reported through --port-file)."""
    port_file = tmp_path / "decode.port"
    proc = subprocess.Popen([sys.executable, "-m", "decode_service", "--model", str(model_dir), "--port", "0",
                             "--port-file", str(port_file), "--dtype", "float32", *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = wait_port_file(port_file, 120, proc)
        wait_serving(f"127.0.0.1:{port}", 120, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, port


def test_sigterm_always_exits(model_dir, tmp_path):
    proc, port = _start_decode(model_dir, tmp_path, "--drain-seconds", "1")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # the port is free again: a restart can bind it
    finally:
        if proc.poll() is None:
            proc.kill()


# --- authentication: secure by default --------------------------------------------------------------

def test_internal_services_need_the_cluster_secret(cluster):
    """Without the secret nobody can reserve (empty the pool), decode, or make prefill push anywhere;
    with it (what the router presents) the same calls work. Health stays open for probes."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.rpc.service import Credentials, channel

    reserve = internal_pb2.ReserveRequest(request_id="x", num_prompt_tokens=4, max_tokens=4)
    for creds in (None, Credentials("not-the-secret")):
        with channel(cluster.decode_addrs[0], creds) as ch:
            with pytest.raises(grpc.RpcError) as err:
                internal_pb2_grpc.DecodeStub(ch).Reserve(reserve, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with channel(cluster.prefill_addrs[0], creds) as ch:
            dest = internal_pb2.KVDestination(transport="tcp", endpoint="10.0.0.1:1", lease_id="0" * 32)
            with pytest.raises(grpc.RpcError) as err:
                internal_pb2_grpc.PrefillStub(ch).Prefill(internal_pb2.PrefillRequest(
                    request_id="x", prompt_token_ids=[1, 2], destination=dest), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _load(cluster).active_leases == 0
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        lease = stub.Reserve(reserve, timeout=10).destination.lease_id
        assert stub.Release(internal_pb2.ReleaseRequest(lease_id=lease), timeout=10).released


def test_a_service_started_without_a_secret_refuses_internal_calls(model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    proc, port = _start_decode(model_dir, tmp_path, env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                internal_pb2_grpc.DecodeStub(ch).Reserve(internal_pb2.ReserveRequest(
                    request_id="x", num_prompt_tokens=4, max_tokens=4), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.kill()
        proc.wait(30)


def test_an_all_greedy_batch_takes_one_pass_and_keeps_its_tokens(monkeypatch):
    """Greedy rows on the host take their argmax in one kernel pass (ops.greedy_tokens): torch's argmax, ties to
    the earliest token, at a 129,280-token vocabulary too; a batch with a NaN or an infinity anywhere goes the
    sanitizing way (the same tokens as before the kernel), and a greedy row with a logits processor never takes
    the kernel."""
    from shared.model import ops

    gen = torch.Generator().manual_seed(3)
    calls = []
    fused = ops.greedy_tokens
    monkeypatch.setattr(ops, "greedy_tokens", lambda x: calls.append(x.shape) or fused(x))
    for rows, vocab in ((1, 7), (256, 1024), (3, 129_280)):
        logits = (torch.randn(rows, vocab, generator=gen) * 3).round()  # many ties
        assert sample(logits, [SamplingParams(temperature=0)] * rows, [None] * rows) == logits.argmax(-1).tolist()
    assert len(calls) == 3
    logits = torch.randn(4, 64, generator=gen)
    logits[2, 5], logits[3, 9] = float("inf"), float("nan")
    assert fused(logits) is None and fused(logits[:2]) == logits[:2].argmax(-1).tolist()
    assert sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4) == [*logits[:2].argmax(-1).tolist(), 5,
                                                                              int(logits[3].nan_to_num(-1e9).argmax())]
    from tests.test_sampling_params import History

    biased = [SamplingParams(temperature=0, logit_bias={3: 100.0})]
    assert sample(torch.zeros(1, 64), biased, [None], histories=[History([1, 2])]) == [3]
    assert len(calls) == 4  # the non-finite batch asked the kernel (it said no); the biased one never did
