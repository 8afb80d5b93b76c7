"""Engine behaviour: chunked prefill, block size and batch invariance, preemption, sampling, stops."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.loader.tiny import write_checkpoint
from shared.model.batch import SeqChunk
from tests.helpers import make_hf_checkpoint, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def sparse_path(ckpt):
    return str(ckpt("v32_sparse"))


def _tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_chunked_prefill_equals_one_shot(sparse_path):
    prompts = random_prompts(4, [37, 21, 50, 9], 512, seed=10)
    one_shot = _tokens(LLM(sparse_path, block_size=4, max_num_batched_tokens=4096), prompts)
    chunked = _tokens(LLM(sparse_path, block_size=4, max_num_batched_tokens=7), prompts)
    assert chunked == one_shot


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_block_size_invariance(sparse_path, block_size):
    prompts = random_prompts(3, [30, 11, 45], 512, seed=11)
    base = _tokens(LLM(sparse_path, block_size=4), prompts)
    assert _tokens(LLM(sparse_path, block_size=block_size), prompts) == base


def test_batch_invariance(sparse_path):
    llm = LLM(sparse_path, block_size=4)
    prompts = random_prompts(8, [5, 40, 13, 27, 8, 33, 19, 2], 512, seed=12)
    batch = _tokens(llm, prompts)
    for i in (0, 1, 7):
        assert _tokens(llm, [prompts[i]]) == [batch[i]]


def test_preemption_keeps_outputs(sparse_path):
    prompts = random_prompts(6, [20, 25, 30], 512, seed=13)
    roomy = _tokens(LLM(sparse_path, block_size=4), prompts)
    tight = LLM(sparse_path, block_size=4, num_kv_blocks=24)  # 6 requests × ~9 blocks do not fit at once
    assert _tokens(tight, prompts) == roomy
    assert tight.engine.kv.allocator.num_free == 24


def test_blocks_freed_after_generate(sparse_path):
    llm = LLM(sparse_path, block_size=4, num_kv_blocks=64)
    llm.generate(random_prompts(5, [10, 30], 512, seed=14), GREEDY)
    assert llm.engine.kv.allocator.num_free == 64 and not llm.engine.has_work


def test_the_warm_up_request_leaves_nothing_behind(sparse_path, monkeypatch):
    """A single-rank engine runs one short greedy request before it serves (its first calls, off the first
    users' TTFT) and keeps nothing of it: every block free, no cached prefix, no request, no request id taken,
    the default generator where its seed put it; an unseeded sampled request then draws what it would have."""
    from shared.engine.llm import LLMEngine

    steps: list[int] = []
    real_step = LLMEngine.step

    def counted(self, observer=None):
        steps.append(1)
        return real_step(self, observer)

    monkeypatch.setattr(LLMEngine, "step", counted)
    warmed = LLM(sparse_path, dtype="float32", block_size=4, seed=3)
    engine = warmed.engine
    assert len(steps) >= 3  # a prefill and decode steps ran
    assert engine.kv.allocator.num_free == engine.kv.num_blocks and engine.kv.allocator.cached_hashes() == []
    assert not engine.has_work and not engine._requests
    assert torch.equal(engine.default_generator.get_state(), torch.Generator().manual_seed(3).get_state())
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self: None)
    cold = LLM(sparse_path, dtype="float32", block_size=4, seed=3)
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    assert [o.token_ids for o in warmed.generate([[5, 6, 7], [9, 8]], params)] == \
        [o.token_ids for o in cold.generate([[5, 6, 7], [9, 8]], params)]
    assert engine.add_request([5], GREEDY).request_id == cold.engine.add_request([5], GREEDY).request_id


def _gemms_built(verbose: str) -> list[str]:
    """The 2-D matmuls (M x K : K x N; not attention's batched ones) oneDNN's verbose output says it built."""
    shapes = [line.split(",")[-2] for line in verbose.splitlines()
              if "create:cache_miss" in line and ",matmul," in line]
    return [s for s in shapes if all(side.count("x") == 1 for side in s.split(":"))]


def test_a_new_prompt_length_builds_no_gemm_primitive(sparse_path, capfd):
    """A bf16 engine's host GEMMs run at a few row counts (shared.device.host_gemm_rows), each built by oneDNN
    before the engine serves (Model.warm_host_gemms): prompts of lengths no step has had build no 2-D matmul
    primitive (oneDNN reports each it creates), and their tokens are those of an engine at exact row counts (a
    row's bits in bf16 do not depend on the rows beside it), which does build primitives for new lengths (the
    check can fail) where the CPU multiplies bf16: elsewhere the engine computes a bf16 model in fp32
    (shared.device.compute_dtype) and nothing builds a bf16 primitive."""
    import shared.device as device
    from shared.engine.llm import LLMEngine

    prompts = [list(range(3, 40)), list(range(5, 58))]  # 37 and 53 tokens: 90 rows in one step, 37 + 53 apart
    llm = LLM(sparse_path, dtype="bfloat16", seed=0)
    assert llm.engine.gemm_warm_seconds > 0
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        warm_tokens = _tokens(llm, prompts)
        alone = [_tokens(llm, [p]) for p in prompts]
    assert _gemms_built(capfd.readouterr().out) == []
    assert [a[0] for a in alone] == warm_tokens

    exact = pytest.MonkeyPatch()
    exact.setattr(device, "host_gemm_rows", lambda rows, dtype: 2 if rows == 1 else rows)
    exact.setattr(LLMEngine, "warm_up", lambda self: None)
    for module in ("shared.model.ops", "shared.model.moe"):
        exact.setattr(f"{module}.host_gemm_rows", lambda rows, dtype: 2 if rows == 1 else rows)
    try:
        cold = LLM(sparse_path, dtype="bfloat16", seed=0)
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            _tokens(cold, [list(range(7, 48)), list(range(9, 70))])  # 41 and 61 rows: not built before
        bf16_cpu = device.compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
        assert bool(_gemms_built(capfd.readouterr().out)) == bf16_cpu
        assert _tokens(cold, prompts) == warm_tokens
    finally:
        exact.undo()


def test_bf16_cache_rows_where_the_cpu_computes_bf16_models_in_fp32(sparse_path, monkeypatch):
    """A CPU without bf16 arithmetic computes a bf16 model in fp32 but keeps its KV cache rows (latent and indexer
    keys) in bf16: half the bytes fp32 copies took, one layout for the model on every CPU. The rows a bf16 model
    writes are bf16 values anyway and the kernels widen them exactly, so every token and log-probability is the
    bits of an engine that holds fp32 copies (prompts past index_topk: the indexer reads its keys too)."""
    import shared.device as device
    import shared.engine.llm as engine_llm

    monkeypatch.setattr(device, "_cpu_has_native_bf16", lambda: False)  # fp32 compute on every CI machine
    prompts = random_prompts(3, [9, 70, 150], 512, seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    held = LLM(sparse_path, dtype="bfloat16", seed=0)
    assert held.engine.kv.mla.dtype == held.engine.kv.index.dtype == torch.bfloat16
    want = [(o.token_ids, o.logprobs) for o in held.generate(prompts, params)]
    monkeypatch.setattr(engine_llm, "cache_dtype", lambda dtype, dev: torch.float32)
    copies = LLM(sparse_path, dtype="bfloat16", seed=0)
    assert copies.engine.kv.mla.dtype == torch.float32
    assert [(o.token_ids, o.logprobs) for o in copies.generate(prompts, params)] == want
    rows = copies.engine.kv.mla.flatten()
    assert rows.abs().sum() > 0 and torch.equal(rows.bfloat16().float(), rows)  # what fp32 copies held: bf16 values


def test_sampling_seeded_and_filters(sparse_path):
    llm = LLM(sparse_path, block_size=4)
    prompt = random_prompts(1, [10], 512, seed=15)
    greedy = _tokens(llm, prompt)
    assert _tokens(llm, prompt, SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True)) == greedy
    assert _tokens(llm, prompt, SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, ignore_eos=True)) == greedy
    seeded = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    a, b = _tokens(llm, prompt, seeded), _tokens(llm, prompt, seeded)
    other = _tokens(llm, prompt, SamplingParams(max_tokens=12, temperature=1.5, seed=8, ignore_eos=True))
    assert a == b and a != greedy and a != other


def test_stop_conditions(sparse_path):
    llm = LLM(sparse_path, block_size=4)
    prompt = random_prompts(1, [10], 512, seed=16)
    greedy = _tokens(llm, prompt)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[greedy[3]]))[0]
    assert out.token_ids == greedy[: greedy.index(greedy[3]) + 1] and out.finish_reason == "stop"
    eos = greedy[2]
    llm.engine.model_config = llm.engine.model_config.__class__(
        **{**llm.engine.model_config.__dict__, "eos_token_ids": (eos,)})
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.token_ids == greedy[: greedy.index(eos) + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == greedy and out.finish_reason == "length"


def test_text_prompts_and_stop_strings(tmp_path):
    path = write_checkpoint(tmp_path / "tiny", "deepseek_v32", num_hidden_layers=2)
    llm = LLM(str(path))
    out = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.token_ids and llm.engine.encode("Hello world")[0] == 0  # BOS
    stop = out.text[3:5]
    if stop:
        cut = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
        assert cut.finish_reason == "stop" and stop not in cut.text and out.text.startswith(cut.text)


@pytest.mark.parametrize("field,params", [
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("temperature", SamplingParams(temperature=-1)),
    ("top_p", SamplingParams(top_p=0)),
    ("top_p", SamplingParams(top_p=1.5)),
    ("top_k", SamplingParams(top_k=-2)),
])
def test_validation_names_field(sparse_path, field, params):
    llm = LLM(sparse_path)
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6]], params)


def test_validation_of_prompt(sparse_path):
    llm = LLM(sparse_path)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[5, 100000]], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5]], SamplingParams(max_tokens=10**6))


def test_long_prefill_does_not_stall_decodes(tmp_path):
    """One token budget per step: while a 2k-token prompt prefills in chunks, every running decode
    gets a token in every step (same forward), and all outputs equal the requests run alone."""
    sparse_path = str(write_checkpoint(tmp_path / "ctx4k", "deepseek_v32", tokenizer=False, index_topk=8,
                                       max_position_embeddings=4096, num_hidden_layers=2))
    short_prompts = random_prompts(3, [6, 9, 4], 512, seed=20)
    long_prompt = random_prompts(1, [2048], 512, seed=21)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(sparse_path, block_size=16, max_num_batched_tokens=256, kv_cache_tokens=8192)
    engine = llm.engine
    shorts = [engine.add_request(p, params) for p in short_prompts]
    while any(not s.output_token_ids for s in shorts):
        engine.step()
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps = 0
    while not long.output_token_ids:
        chunks = engine.scheduler.schedule()
        assert sum(c.num_tokens for c in chunks) <= 256
        events = engine.step_chunks(chunks)
        steps += 1
        assert sorted(ev.seq.request_id for ev in events if ev.seq in shorts) == sorted(s.request_id for s in shorts)
    assert steps >= 2048 // 256  # the prompt went through in chunks, decodes alongside each
    while engine.has_work:
        engine.step()
    alone = LLM(sparse_path, block_size=16)
    assert [s.output_token_ids for s in shorts] == _tokens(alone, short_prompts, params)
    assert long.output_token_ids == _tokens(alone, [long_prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                                               ignore_eos=True))[0]


def test_mixed_step_splits_attention_into_similar_parts():
    """A mixed step's attention never pads decodes to a chunk's length."""
    import torch

    from shared.model import ForwardBatch, SeqChunk

    chunks = [SeqChunk([1], 40, list(range(3))) for _ in range(5)] + [SeqChunk(list(range(100)), 0, list(range(7)))]
    fb = ForwardBatch.build(chunks, 16, torch.device("cpu"))
    parts = fb.attention_parts()
    assert [(p.start, p.stop) for p, _ in parts] == [(0, 5), (5, 105)]
    assert [tuple(b.query_index.shape) for _, b in parts] == [(5, 1), (1, 100)]
    uniform = ForwardBatch.build(chunks[:5], 16, torch.device("cpu"))
    assert uniform.attention_parts()[0][1] is uniform


def test_compiled_token_parts_give_the_same_tokens(sparse_path):
    """EngineConfig.compile (torch.compile of norms, MLPs, router): same greedy tokens as eager."""
    prompts = random_prompts(2, [9, 14], 512, seed=23)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert _tokens(LLM(sparse_path, compile=True), prompts, params) == _tokens(LLM(sparse_path), prompts, params)


def test_priority_orders_the_queue_then_first_come_first_served(sparse_path):
    """Lower priority values are scheduled first (vLLM's convention), equal ones in arrival order; one
    request at a time (max_num_seqs=1) makes the order visible. Tokens do not depend on it."""
    llm = LLM(sparse_path, block_size=4, max_num_seqs=1)
    prompts = random_prompts(5, [6, 9, 4, 7, 5], 512, seed=70)
    priorities = [1, 0, -1, 0, 1]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, (p, prio) in enumerate(zip(prompts, priorities)):
        llm.engine.add_request(p, params, f"r{i}", priority=prio)
    first_seen: list[str] = []
    while llm.engine.has_work:
        for ev in llm.engine.step():
            if ev.seq.request_id not in first_seen:
                first_seen.append(ev.seq.request_id)
    assert first_seen == ["r2", "r1", "r3", "r0", "r4"]
    assert _tokens(LLM(sparse_path, block_size=4), prompts, params) == \
        [o.token_ids for o in llm.generate(prompts, params, priority=priorities)]


def test_preemption_takes_the_least_urgent_request_first(sparse_path):
    """When the pool runs out, the running request preempted is the least urgent one even when it is the
    oldest (without priorities the newest goes); tokens are unchanged."""
    prompts = random_prompts(4, [20, 25, 30, 22], 512, seed=72)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _tokens(LLM(sparse_path, block_size=4), prompts, params)
    engine = LLM(sparse_path, block_size=4, num_kv_blocks=24).engine
    sched = engine.scheduler
    victims: list[tuple[int, int]] = []  # (victim's priority, least urgent running priority)
    real = sched.preempt

    def preempt(seq):
        victims.append((seq.priority, max(s.priority for s in sched.running)))
        return real(seq)

    sched.preempt = preempt
    seqs = [engine.add_request(prompts[0], params, "r0", priority=1)]  # the background request starts first
    engine.step()
    seqs += [engine.add_request(p, params, f"r{i}", priority=prio)
             for i, (p, prio) in enumerate(zip(prompts[1:], [0, 0, -1]), 1)]
    while engine.has_work:
        engine.step()
    assert [s.output_token_ids for s in seqs] == want
    print("preemptions (victim, least urgent running):", victims)
    assert victims and victims[0][0] == 1 and all(v == worst for v, worst in victims)


def test_decode_step_indices_equal_the_general_ones():
    """A decode step's batch tensors come from host lists (fewer ops); they equal what the general
    builder makes of the same step, on random block tables, positions and block sizes."""
    import random

    from shared.model import batch

    rng = random.Random(0)
    for _ in range(100):
        bs = rng.choice([1, 4, 16])
        chunks = []
        for _ in range(rng.randint(1, 12)):
            start = rng.randint(0, 90)
            table = rng.sample(range(500), start // bs + 1 + rng.randint(0, 2))
            chunks.append(SeqChunk([rng.randint(0, 99)], start, table))
        n_blocks = max(len(c.block_table) for c in chunks)
        tables = torch.tensor([c.block_table + [0] * (n_blocks - len(c.block_table)) for c in chunks])
        fast = batch._decode_indices(chunks, [1] * len(chunks), tables, bs)
        general = batch._chunk_indices(chunks, [1] * len(chunks), tables, bs)
        for a, b in zip(fast, general):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _cache_rows(engine, seq, positions: int) -> list[torch.Tensor]:
    """The request's MLA and indexer cache rows of every layer at positions 0 .. positions-1."""
    bs = engine.layout.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(positions)])
    pools = [p for p in (engine.kv.mla, engine.kv.index) if p is not None]
    return [pool.flatten(1, 2)[:, slots].clone() for pool in pools]


def _run_until(engine, seq, outputs: int) -> list[torch.Tensor]:
    """Step until `seq` has `outputs` tokens; its cache rows then (every position its outputs computed)."""
    while len(seq.output_token_ids) < outputs:
        engine.step()
    return _cache_rows(engine, seq, len(seq.prompt_token_ids) + outputs - 1)


def _decoded_then_resumed(path: str, dtype: str, mixed: bool, resumed_k: int = 7) -> None:
    """A request decodes 14 tokens beside another; sent again with its first `resumed_k` outputs (a
    migration: num_resumed) to a second engine, it recomputes them as generated rows: every cache row of
    every layer is bit for bit the row its decode steps wrote, and it goes on with the same tokens. With
    `mixed`, the second engine chunks at 20 tokens a step beside a third request's prompt; else its prompt
    step is the first engine's (the same two prompts)."""
    prompt, beside, later = random_prompts(3, [23, 31, 40], 512, seed=30)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    decoded = LLM(path, block_size=4, dtype=dtype).engine
    seq = decoded.add_request(prompt, params)
    decoded.add_request(beside, params)
    want = _run_until(decoded, seq, 12)
    while decoded.has_work:
        decoded.step()
    again = LLM(path, block_size=4, dtype=dtype, max_num_batched_tokens=20 if mixed else 4096).engine
    if mixed:
        again.add_request(later, params)
        again.step()
    resumed = again.add_request(prompt + seq.output_token_ids[:resumed_k], params, num_resumed=resumed_k)
    if not mixed:
        again.add_request(beside, params)
    got = _run_until(again, resumed, 12)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    while again.has_work:
        again.step()
    assert resumed.output_token_ids == seq.output_token_ids


@pytest.mark.parametrize("name", ["v32_sparse", "v32_dense"])
def test_resumed_outputs_are_recomputed_as_they_were_decoded(ckpt, name):
    _decoded_then_resumed(str(ckpt(name)), "float32", mixed=False)


def test_resumed_outputs_recompute_alike_in_mixed_chunked_steps(sparse_path):
    """bf16 (DeepSeek's dtype): its prompt rows, sparse past index_topk, are the same however they are chunked
    and batched, so a recompute in other steps than the decode's still gives every row bit for bit."""
    _decoded_then_resumed(sparse_path, "bfloat16", mixed=True)


def test_a_decode_attends_alike_beside_longer_contexts(tmp_path):
    """A step part goes sparse once any of its requests' contexts passes index_topk; a request whose context
    has not (all of it picked) must still get the rows of its dense attention, bit for bit, so that a
    decode's rows do not depend on which requests share its steps (and a migrated request's recompute, in
    other steps, gives the same rows)."""
    path = str(make_hf_checkpoint(tmp_path, "deepseek_v32", index_topk=30))
    short, longer = random_prompts(2, [12, 60], 512, seed=31)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    rows = []
    for alone in (False, True):
        engine = LLM(path, block_size=4).engine
        seq = engine.add_request(short, params)
        other = engine.add_request(longer, params)
        engine.step()  # both prompts in one step: the same prompt rows either way
        if alone:
            engine.abort(other.request_id)  # the short request then decodes alone: dense, not sparse
        rows.append(_run_until(engine, seq, 12))
    for a, b in zip(*rows, strict=True):
        assert torch.equal(a, b)


def test_a_prompt_takes_its_own_attention_form_whatever_shares_its_step(ckpt):
    """A dense prompt long enough for the expanded form keeps it beside a short prompt (the step splits them
    into parts): its cache rows are the ones it gets alone, bit for bit, so a re-prefill batched otherwise
    (a migration) computes the same prompt rows. In bf16, DeepSeek's dtype, whose matmuls here give a row
    the same bits whatever rows sit beside it (fp32's do not for a few rows: MoE experts' row counts
    change with the batch)."""
    dtype = "bfloat16"
    path = str(ckpt("v32_dense"))
    llm = LLM(path, block_size=4, dtype=dtype)
    longer, short = random_prompts(2, [llm.engine.expand_from + 8, 5], 512, seed=32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rows = []
    for beside in (False, True):
        engine = LLM(path, block_size=4, dtype=dtype).engine
        seq = engine.add_request(longer, params)
        if beside:
            engine.add_request(short, params)
        engine.step()  # the prompts, in one step
        rows.append(_cache_rows(engine, seq, len(longer)))
    for a, b in zip(*rows, strict=True):
        assert torch.equal(a, b)
