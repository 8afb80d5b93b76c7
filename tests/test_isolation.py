"""A poison request fails alone (issue 44, item 3), and no lease outlives its writer (item 2).

Engine level: a step whose compute raises on one request is bisected down to that request; it fails
with a RequestFault, its neighbours get exactly the tokens they get alone (greedy, and seeded sampling
with logprobs), every block is free afterwards; in a prefill step, the others' pushes still carry
every block (cached prefix blocks too). Served: the same through prefill, decode and the
router (a poison token injected with $PDSERVE_FAULT_POISON): only the poisoned request fails, with
INTERNAL "request fault", no migration is counted and the pool is back to baseline. A KV write that
stalls mid-frame has its reservation reclaimed, so the next request gets the blocks instead of
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from router.cluster import Cluster
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.isolation import REQUEST_FAULT, RequestFault
from shared.engine.step import POISON_ENV, Poison
from shared.protocol.finish import FinishReason
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.transfer.tcp import HEADER, split_endpoint
from tests.helpers import wait_for
from tests.kv_proxy import KVProxy

POISON = 501  # a token id no other prompt here holds
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34]]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, seed=7, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)]


@pytest.fixture(scope="module")
def engine(served_model):
    return LLMEngine(EngineConfig(str(served_model), dtype="float32", block_size=4, kv_cache_tokens=512))


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Step every request to its end with step_isolated; (request → its sequence, request → its fault)."""
    seqs = {f"r{i}": engine.add_request(list(p), dataclasses.replace(sp), f"r{i}")
            for i, (p, sp) in enumerate(zip(prompts, params))}
    faults = {}
    while engine.has_work:
        for fault in engine.step_isolated().faults:
            faults[fault.seq.request_id] = fault
    return seqs, faults


def _alone(engine: LLMEngine) -> list[tuple[list[int], list]]:
    out = []
    for p, sp in zip(PROMPTS, PARAMS):
        seqs, faults = _run(engine, [p], [sp])
        assert not faults
        seq = seqs["r0"]
        out.append((list(seq.output_token_ids), [lp.logprob for lp in seq.logprobs]))
    return out


@pytest.mark.parametrize("where", ["forward", "after_sampling"])
def test_a_poisoned_request_fails_alone_and_its_neighbours_keep_their_tokens(engine, where):
    """Failing before the forward (an injected poison token) or after the batch sampled (the seeded
    neighbours' generators drew, and are put back for the retry)."""
    alone = _alone(engine)
    prompts = [p + [POISON] if i == 2 else p for i, p in enumerate(PROMPTS)]
    real_sample = engine.sample

    def sample(chunks, logits):
        tokens = real_sample(chunks, logits)
        if any(POISON in c.seq.prompt_token_ids and len(c.seq.output_token_ids) >= 3 for c in chunks):
            raise RuntimeError("injected fault after sampling")
        return tokens

    if where == "forward":
        engine.poison = Poison(((POISON, 3),))  # from its third decode step on (mid-stream)
    else:
        engine.sample = sample
    try:
        seqs, faults = _run(engine, prompts, PARAMS)
    finally:
        engine.poison = None
        vars(engine).pop("sample", None)
    assert set(faults) == {"r2"}
    fault = faults["r2"]
    assert fault.alone and isinstance(fault.error, RequestFault) and str(fault.error).startswith(REQUEST_FAULT)
    assert "injected fault" in str(fault.error)
    assert seqs["r2"].finish_reason is FinishReason.ERROR and len(seqs["r2"].output_token_ids) == 3
    for i in (0, 1, 3):
        seq = seqs[f"r{i}"]
        assert (list(seq.output_token_ids), [lp.logprob for lp in seq.logprobs]) == alone[i], i
    assert engine.kv.allocator.num_free == engine.kv.num_blocks and not engine.has_work


def test_a_request_whose_token_cannot_be_recorded_fails_alone(engine):
    """A failure after the compute (recording the token: grammar, stop checks) is pinned on its request."""
    alone = _alone(engine)
    real = engine._finish_reason

    def stop_reason(seq):
        if seq.request_id == "r1" and len(seq.output_token_ids) == 4:
            raise ValueError("bad stop check")
        return real(seq)

    engine._finish_reason = stop_reason
    try:
        seqs, faults = _run(engine, PROMPTS, PARAMS)
    finally:
        del engine._finish_reason
    assert set(faults) == {"r1"} and faults["r1"].alone and "bad stop check" in str(faults["r1"].error)
    for i in (0, 2, 3):
        assert list(seqs[f"r{i}"].output_token_ids) == alone[i][0], i
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_an_engine_that_fails_every_step_is_not_blamed_on_a_request(engine):
    """Nothing computes, not even the one-token probe: an engine error (callers may move the requests)."""
    real = engine.policy.forward

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.policy.forward = broken
    try:
        seqs, faults = _run(engine, PROMPTS[:2], PARAMS[:2])
    finally:
        engine.policy.forward = real
    assert set(faults) == {"r0", "r1"}
    assert all(not f.alone and not isinstance(f.error, RequestFault) for f in faults.values())
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_a_lone_poisoned_request_is_told_from_a_broken_engine(engine):
    """A batch of one: the probe forward works, so the request is the poison."""
    engine.poison = Poison(((POISON, 0),))
    try:
        _, faults = _run(engine, [[3, POISON, 4]], PARAMS[:1])
    finally:
        engine.poison = None
    assert faults["r0"].alone and isinstance(faults["r0"].error, RequestFault)
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


class _Push:
    """A KV push that records which lease blocks each layer sent, and commits at once."""

    def __init__(self):
        self.sent: dict[int, set[int]] = {}
        self.bytes_sent, self.aborted = 0, False

    def send_layer(self, layer: int, src_blocks: list[int], first: int) -> None:
        self.sent.setdefault(layer, set()).update(range(first, first + len(src_blocks)))

    def finish_async(self, on_end, commit: bool = True) -> None:
        on_end(None)

    def abort(self) -> None:
        self.aborted = True


def test_a_poisoned_prompt_fails_alone_in_the_prefill_step(engine):
    """One prefill step with three prompts, one poisoned: it alone fails (RequestFault, its push aborted);
    the others answer their first token as alone, and the one that starts from cached prefix blocks still
    pushes them on the retried step (its plan was retracted with the failed compute)."""
    from prefill_service.worker import AddPrompt, PrefillResult, PrefillWorker
    from shared.engine.core import RankCommand
    from shared.transfer import Destination

    outcomes: dict[str, object] = {}
    pushes: dict[str, _Push] = {}

    class Sender:
        def open(self, dest: Destination) -> _Push:
            return pushes.setdefault(dest.lease_id, _Push())

    worker = PrefillWorker(engine, lambda transport: Sender(), on_done=outcomes.__setitem__,
                           later=lambda command: worker.apply(RankCommand(command, 0, -1)))
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prefix = list(range(70, 87))  # four full blocks, cached by its own prefill
    prompts = {"cached": prefix[:16] + [90, 91], "poisoned": [60, POISON, 61], "plain": list(range(100, 111))}

    def prefill(names: list[str]) -> None:
        for name in names:
            prompt = prefix if name == "warm" else prompts[name]
            dest = Destination("tcp", "unused:1", name, b"t" * 16, list(range(8)), {})
            worker.apply(RankCommand(AddPrompt(name, prompt, greedy, dest), 0, -1))
        while engine.has_work:
            worker.step()

    free = engine.kv.allocator.num_free
    prefill(["cached", "plain"])
    alone = {name: outcomes.pop(name).first_token for name in ("cached", "plain")}
    prefill(["warm"])
    pushes.clear()
    engine.poison = Poison(((POISON, 0),))
    try:
        prefill(["cached", "poisoned", "plain"])
    finally:
        engine.poison = None
    assert isinstance(outcomes["poisoned"], RequestFault) and pushes["poisoned"].aborted
    for name in ("cached", "plain"):
        assert isinstance(outcomes[name], PrefillResult) and outcomes[name].first_token == alone[name], name
    layers = engine.model_config.num_hidden_layers
    assert outcomes["cached"].cached_prompt_tokens == 16  # its first chunk starts after four cached blocks
    assert all(pushes["cached"].sent[layer] >= set(range(5)) for layer in range(layers))  # which it pushes too
    assert engine.kv.allocator.num_free == free


def test_poison_spec_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_FAULT_POISON", "7:2, 9")
    assert Poison.from_env() == Poison(((7, 2), (9, 0)))
    monkeypatch.delenv("PDSERVE_FAULT_POISON")
    assert Poison.from_env() is None


# -- served: prefill, decode and the router as processes --------------------------------------------------
DECODE_POISON, PREFILL_POISON = 501, 502  # a decode step raises on the first, a prefill step on the second


class FreezingProxy(KVProxy):
    """A KV proxy whose mode "freeze" lets a new connection's first `freeze_after` bytes through (a frame's
    header and part of its payload) and then nothing more either way: the receiver holds an open frame
    whose writer went silent. Only one connection freezes; the proxy forwards again after it."""

    freeze_after = HEADER.size + 1000

    def __init__(self, port: int):
        super().__init__(port)
        self.frozen = threading.Event()

    def _pipe(self, conn: socket.socket) -> None:
        if self.mode != "freeze":
            return super()._pipe(conn)
        self.mode = "forward"
        up = socket.create_connection(self.target)
        sent = 0
        while sent < self.freeze_after and (data := conn.recv(self.freeze_after - sent)):
            up.sendall(data)
            sent += len(data)
        self.held += [conn, up]
        self.frozen.set()


@pytest.fixture(scope="module")
def cluster(served_model, tmp_path_factory):
    """Decode advertises its KV port on 127.0.0.2, where a FreezingProxy forwards to it; a 40-block pool;
    decode gives up a write after 1 s without a byte; poison tokens injected in every service."""
    old = os.environ.get(POISON_ENV)
    os.environ[POISON_ENV] = f"{DECODE_POISON}:2,{PREFILL_POISON}:0"
    try:
        c = Cluster(str(served_model), dtype="float32", log_dir=tmp_path_factory.mktemp("isolation-logs"),
                    extra_decode=["--advertise-host", "127.0.0.2", "--block-size", "4", "--kv-cache-tokens", "160",
                                  "--kv-stall-seconds", "1", "--reserve-wait-seconds", "9"],
                    extra_prefill=["--block-size", "4"], extra_router=["--metrics-port", "0"]).start()
    finally:
        if old is None:
            os.environ.pop(POISON_ENV, None)
        else:
            os.environ[POISON_ENV] = old
    try:
        with c.channel(c.decode_addrs[0]) as ch:
            stub = internal_pb2_grpc.DecodeStub(ch)
            dest = stub.Reserve(internal_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=4, max_tokens=4),
                                timeout=10).destination
            stub.Release(internal_pb2.ReleaseRequest(lease_id=dest.lease_id), timeout=10)
        c.proxy = FreezingProxy(split_endpoint(dest.endpoint)[1])
        try:
            yield c
        finally:
            c.proxy.close()
    finally:
        c.stop()


def _generate(cluster, prompt: list[int], max_tokens: int) -> list[int]:
    with cluster.channel(cluster.address) as ch:
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)), timeout=120))
    return [t for m in msgs for t in m.token_ids]


def _baseline(cluster) -> None:
    def clean() -> bool:
        with cluster.channel(cluster.decode_addrs[0]) as ch:
            load = internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)
        return load.free_blocks == load.total_blocks and load.active_leases == 0 and load.running == 0

    assert wait_for(clean, timeout=40), "the decode pool is not back to baseline"


def _migrations(cluster) -> float:
    port = cluster.metrics_ports[cluster.address]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^pdserve_router_migrations_total\{[^}]*\} (\S+)$", text, re.M))


def _concurrently(calls: dict[str, object]) -> dict[str, object]:
    """Run the callables at once; each one's result, or the exception it raised."""
    out: dict[str, object] = {}

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:  # the outcome under test
            out[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


@pytest.mark.parametrize("stage,poison", [("decode", DECODE_POISON), ("prefill", PREFILL_POISON)])
def test_a_poisoned_request_fails_alone_through_the_router(cluster, stage, poison):
    """Among concurrent requests one holds a poison token: it alone fails, with INTERNAL "request fault"
    (not UNAVAILABLE: the client should not retry it either), the others get exactly their tokens alone,
    the router moves nothing, and the pool is back to baseline."""
    prompts = {f"clean{i}": [40 + i, 41 + i, 42 + i, 43 + i, 44 + i] for i in range(4)}
    alone = {name: _generate(cluster, p, 16) for name, p in prompts.items()}
    _baseline(cluster)
    before = _migrations(cluster)
    calls = {name: functools.partial(_generate, cluster, p, 16) for name, p in prompts.items()}
    calls["poisoned"] = functools.partial(_generate, cluster, [60, 61, poison, 62], 16)
    out = _concurrently(calls)
    err = out.pop("poisoned")
    assert isinstance(err, grpc.RpcError), err
    assert err.code() == grpc.StatusCode.INTERNAL and err.details().startswith(REQUEST_FAULT), err.details()
    assert "injected fault" in err.details()
    assert out == alone
    assert _migrations(cluster) == before
    _baseline(cluster)


def test_a_stalled_kv_write_gives_its_blocks_to_the_next_request(cluster):
    """A push freezes in the middle of a frame while its reservation holds most of the pool: decode gives
    the write up after --kv-stall-seconds and frees its blocks, so the next request waits for them
    (--reserve-wait-seconds) instead of RESOURCE_EXHAUSTED; the frozen request moves on and completes."""
    big, small = list(range(3, 103)), list(range(110, 120))  # 100 + 40 tokens: 35 of the 40 blocks
    alone = {"big": _generate(cluster, big, 40), "small": _generate(cluster, small, 16)}
    _baseline(cluster)
    proxy = cluster.proxy
    proxy.frozen.clear()
    proxy.mode = "freeze"
    times: dict[str, float] = {}

    def small_after_freeze() -> list[int]:
        assert proxy.frozen.wait(60), "the push never reached the proxy"
        t0 = time.monotonic()
        tokens = _generate(cluster, small, 16)
        times["reclaimed"] = time.monotonic() - t0
        return tokens

    out = _concurrently({"big": functools.partial(_generate, cluster, big, 40), "small": small_after_freeze})
    assert proxy.frozen.is_set()
    assert out == alone, out
    print(f"\nstalled KV write: the next request was served {times['reclaimed']:.2f} s after the freeze")
    _baseline(cluster)


def test_a_tp2_requests_tokens_and_logprobs_do_not_depend_on_its_neighbours(tmp_path):
    """`pdserve up --prefill-tp 2 --decode-tp 2`, through the openai SDK: three prompts sent alone and then inside a
    12-prompt concurrent burst get the same text and logprobs. The sharded linears (o_proj, lm_head) had kept
    torch's fp32 GEMM, which rounds a row by its batch's size: every one of the three came back with logprobs an
    ulp apart. Afterwards no rank of either instance reports a KV block in use (the prefill instance counted its
    TP rank's scratch block as used)."""
    import openai

    from bench.fleet_faults import UpProcess

    up = UpProcess(["--model", "models/tiny-v32", "--port", "0", "--http-port", "0", "--prefill-tp", "2",
                    "--decode-tp", "2"], tmp_path / "logs").start()
    try:
        client = openai.OpenAI(base_url=up.http_url, api_key="unused")
        prompts = [f"Tell me about the number {i} and why it matters in the story of the {i}th king" for i in range(12)]

        def complete(prompt: str) -> tuple[str, list[float]]:
            choice = client.completions.create(model=up.model, prompt=prompt, max_tokens=12, temperature=0,
                                               logprobs=1).choices[0]
            return choice.text, choice.logprobs.token_logprobs

        alone = [complete(p) for p in prompts[:3]]
        with ThreadPoolExecutor(len(prompts)) as pool:
            burst = list(pool.map(complete, prompts))

        def blocks_used() -> list[float]:  # every rank of both instances (a TP rank's scratch block is not counted)
            return [float(v) for url in up.metrics.values()
                    for v in re.findall(r"^pdserve_kv_blocks_used\{.*\} (\S+)$", urllib.request.urlopen(url).read()
                                        .decode(), re.M)]

        assert wait_for(lambda: blocks_used() and not any(blocks_used()), timeout=15), blocks_used()
    finally:
        up.stop()
    assert all(logprobs for _, logprobs in alone)
    assert burst[:3] == alone
