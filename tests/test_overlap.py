"""Overlap is proven by the order of a step's events, never by wall-clock time:

* under expert parallelism the shared expert computes while the EP dispatch is in flight;
* a prefill pushes a layer's KV while the following layers still compute.

Each test makes the overlap necessary, not just likely: the peer that the overlapped work waits on is
held back until the overlapping work has happened, so an implementation that serialized the two would
record the wrong order (or time out) and fail, however fast or slow the machine is."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from shared.model.moe import MoE
from tests.dist_utils import run_ranks
from tests.helpers import engine_logits, random_prompts, wait_for

HOLD_SECONDS = 30  # how long a held-back peer waits for the overlapping work before giving up


def _ep_overlap_rank(rank: int, world: int, path: str, flag_dir: str) -> tuple[list[str], list[bool]]:
    """Rank 0 records its first MoE layer's EP events and, once its shared expert is done, raises a flag;
    rank 1 enters that layer's dispatch only after the flag (so rank 0's dispatch cannot complete before its
    shared expert ran: it needs rank 1's rows)."""
    from shared.loader.checkpoint import load_model
    from shared.parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(world=world, dp=2, ep=2), rank, torch.device("cpu"))
    model, _ = load_model(path, "float32", "cpu", parallel=state)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    flag = Path(flag_dir) / "rank0-shared-expert-done"
    events: list[str] = []
    flag_seen: list[bool] = []

    def trace(event: str) -> None:
        events.append(event)
        if rank == 0 and event == "shared_end":
            flag.touch()
        if rank == 1 and event == "dispatch_start":
            flag_seen.append(wait_for(flag.exists, HOLD_SECONDS))

    moe.trace = trace
    engine_logits(model, random_prompts(1, [9 + 4 * rank], 512, seed=rank)[0])  # prompt rows: the EP path
    return events, flag_seen


def test_shared_expert_computes_while_the_ep_dispatch_is_in_flight(ckpt, tmp_path):
    results = run_ranks(_ep_overlap_rank, 2, str(ckpt("v32_sparse")), str(tmp_path))
    (events0, _), (events1, flag_seen) = results
    print("rank 0 EP events:", events0)
    want = ["dispatch_start", "dispatch_issued", "shared_start", "shared_end", "dispatch_wait", "dispatch_done"]
    assert events0 == want and events1 == want
    # rank 1 joined the dispatch only after rank 0's shared expert finished: rank 0's dispatch was issued
    # and still incomplete (it needs rank 1's rows) for the whole shared-expert computation
    assert flag_seen == [True]


def test_prefill_pushes_a_layer_while_the_next_layers_compute(ckpt):
    """Real TCP push from a prefill engine into a decode pool: layer 0's KV is written to decode before the
    last layer of the same forward starts (the last layer waits for that write; a push that began only after
    the forward would leave it waiting and fail), and only after layer 0 computed."""
    from prefill_service.engine import PrefillEngineCore
    from shared.engine import EngineConfig, LLMEngine, SamplingParams
    from shared.kvcache import KVCache
    from shared.kvcache.lease import LeaseTable
    from shared.transfer import TcpReceiver, make_sender
    from shared.transfer.base import cache_kinds
    from shared.transfer.tcp import TcpPush

    engine = LLMEngine(EngineConfig(model=str(ckpt("v32_4layers")), block_size=4))
    layers = engine.model.model.layers
    last = len(layers) - 1
    events: list[tuple[str, int]] = []
    lock, written, overlapped = threading.Lock(), threading.Event(), []

    def record(name: str, layer: int) -> None:
        with lock:
            events.append((name, layer))

    for layer in layers:
        i = layer.layer_idx

        def before(module, args, i=i) -> None:
            record("compute_start", i)
            if i == last:
                overlapped.append(written.wait(HOLD_SECONDS))

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(lambda module, args, out, i=i: record("compute_end", i))

    real_write = TcpPush._write

    def traced_write(self, layer: int, kind: str, src_blocks: list[int], first: int) -> None:
        record("push_start", layer)
        real_write(self, layer, kind, src_blocks, first)
        record("push_end", layer)
        if layer == 0:
            written.set()

    TcpPush._write = traced_write
    try:
        layout = engine.layout
        kv = KVCache(layout, 64, torch.device("cpu"))
        leases = LeaseTable(kv.ledger, layout.block_size, layout.num_layers, cache_kinds(layout), 30)
        receiver = TcpReceiver(kv, leases)
        worker = PrefillEngineCore(engine, lambda t: make_sender(t, engine.kv))
        prompt = random_prompts(1, [40], 512, seed=5)[0]
        lease = leases.reserve("r0", len(prompt) + 2, prompt_tokens=len(prompt))
        worker.prefill("r0", prompt, SamplingParams(max_tokens=2, temperature=0), receiver.destination(lease)
                       ).result(timeout=120)
        worker.stop()
        receiver.close()
    finally:
        TcpPush._write = real_write
    print("prefill step events:", events)
    assert overlapped == [True]  # layer 0's KV had landed on decode before the last layer started
    first_push = events.index(("push_end", 0))
    assert events.index(("compute_end", 0)) < events.index(("push_start", 0))  # pushed once computed
    assert first_push < events.index(("compute_start", last)) < events.index(("compute_end", last))
    assert leases.claim(lease.lease_id).blocks  # and the whole push completed
