"""Recorded decode steps (shared.model.tape, shared.engine.graphs): a replayed step gives the eager step's bits in
every configuration that takes it, refuses what it cannot replay, and is reachable (and visible) through
`pdserve up`."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch

from bench.fleet_faults import UpProcess
from shared.engine import LLM, SamplingParams
from shared.engine.graphs import graph_sizes
from shared.model import cpu_kernels
from shared.model.tape import TapeMismatch, record
from shared.model.tape import _kernel_call as tape_kernel_call
from shared.parallel import ParallelConfig, ParallelState
from shared.protocol.structured import ConstraintKind, StructuredOutput
from tests.dist_utils import run_ranks
from tests.helpers import concurrent_greedy

TINY = "models/tiny-v32"  # the random tiny model with a tokenizer (made on first use, as `pdserve up` does)
DEMO = "models/demo-v32"  # the trained demo model: it has an MTP layer


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(path, eager: bool, params: list[SamplingParams], prompts: list[list[int]], **kw):
    llm = LLM(str(path), max_num_seqs=16, enforce_eager=eager, **kw)
    out = llm.generate(prompts, params)
    return [o.token_ids for o in out], llm.engine.graphs


@pytest.mark.parametrize("name, kw", [
    ("v3", {}),
    ("v3", {"quantization": "w8a8"}),
    ("v32_dense", {"kv_cache_dtype": "int8"}),
    ("v32_dense", {"dtype": "float32"}),
    ("v3_wide_experts", {"dtype": "bfloat16"}),  # bf16 experts through oneDNN's grouped GEMMs (DeepSeek's sizes)
])
def test_replayed_decode_steps_are_the_eager_ones(ckpt, name, kw):
    """13 requests of different lengths finishing at different steps (the batch pads to 16, then 8, 4, 2, 1):
    every token equals the eager engine's, and most steps were replays."""
    prompts = _prompts(13)
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(13)]
    eager, none = _run(ckpt(name), True, params, prompts, **kw)
    replayed, graphs = _run(ckpt(name), False, params, prompts, **kw)
    assert none is None and replayed == eager
    assert graphs.stats.replays > graphs.stats.captures >= 4, graphs.stats
    assert not graphs.stats.refused, graphs.stats.refused


def _sampled_and_constrained(n: int, max_tokens: int = 12) -> list[SamplingParams]:
    """Seeded sampling (top-p, penalties) for all but the last request, a JSON-schema constraint for it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, presence_penalty=0.5)
              for i in range(n - 1)]
    return params + [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=StructuredOutput(
        ConstraintKind.JSON_SCHEMA, json.dumps(schema)))]


def test_sampled_and_constrained_requests_replay_alike():
    """Seeded sampling (top-p, penalties) and a JSON-schema constraint: the same tokens with and without graphs."""
    prompts, params = _prompts(6, seed=1), _sampled_and_constrained(6)
    eager, _ = _run(TINY, True, params, prompts)
    replayed, graphs = _run(TINY, False, params, prompts)
    assert replayed == eager and graphs.stats.replays > 0


def test_the_portable_path_is_refused_where_it_reads_values(ckpt, portable):
    """Without the C kernels the grouped experts size their groups from counts read on the host (`.tolist()`,
    which no torch op shows): the recording notices, keeps why, and the steps run eagerly with the same tokens."""
    portable(True)
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 5
    eager, _ = _run(ckpt("v3"), True, params, prompts)
    replayed, graphs = _run(ckpt("v3"), False, params, prompts)
    assert replayed == eager and graphs.stats.replays == 0
    assert graphs.stats.refused and all("tolist" in why for why in graphs.stats.refused.values())


@pytest.mark.parametrize("kw", [{}, {"kv_cache_dtype": "int8"}])
def test_sparse_contexts_replay_alike(ckpt, kw):
    """Past index_topk (8 here) every query attends to its top-k rows: the indexer's scores and selection read
    nothing on the host, so those steps are recorded and replayed too, with the eager tokens (C8 keys too)."""
    prompts = _prompts(3, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 3
    eager, _ = _run(ckpt("v32_sparse"), True, params, prompts, **kw)
    replayed, graphs = _run(ckpt("v32_sparse"), False, params, prompts, **kw)
    assert replayed == eager and graphs.stats.replays > 0 and not graphs.stats.refused, graphs.stats


def test_mtp_steps_replay_alike():
    """MTP (K = 2): verification steps (each request's last token and its drafts, logits and hidden states of
    every one) are recorded per draft count, and so are the MTP layer's own forwards (its catch-up over the
    accepted positions, its chained drafts); the output is still plain greedy decoding's."""
    prompts = _prompts(4, seed=5)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 4
    plain, _ = _run(DEMO, True, params, prompts)
    replayed, graphs = _run(DEMO, False, params, prompts, speculative="mtp", num_speculative_tokens=2)
    assert replayed == plain and not graphs.stats.refused
    assert any(key.each > 1 and key.hidden for key in graphs.graphs), list(graphs.graphs)
    assert any(key.mtp and key.each == 1 for key in graphs.graphs) and any(key.mtp and key.each > 1
                                                                          for key in graphs.graphs)


def _tp_rank(rank: int, world: int, path: str, prompts: list[list[int]], params: list[SamplingParams], kw: dict):
    """The TP engine's tokens eagerly (MTP aside: plain greedy decoding's), then with `kw` and recorded steps."""
    state = ParallelState.initialize(ParallelConfig(world=world, tp=world), rank, torch.device("cpu"))
    plain = {k: v for k, v in kw.items() if not k.startswith(("speculative", "num_speculative", "graph_memory"))}
    eager = LLM(path, max_num_seqs=8, parallel=state, enforce_eager=True, **plain).generate(prompts, params)
    kw = {k: v[rank] if k == "graph_memory_mb" else v for k, v in kw.items()}  # a budget per rank
    llm = LLM(path, max_num_seqs=8, parallel=state, **kw)
    stats = llm.engine.graphs.stats
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    return tokens == [o.token_ids for o in eager], stats.replays, stats.captures, stats.refused


@pytest.mark.parametrize("name, kw", [
    ("v32_sparse", {}),
    (DEMO, {"speculative": "mtp", "num_speculative_tokens": 2, "quantization": "w8a8", "kv_cache_dtype": "int8"}),
    (TINY, {}),  # seeded sampling with penalties, a JSON schema
])
def test_tp2_ranks_replay_their_collectives(ckpt, name, kw):
    """Local TP: both ranks record and replay the same keys, their all-reduces and all-gathers included; the
    tokens are the eager TP engine's (MTP's: plain greedy decoding's on the same shape)."""
    path = name if name in (DEMO, TINY) else str(ckpt(name))
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    if name == TINY:
        params = _sampled_and_constrained(5, max_tokens=16)
    for same, replays, captures, refused in run_ranks(_tp_rank, 2, path, _prompts(5, seed=7), params, kw):
        assert same and not refused, refused
        assert replays > captures > 0, (replays, captures)


def test_a_tp_rank_refused_a_recording_its_peers_drop_theirs(ckpt):
    """Rank 0 has no memory for recordings, rank 1 plenty: rank 1 must not replay a padded step while rank 0 runs
    it eagerly (their all-reduces would differ in shape): neither replays, and the tokens are the eager ones."""
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
    results = run_ranks(_tp_rank, 2, str(ckpt("v32_sparse")), _prompts(3, seed=8), params,
                        {"graph_memory_mb": (0, 2048)})
    for rank, (same, replays, captures, refused) in enumerate(results):
        assert same and replays == captures == 0
        assert all(("budget" if rank == 0 else "another rank") in why for why in refused.values()), refused


def _lockstep_tokens(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Step a DP rank until no rank has work (an idle rank runs dummy steps meanwhile), as the decode worker does."""
    tokens: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, f"r{i}")
    while True:
        for ev in engine.step():
            tokens.setdefault(ev.seq.request_id, []).append(ev.token_id)
        if not engine.stepped:
            return tokens


def _failing_once() -> None:
    _failing_once.calls = getattr(_failing_once, "calls", 0) + 1
    if _failing_once.calls == 1:
        raise TapeMismatch("sabotaged")


def _dp_rank(rank: int, world: int, path: str, prompts: list[list[int]], params: list[SamplingParams], kw: dict):
    """This DP rank's requests (every other one) eagerly, then with recorded steps: rank 1's last request ends
    early, so it runs dummy steps while rank 0 decodes on. With `sabotage`, rank 0's first replay meets a kernel
    returning otherwise halfway through."""
    state = ParallelState.initialize(ParallelConfig(world=world, dp=world, ep=world), rank, torch.device("cpu"))
    kw = dict(kw)
    sabotage = kw.pop("sabotage", False)
    mine, my_params = prompts[rank::world], params[rank::world]
    eager = _lockstep_tokens(LLM(path, max_num_seqs=8, parallel=state, enforce_eager=True, **kw).engine, mine,
                             my_params)
    engine = LLM(path, max_num_seqs=8, parallel=state, **kw).engine
    graphs = engine.graphs
    if sabotage and rank == 0:
        capture = graphs._capture

        def sabotaged(*args):
            out = capture(*args)
            for graph in graphs.graphs.values():
                graph.tape.calls.insert(len(graph.tape.calls) // 2, _failing_once)
            return out

        graphs._capture = sabotaged
    tokens = _lockstep_tokens(engine, mine, my_params)
    return tokens == eager, graphs.stats.replays, graphs.stats.captures, graphs.stats.refused


@pytest.mark.parametrize("kw", [{}, {"quantization": "w8a8", "kv_cache_dtype": "int8", "sabotage": True},
                                {"sampled": True}, {"speculative": "mtp", "num_speculative_tokens": 2},
                                {"graph_memory_mb": 0}],
                         ids=["plain", "w8a8-c8-mismatch", "sampled-schema", "mtp", "no-room"])
def test_dp2_ep2_ranks_pad_to_one_size_and_replay(ckpt, kw):
    """Attention-DP + EP: each rank's batch is its own (3 requests finishing at different steps on rank 0, 2 on
    rank 1, which then idles), all pad to the largest rank's size and exchange experts' rows in fixed shapes, so
    each rank replays its own recordings; the tokens are the eager DP engine's. Hostile: a replay on one rank
    that meets a kernel returning otherwise makes every rank run that step again eagerly (the tokens hold).
    With MTP the verification steps (1 + K tokens a request, and their hidden states) are replayed alike.
    Without room for the fixed exchange's buffers the ranks keep the all-to-all-v, eagerly."""
    prompts, path = _prompts(5, seed=9), str(ckpt("v32_sparse"))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 10, 20, 14, 16)]
    kw = dict(kw)
    if kw.pop("sampled", False):  # seeded sampling with penalties, and a JSON schema (rank 0's last request)
        path, params = TINY, _sampled_and_constrained(5, max_tokens=20)
    if "speculative" in kw:  # MTP verification steps (the idle rank's dummy takes their shape) on the demo model
        path = DEMO  # (its drafts are accepted: about 2.3 tokens a step, so three times the tokens)
        params = [SamplingParams(max_tokens=3 * p.max_tokens, temperature=0.0, ignore_eos=True) for p in params]
    results = run_ranks(_dp_rank, 2, path, prompts, params, kw)
    for rank, (same, replays, captures, refused) in enumerate(results):
        if kw.get("graph_memory_mb") == 0:
            assert same and replays == captures == 0 and not refused
            continue
        sabotaged = kw.get("sabotage", False) and rank == 0  # its longest-lived key was dropped: eager after
        assert same and captures > 0 and replays > (0 if sabotaged else captures), (rank, replays, captures)
        assert list(refused.values()) == (["sabotaged"] if sabotaged else []), refused


def _collectives_rank(rank: int, world: int):
    from shared.parallel.comm import all_reduce_sum, all_to_all_v

    ParallelState.initialize(ParallelConfig(world=world, tp=world), rank, torch.device("cpu"))
    x = torch.zeros(4)
    total, recording = record(lambda: all_reduce_sum(x * 1, None).clone())
    x.fill_(rank + 1.0)  # new inputs: the replay reduces them
    recording.tape.replay()
    _, varlen = record(lambda: all_to_all_v(x, [2, 2], [2, 2], None))
    return total.tolist(), varlen.tape is None and "collective" in varlen.refused


def test_a_tape_replays_fixed_collectives_and_refuses_host_sized_ones():
    for total, refused in run_ranks(_collectives_rank, 2, timeout=60):
        assert total == [3.0] * 4 and refused


def test_graph_sizes():
    assert graph_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and graph_sizes(256)[-1] == 256
    assert graph_sizes(1) == [1] and graph_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_a_tape_replays_torch_ops_and_kernels_on_new_inputs():
    """Casts, views, functional and in-place ops and a C kernel (rms_norm), replayed after the inputs change."""
    assert cpu_kernels.library() is not None  # built first, as an engine does before it serves
    x, w = torch.randn(3, 16).bfloat16(), torch.rand(16).bfloat16()

    def step() -> torch.Tensor:
        y = cpu_kernels.rms_norm(x, w, 1e-6)
        z = (y.float() * 2).view(-1)[:24]
        z.add_(1)
        return torch.cat([z, z.to(torch.bfloat16).float()])

    with torch.inference_mode():
        out, recording = record(step)
        assert recording.tape is not None and recording.tape.kept_bytes > 0
        x.copy_(torch.randn(3, 16))
        recording.tape.replay()
        assert torch.equal(out, step())


@pytest.mark.parametrize("reads", [lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: t[t > 0],
                                   lambda t: torch.randn(2)])
def test_a_step_that_reads_values_on_the_host_is_not_taped(reads):
    t = torch.randn(4)
    with torch.inference_mode():
        _, recording = record(lambda: reads(t + 1))
    assert recording.tape is None and recording.refused


def test_a_kernel_taking_another_branch_voids_the_replay():
    """Hostile: a replayed KV write whose slot now lies outside the pool returns another status than recorded:
    the replay raises TapeMismatch (the engine drops that recording and runs the step eagerly)."""
    from shared.kvcache.layout import Fp8KeyRows

    assert cpu_kernels.library() is not None
    codec = Fp8KeyRows(dim=16)
    pool = torch.zeros(2, 4, codec.width, dtype=torch.uint8)
    keys, slots = torch.randn(1, 16), torch.tensor([3])
    with torch.inference_mode():
        _, recording = record(lambda: cpu_kernels.index_key_write(keys, pool, slots, codec))
        slots.fill_(1000)
        with pytest.raises(TapeMismatch):
            recording.tape.replay()


def _steps(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {m: float(v) for m, v in re.findall(r'pdserve_decode_steps_total\{[^}]*mode="(\w+)"[^}]*\} (\S+)', text)}


def test_pdserve_up_replays_decode_steps(tmp_path):
    """Through the command, as a user starts it, with the decode pool's own shape (attention-DP 2 + EP 2): the
    decode instance replays its plain decode steps (its /metrics say so), and the greedy tokens are the in-process
    single-rank engine's (one rank and TP replay through the services too: tests/test_mtp_served.py;
    `--enforce-eager` reaching the decode service from `pdserve up` and the chart: tests/test_flags_reachable.py)."""
    prompts = [list(range(5 + i, 29 + 3 * i)) for i in range(4)]
    proc = UpProcess(["--model", TINY, "--port", "0", "--http-port", "0", "--decode-dp", "2", "--decode-ep", "2"],
                     tmp_path / "logs")
    try:
        up = proc.start()
        tokens = concurrent_greedy(up.grpc_address, prompts, max_tokens=24)
        (decode,) = [name for name in up.metrics if name.startswith("decode")]
        steps = _steps(up.metrics[decode])
    finally:
        assert proc.stop() == 0, proc.output()
    expected = LLM(TINY).generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert tokens == [o.token_ids for o in expected]
    assert steps.get("replayed", 0) >= 15 and steps.get("recorded", 0) >= 1, steps


def test_recordings_past_the_memory_budget_stay_eager(ckpt):
    """graph_memory_mb bounds what the recordings keep (their intermediates): past it a key runs eagerly."""
    prompts = _prompts(3, seed=4)
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * 3
    eager, _ = _run(ckpt("v3"), True, params, prompts)
    replayed, graphs = _run(ckpt("v3"), False, params, prompts, graph_memory_mb=0)
    assert replayed == eager and graphs.stats.replays == 0 and graphs.used_bytes == 0
    assert all("memory budget" in why for why in graphs.stats.refused.values()) and graphs.stats.refused


def test_another_threads_kernels_are_not_recorded():
    """Two engines in one process (in-process clusters run them on threads): a kernel another thread calls while
    this one records passes through, and is not in this recording."""
    import threading

    assert cpu_kernels.library() is not None
    x, w = torch.randn(2, 16).bfloat16(), torch.rand(16).bfloat16()
    started, finish = threading.Event(), threading.Event()

    def other() -> None:
        started.wait(10)
        cpu_kernels.rms_norm(x, w, 1e-6)  # while the main thread records
        finish.set()

    thread = threading.Thread(target=other)
    thread.start()

    def step() -> torch.Tensor:
        started.set()
        finish.wait(10)
        return x.float() * 2

    with torch.inference_mode():
        _, recording = record(step)
    thread.join()
    assert recording.tape is not None and finish.is_set()
    assert not any(getattr(call, "func", None) is tape_kernel_call for call in recording.tape.calls)
