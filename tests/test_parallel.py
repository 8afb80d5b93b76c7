"""Parallelism on real gloo process groups (2–4 processes, fp32), each run under a hard timeout."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from shared.kvcache import KVCache, KVLayout
from shared.loader import load_model
from shared.model import SeqChunk
from shared.model.cp import build_cp_batch, zigzag_ranges
from shared.parallel import ParallelConfig, ParallelState
from tests.dist_utils import run_ranks
from tests.helpers import engine_logits, random_prompts

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _state(rank: int, world: int, **cfg) -> ParallelState:
    return ParallelState.initialize(ParallelConfig(world=world, **cfg), rank, CPU)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1e-6)


def _close_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Indexer keys, stored FP8-rounded: as _close, but where a step computes in fp32 (a CPU without bf16
    arithmetic: torch's fp32 GEMMs round a row by its batch's size, so a CP rank's inputs differ from one rank's by
    an ulp) a value may round to the neighbouring FP8 step: at most one value in a hundred, by at most one step
    (an eighth of the largest), where a half-computed block differs everywhere."""
    if _close(a, b):
        return True
    scale = max(b.abs().max().item(), 1e-6)
    return (a != b).float().mean().item() <= 0.01 and (a - b).abs().max().item() <= scale / 8


def _kv_rows(model, kv: KVCache, table: list[int], n: int) -> list[dict]:
    return [kv.read_tokens(table, n, layer) for layer in range(model.config.num_hidden_layers)]


# --- context parallel prefill ---------------------------------------------------------------------

def test_zigzag_ranges_balance():
    assert zigzag_ranges(16, 2) == [[(0, 4), (12, 16)], [(4, 8), (8, 12)]]
    assert zigzag_ranges(1, 2) == [[(0, 1)], []]
    covered = sorted(t for r in zigzag_ranges(37, 3) for a, b in r for t in range(a, b))
    assert covered == list(range(37))


def _cp_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    state = _state(rank, world, cp=world, ep=world if 8 % world == 0 else 1)
    model, _ = load_model(path, "float32", parallel=state)
    out = []
    for prompt in prompts:
        kv = KVCache(KVLayout.from_model_config(model.config, 4, torch.float32), 32, CPU)
        table = kv.allocator.allocate(kv.blocks_needed(len(prompt)))
        scratch = kv.allocator.allocate(1)[0]
        fb = build_cp_batch([SeqChunk(prompt, 0, table)], rank, world, 4, CPU, state.world_group, scratch,
                            all_logits=True)
        logits = model(fb, kv)
        positions = [t for a, b in zigzag_ranges(len(prompt), world)[rank] for t in range(a, b)]
        out.append((positions, logits[: len(positions)], _kv_rows(model, kv, table, len(prompt))))
    return out


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("name", ["v32_dense", "v32_sparse"])
def test_cp_prefill_equals_single(ckpt, cp, name):
    path = str(ckpt(name))
    prompts = random_prompts(2, [41, 26], 512, seed=60) + [[7, 8, 9], [11]]  # last two shorter than 2·cp
    results = run_ranks(_cp_rank, cp, path, prompts)
    single, _ = load_model(path, "float32")
    for i, prompt in enumerate(prompts):
        want = engine_logits(single, prompt)
        kv = KVCache(KVLayout.from_model_config(single.config, 4, torch.float32), 32, CPU)
        table = kv.allocator.allocate(kv.blocks_needed(len(prompt)))
        from shared.model import ForwardBatch, SeqChunk

        single(ForwardBatch.build([SeqChunk(prompt, 0, table)], 4, CPU), kv)
        want_kv = _kv_rows(single, kv, table, len(prompt))
        seen = set()
        for positions, logits, kv_rows in (r[i] for r in results):
            seen.update(positions)
            if positions:
                assert _close(logits, want[positions]), f"prompt {i}: logits differ"
            for layer, (got, ref) in enumerate(zip(kv_rows, want_kv)):
                for kind in ref:  # every rank holds the whole prompt's KV after the gathers
                    assert _close(got[kind], ref[kind]), f"prompt {i} layer {layer} {kind}"
        assert seen == set(range(len(prompt)))


def _cp_generate_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    engine = LLMEngine(EngineConfig(model=path, block_size=4, max_num_batched_tokens=16, num_kv_blocks=96),
                       _state(rank, world, cp=world, ep=world if 8 % world == 0 else 1))
    seqs = [engine.add_request(p, GREEDY, f"r{i}") for i, p in enumerate(prompts[:-1])]
    prompts_per_step = []  # how many prompts each step computes chunks of (not how many are queued)
    schedule = engine.scheduler.schedule

    def counted():
        chunks = schedule()
        prompts_per_step.append(sum(1 for c in chunks if c.seq.num_cached < len(c.seq.prompt_token_ids)))
        return chunks

    engine.scheduler.schedule = counted
    while engine.has_work:
        engine.step()
    engine.scheduler.schedule = schedule
    late = engine.add_request(prompts[-1], GREEDY, "late")  # shares a cached prefix with prompt 0
    while engine.has_work:
        engine.step()
    free = engine.kv.allocator.num_free
    return [s.output_token_ids for s in [*seqs, late]], late.num_cached_prompt_tokens, max(prompts_per_step), free, \
        engine.usable_blocks


def _cp_push_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    """A CP prefill group's pushes, each block's rows copied when the push is queued: the earliest a
    transport may read them, and under CP the ranks' writes land in any order."""
    from prefill_service.worker import AddPrompt, PrefillWorker
    from shared.engine.core import RankCommand
    from shared.transfer import Destination, KVPush, KVSender
    from shared.transfer.base import cache_kinds, pool_of

    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, max_num_batched_tokens=10,
                                    speculative="mtp"), _state(rank, world, cp=world))
    kv, sent = engine.kv, []

    class Recording(KVPush):
        def send_layer(self, layer: int, src_blocks: list[int], first: int) -> None:
            for i, block in enumerate(src_blocks):
                rows = {kind: pool_of(kv, kind)[layer, block].clone() for kind in cache_kinds(kv.layout)}
                sent.append((self.dest.lease_id, layer, first + i, rows))
            super().send_layer(layer, src_blocks, first)

        def _connect(self) -> None: ...
        def _write(self, layer: int, kind: str, src_blocks: list[int], first: int) -> None: ...
        def _commit(self) -> None: ...

    class Sender(KVSender):
        def open(self, dest: Destination) -> KVPush:
            return Recording(kv, dest)

    done = {}
    prefill = PrefillWorker(engine, lambda transport: Sender(), on_done=done.__setitem__)
    for i, prompt in enumerate(prompts):
        dest = Destination("tcp", "decode:1", f"r{i}", bytes(16), list(range(kv.blocks_needed(len(prompt)))),
                           kv.layout.describe())
        prefill.apply(RankCommand(AddPrompt(f"r{i}", prompt, GREEDY, dest), 0, i))
    while engine.has_work:  # the ranks schedule alike: they step together
        prefill.step()
    return sent, sorted(done) if rank == 0 else None


def _prompt_rows(path: str, prompts: list[list[int]], **engine_kw) -> dict[tuple[int, ...], list[dict]]:
    """Each prompt's cached rows per layer (the MTP layer's included), computed on one rank and read
    as its request finishes."""
    llm = LLM(path, dtype="float32", block_size=4, **engine_kw)
    engine, rows = llm.engine, {}
    finish = engine.scheduler.finish

    def record(seq, reason: str) -> None:
        if seq.block_table:
            n = len(seq.prompt_token_ids)
            rows[tuple(seq.prompt_token_ids)] = [engine.kv.read_tokens(seq.block_table, n, layer)
                                                 for layer in range(engine.layout.num_layers)]
        finish(seq, reason)

    engine.scheduler.finish = record
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # MTP rows: all of the prompt
    return rows


def test_cp_prefill_pushes_each_block_once_when_final(tmp_path):
    """Chunks of 10 tokens end inside 4-token blocks, and consecutive chunks give such a block to
    different CP ranks. Each (layer, block) of every prompt — the MTP layer's too — is pushed exactly
    once, by one rank, with its final rows: an early copy of a half-computed block from one rank could
    otherwise land after the full copy from the other (their connections do not order their writes)."""
    from shared.loader.tiny import write_checkpoint

    path = str(write_checkpoint(tmp_path / "mtp", "deepseek_v32", tokenizer=False, mtp=True, index_topk=8,
                                vocab_size=512, num_hidden_layers=2))
    prompts = random_prompts(3, [23, 6, 37], 512, seed=41)
    want = _prompt_rows(path, prompts, speculative="mtp")
    results = run_ranks(_cp_push_rank, 2, path, prompts)
    assert results[0][1] == ["r0", "r1", "r2"]  # every prompt answered
    pushes = [p for sent, _ in results for p in sent]
    for i, prompt in enumerate(prompts):
        n, rows = len(prompt), want[tuple(prompt)]
        mine = [(layer, block, got) for lease, layer, block, got in pushes if lease == f"r{i}"]
        keys = sorted((layer, block) for layer, block, _ in mine)
        assert keys == [(layer, b) for layer in range(len(rows)) for b in range(-(-n // 4))], f"prompt {i}"
        for layer, block, got in mine:
            real = min(4, n - 4 * block)  # the prompt's rows in this block (the last one may be partial)
            for kind, ref in rows[layer].items():
                close = _close_fp8 if kind == "index" else _close
                assert close(got[kind][:real], ref[4 * block : 4 * block + real]), (i, layer, block, kind)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_engine_chunks_batches_and_caches_prefixes(ckpt, cp):
    """The one engine loop under the ContextSplit policy: several prompts per step, chunked to 16
    tokens, a prefix-cache hit, decode steps after them; same greedy tokens as one rank."""
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(3, [41, 26, 5], 512, seed=67)
    prompts.append(prompts[0][:32] + [3, 1, 4])
    want = [o.token_ids for o in LLM(path, block_size=4).generate(prompts, GREEDY)]
    for tokens, cached, batch, free, usable in run_ranks(_cp_generate_rank, cp, path, prompts):
        assert tokens == want
        assert cached == 32  # the late prompt reused prompt 0's first 8 blocks
        assert batch >= 2  # chunks of several prompts computed in one CP step
        assert free == usable  # every block back (cached ones are evictable)


def _lockstep_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    """Decode ranks in lock-step through the engine core's per-turn collectives, counting every
    pickled-object collective."""
    import torch.distributed as dist

    from decode_service.server import DecodeConfig
    from decode_service.worker import DecodeWorker
    from shared.engine.core import RankLink, take_turn

    me = DecodeWorker(DecodeConfig(model=path, dtype="float32", block_size=4, kv_cache_tokens=512), rank,
                    _state(rank, world, dp=world, ep=world))
    names = {100 * r + i: f"r{r}-{i}" for r in range(world) for i in range(len(prompts[r::world]))}
    for i, prompt in enumerate(prompts[rank::world]):  # each rank its own requests
        me.engine.add_request(prompt, GREEDY, f"r{rank}-{i}")
        me.handles[f"r{rank}-{i}"] = 100 * rank + i  # as an admit command's id would be
    me.names.update(names)
    pickled = []
    for name in ("broadcast_object_list", "gather_object", "all_gather_object"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: (pickled.append(_name), _real(*a, **k))[1])
    link, tokens = RankLink(me.state), {}
    while True:
        reports = take_turn(me, link, [])
        for report in reports or []:
            for ev in report.events:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
        if not me.engine.stepped:  # no rank had work: the lock-step agreed to stop
            break
    me.close()
    return tokens, pickled


def test_dp_lockstep_turns_move_fixed_tensors_only(ckpt):
    """Steady lock-step turns (no commands, no replies) gather each rank's load and token events as
    fixed-size tensors: no pickled collective at all, and rank 0 gets every rank's tokens by name."""
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(3, [6, 11, 9], 512, seed=68)
    want = [o.token_ids for o in LLM(path, block_size=4).generate(prompts, GREEDY)]
    (tokens, pickled0), (none, pickled1) = run_ranks(_lockstep_rank, 2, path, prompts)
    assert tokens == {"r0-0": want[0], "r1-0": want[1], "r0-1": want[2]}
    assert none == {} and pickled0 == [] and pickled1 == []


# --- expert parallelism ---------------------------------------------------------------------------

def _ep_rank(rank: int, world: int, path: str, prompts: list[list[int]], x: torch.Tensor):
    state = _state(rank, world, ep=world, dp=world)
    model, _ = load_model(path, "float32", parallel=state)
    logits = engine_logits(model, prompts[rank])  # every rank its own batch; MoE rows cross ranks
    moe = model.model.layers[1].mlp
    routed = moe(x[rank])
    moe.gate.e_score_correction_bias[: moe.per_rank] += 10.0  # every token picks rank 0's experts
    skewed = moe(x[rank])
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return logits, routed, skewed, expert_bytes


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_equals_single(ckpt, ep):
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(ep, [9, 14, 5, 20], 512, seed=61)
    x = torch.randn(ep, 6, 64, generator=torch.Generator().manual_seed(1))
    results = run_ranks(_ep_rank, ep, path, prompts, x)
    single, _ = load_model(path, "float32")
    moe = single.model.layers[1].mlp
    full_bytes = sum(p.numel() * p.element_size() for n, p in single.named_parameters() if ".experts." in n)
    for rank, (logits, routed, _, expert_bytes) in enumerate(results):
        assert _close(logits, engine_logits(single, prompts[rank]))
        assert _close(routed, moe(x[rank]))
        assert expert_bytes * ep == full_bytes  # each rank holds exactly its share of the experts
    moe.gate.e_score_correction_bias[: 8 // ep] += 10.0
    for rank, (_, _, skewed, _) in enumerate(results):
        ids, _ = moe.gate(x[rank])
        assert (ids < 8 // ep).all()  # ranks 1.. received zero tokens in this layer
        assert _close(skewed, moe(x[rank]))


# --- attention data parallel decode ---------------------------------------------------------------

def _dp_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    state = _state(rank, world, dp=world, ep=world)
    engine = LLMEngine(EngineConfig(model=path, block_size=4), state)
    if rank == 0:
        for i, p in enumerate(prompts):
            engine.add_request(p, GREEDY, f"r{i}")
    tokens: dict[str, list[int]] = {}
    steps = dummies = 0
    while True:
        had_work = engine.has_work
        events = engine.step()
        if not engine.stepped:
            break
        steps += 1
        dummies += not had_work
        for ev in events:
            tokens.setdefault(ev.seq.request_id, []).append(ev.token_id)
    return tokens, steps, dummies


def test_dp_idle_rank_runs_dummy_batches(ckpt):
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(3, [6, 17, 11], 512, seed=62)
    (tokens, steps0, dummies0), (idle_tokens, steps1, dummies1) = run_ranks(_dp_rank, 2, path, prompts)
    assert not idle_tokens and dummies0 == 0
    assert steps1 == steps0 == dummies1 > 0  # the idle rank stepped in lock-step, every time with a dummy
    want = [o.token_ids for o in LLM(path, block_size=4).generate(prompts, GREEDY)]
    assert [tokens[f"r{i}"] for i in range(3)] == want


# --- local tensor parallelism ---------------------------------------------------------------------

def _tp_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    state = _state(rank, world, tp=world)
    llm = LLM(path, block_size=4, parallel=state)
    model = llm.engine.model
    shapes = (tuple(model.lm_head.weight.shape), tuple(model.model.embed_tokens.weight.shape),
              tuple(model.model.layers[0].self_attn.o_proj.weight.shape))
    return [o.token_ids for o in llm.generate(prompts, GREEDY)], engine_logits(model, prompts[0]), shapes


def test_tp2_equals_single(ckpt):
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(3, [12, 30, 7], 512, seed=63)
    results = run_ranks(_tp_rank, 2, path, prompts)
    single = LLM(path, block_size=4)
    want_tokens = [o.token_ids for o in single.generate(prompts, GREEDY)]
    want_logits = engine_logits(single.engine.model, prompts[0])
    for tokens, logits, shapes in results:
        assert tokens == want_tokens
        assert _close(logits, want_logits)
        assert shapes == ((256, 64), (256, 64), (64, 32))  # vocab 512 and o_proj input 64 split in two


def test_all_to_sharded_then_sharded_to_all_needs_no_gather(ckpt):
    results = run_ranks(_chain_rank, 2, timeout=60)
    assert all(ok for ok in results)


def _chain_rank(rank: int, world: int):
    from torch import nn

    from shared.model.tensor_parallel import AllToShardedLinear, shard_linear

    state = _state(rank, world, tp=world)
    gen = torch.Generator().manual_seed(0)
    up, down = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        up.weight.copy_(torch.randn(16, 8, generator=gen))
        down.weight.copy_(torch.randn(8, 16, generator=gen))
    x = torch.randn(3, 8, generator=gen)
    want = down(torch.relu(up(x)))
    up_s = shard_linear(up, "all_to_sharded", world, state.tp_rank, state.tp_group)
    down_s = shard_linear(down, "sharded_to_all", world, state.tp_rank, state.tp_group)
    assert isinstance(up_s, AllToShardedLinear) and up_s(x).shape == (3, 8)  # a shard, not gathered
    return torch.allclose(down_s(torch.relu(up_s(x))), want, atol=1e-5)


# --- layer sharding -------------------------------------------------------------------------------

def _ls_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    state = _state(rank, world, dp=world, layer_sharding=("o_proj", "q_b_proj"))
    model, _ = load_model(path, "float32", parallel=state)
    logits = engine_logits(model, prompts[rank])
    sharded = {id(p): p for n, p in model.named_parameters() if n.endswith(("o_proj.weight", "q_b_proj.weight"))}
    stored = sum(p.numel() * p.element_size() for p in sharded.values())
    return logits, stored, list(model.sharder.events)


@pytest.mark.parametrize("k", [2, 4])
def test_layer_sharding(ckpt, k):
    path = str(ckpt("v32_4layers"))
    prompts = random_prompts(k, [10, 19, 6, 25], 512, seed=64)
    results = run_ranks(_ls_rank, k, path, prompts)
    single, _ = load_model(path, "float32")
    full = sum(p.numel() * p.element_size() for n, p in single.named_parameters()
               if n.endswith(("o_proj.weight", "q_b_proj.weight")))
    layers = single.config.num_hidden_layers
    for rank, (logits, stored, events) in enumerate(results):
        assert _close(logits, engine_logits(single, prompts[rank]))
        assert stored == full * len(range(rank, layers, k)) // layers  # only layers i with i % K == rank
        pos = {e: i for i, e in enumerate(events)}
        for i in range(layers - 1):  # layer i+1's broadcast is in flight while layer i computes
            assert pos[("broadcast_issued", i + 1)] < pos[("compute_start", i)] < pos[("compute_end", i)]
            assert pos[("compute_end", i)] < pos[("broadcast_waited", i + 1)]
