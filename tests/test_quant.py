"""W8A8 INT8 weights/activations and the C8 KV cache: error bounds, model agreement, served equality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from router.cluster import Cluster
from shared.config import ModelConfig
from shared.engine import LLM, SamplingParams
from shared.kvcache import KVCache, KVLayout
from shared.kvcache.layout import Fp8KeyRows, Int8LatentRows
from shared.loader.checkpoint import load_model
from shared.loader.synthetic import random_model
from shared.loader.tiny import TINY, ensure_tiny_model
from shared.model.batch import ForwardBatch, SeqChunk, write_rows
from shared.model.layers import W8A8Linear
from shared.model.ops import dense_attention, sparse_attention
from shared.quant.fp8 import fake_quant_ue8m0
from shared.quant.int8 import Int8Linear, is_w8a8_target, quantize_activation
from tests.helpers import concurrent_greedy, engine_logits, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The embedded tiny model (hidden 256, 4 layers, 8 experts, kv_lora 512), generated as `make demo` does."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-v32")


# few and many rows, a row length off the vector widths, and K below int8_kernels.SMALL_K (torch._int_mm's sums)
@pytest.mark.parametrize(("rows", "k"), [(4, 208), (100, 208), (4, 200), (100, 300)])
def test_w8a8_linear_error_is_within_the_int8_bound(rows, k):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    x[0, 3] = 40.0  # an outlier channel: per-token scales keep the other tokens' precision
    layer = W8A8Linear.from_float(w)  # the model's W8A8 linear: the int8 kernel here
    y, ref = layer(x), x @ w.T
    assert torch.equal(y, Int8Linear.from_float(w)(x))  # the portable path's bits
    # |x·w − x̂·ŵ| ≤ Σ_k (|x̂_k|·|Δw_k| + |Δx_k|·|w_k|) with |Δw| ≤ s_w/2, |Δx| ≤ s_x/2; the integer sum is exact
    # (int32), then two fp32 roundings of the rescale.
    _, sx = quantize_activation(x)
    sw = layer.weight_scale
    bound = (x.abs() + sx / 2) @ (sw[:, None] / 2).expand(-1, k).T + (sx / 2) * w.abs().sum(1)
    bound = bound + ref.abs() * 1e-6 + 1e-6
    err = (y - ref).abs()
    print(f"W8A8 linear ({rows} rows): max error {err.max():.2e}, relative {(err.norm() / ref.norm()):.4f}, "
          f"worst error / bound {(err / bound).max():.3f}")
    assert (err <= bound).all()
    assert layer.weight.dtype == torch.int8 and layer.weight.element_size() == 1


def test_w8a8_targets_are_ascends_practice_linears():
    """MLA W8A8 (kv_b_proj excepted: absorbed at load), dense MLPs, shared and routed experts, indexer wq_b."""
    yes = ["model.layers.3.self_attn.q_b_proj.weight", "model.layers.3.self_attn.o_proj.weight",
           "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
           "model.layers.3.self_attn.indexer.wq_b.weight", "model.layers.3.mlp.shared_experts.down_proj.weight",
           "model.layers.3.mlp.experts.17.gate_proj.weight", "model.layers.3.mlp.experts.gate_up_proj"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.3.self_attn.kv_b_proj.weight",
          "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
          "model.layers.3.self_attn.kv_a_layernorm.weight", "model.layers.0.mlp.gate_proj.bias",
          "model.layers.3.self_attn.indexer.wk.weight", "model.layers.3.self_attn.indexer.weights_proj.weight"]
    assert all(is_w8a8_target(n) for n in yes) and not any(is_w8a8_target(n) for n in no)


def _layer_outputs(model, ids: list[int]) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outs.append(out.float()))
             for layer in model.model.layers]
    try:
        logits = engine_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return [*outs, logits]


def test_w8a8_model_tracks_bf16_layer_by_layer(tiny):
    bf16, _ = load_model(tiny, dtype="bfloat16", device="cpu")
    w8a8, _ = load_model(tiny, dtype="bfloat16", device="cpu", quantization="w8a8")
    attn = w8a8.model.layers[1].self_attn
    assert attn.o_proj.weight.dtype == attn.q_b_proj.weight.dtype == attn.indexer.wq_b.weight.dtype == torch.int8
    assert w8a8.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.int8
    assert w8a8.model.layers[1].mlp.shared_experts.up_proj.weight.dtype == torch.int8
    assert attn.q_a_proj.weight.dtype == attn.kv_a_proj_with_mqa.weight.dtype == torch.int8
    assert w8a8.model.layers[0].mlp.gate_proj.weight.dtype == torch.int8  # the dense layers' MLP too
    assert torch.int8 not in (attn.indexer.wk.weight.dtype, w8a8.lm_head.weight.dtype)
    ids = random_prompts(1, [96], 1024, seed=5)[0]  # beyond index_topk: sparse attention too
    cosines = [F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
               for a, b in zip(_layer_outputs(bf16, ids), _layer_outputs(w8a8, ids), strict=True)]
    print("W8A8 vs bf16 cosine per layer output (last: logits):", ", ".join(f"{c:.5f}" for c in cosines))
    assert min(cosines) >= 0.99


def test_random_w8a8_model_spreads_like_the_float_one():
    """bench/real_shapes.py --quantization w8a8 builds its layer this way: int8 weights over the whole ±127
    range with scales giving the float model's spread, so its activations (and cost) are a real model's."""
    cfg = ModelConfig.from_dict({**TINY, "model_type": "deepseek_v32"})
    bf16, w8a8 = random_model(cfg, torch.bfloat16), random_model(cfg, torch.bfloat16, quantization="w8a8")
    q, scale = w8a8.model.layers[1].self_attn.o_proj.weight, w8a8.model.layers[1].self_attn.o_proj.weight_scale
    assert q.dtype == torch.int8 and q.min() == -127 and q.max() == 127
    spread = (q.float() * scale[:, None]).std().item()
    assert 0.018 < spread < 0.022 and 0.018 < bf16.model.layers[1].self_attn.o_proj.weight.float().std() < 0.022
    assert w8a8.model.layers[1].mlp.experts.gate_up_proj.float().abs().mean() > 30  # experts filled too
    ids = random_prompts(1, [40], cfg.vocab_size, seed=2)[0]
    out_bf16, out_w8a8 = _layer_outputs(bf16, ids), _layer_outputs(w8a8, ids)
    ratio = out_w8a8[1].float().norm() / out_bf16[1].float().norm()  # a layer's output of the same scale
    assert 0.5 < ratio < 2


KJV = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
       "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
       "said, Let there be light: and there was light. The LORD is my shepherd; I shall not want. He maketh me to "
       "lie down in green pastures: he leadeth me beside the still waters. In the beginning was the Word, and the "
       "Word was with God, and the Word was God. And the light shineth in darkness; and the darkness "
       "comprehended it not.")


def test_w8a8_greedy_match_rate():
    """32 prompts × 20 greedy tokens on the trained demo model, W8A8 vs bf16, free-running (each model
    continues its own output, so one early flip changes the rest); also per step (W8A8's pick at each
    position of bf16's output). A random-weight model has near-flat logits, where free-running agreement
    cascades even between fp32 and bf16 (0.94 on the embedded tiny model; W8A8 0.79 there)."""
    from tests.conftest import ROOT

    demo = str(ROOT / "models" / "demo-v32")
    llms = {q: LLM(demo, dtype="bfloat16", quantization=q) for q in ("none", "w8a8")}
    ids = llms["none"].engine.tokenizer.encode(KJV)
    prompts = [ids[i : i + 12] for i in range(0, 3 * 32, 3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    runs = {q: [o.token_ids for o in llm.generate(prompts, params)] for q, llm in llms.items()}
    pairs = [(a, b) for x, y in zip(runs["none"], runs["w8a8"], strict=True) for a, b in zip(x, y, strict=True)]
    free_running = sum(a == b for a, b in pairs) / len(pairs)
    agree = 0
    for prompt, out in zip(prompts, runs["none"], strict=True):
        logits = engine_logits(llms["w8a8"].engine.model, prompt + out)
        agree += sum(int(t) == b for t, b in zip(logits[len(prompt) - 1 : -1].argmax(-1), out, strict=True))
    per_step = agree / len(pairs)
    print(f"W8A8 vs bf16 greedy match, demo model, 32 prompts x 20 tokens: free-running {free_running:.3f}, "
          f"per step {per_step:.3f}")
    assert len(pairs) == 32 * 20 and free_running >= 0.8 and per_step >= 0.8


def test_c8_layout_bytes_at_the_real_671b_dimensions():
    real = KVLayout(num_layers=61, block_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
                    dtype=torch.bfloat16, index_dtype=torch.bfloat16, kv_cache_dtype="int8")
    assert real.mla_bytes_per_token == 512 + 4 * 4 + 64 * 2 == 656
    assert real.index_bytes_per_token == 128 + 4
    bf16 = KVLayout(61, 64, 512, 64, 128, torch.bfloat16, torch.bfloat16)
    assert bf16.bytes_per_token_per_layer() == 576 * 2 + 128 * 2
    c8, full = real.bytes_per_token_per_layer(), bf16.bytes_per_token_per_layer()
    print(f"KV bytes per token per layer, real config: bf16 {full}, C8 {c8} ({c8 / full:.2f}x)")
    assert real.describe() != bf16.describe()  # peers with different caches refuse each other at the handshake


def test_c8_indexer_keys_are_stored_exactly_under_deepseek_numerics():
    keys = fake_quant_ue8m0(torch.randn(64, 128) * 3).to(torch.bfloat16)  # the indexer's own e4m3 / ue8m0 keys
    codec = Fp8KeyRows(128)
    stored = codec.encode(keys)
    assert stored.dtype == torch.uint8 and stored.shape == (64, 132)
    assert torch.equal(codec.decode(stored, torch.float32), keys.float())


@pytest.mark.parametrize("sparse", [False, True])
def test_c8_attention_matches_the_bf16_cache(tiny, sparse):
    cfg = ModelConfig.from_pretrained(tiny)
    g = torch.Generator().manual_seed(1)
    n, heads, bs = 80, 16, 16
    rows = torch.randn(n, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g).to(torch.bfloat16)
    query = torch.randn(n, heads, rows.shape[1], generator=g) * 0.1
    picks = torch.randint(0, n, (n, 24), generator=g).minimum(torch.arange(n)[:, None])  # causal picks
    outs = []
    for kv_dtype in ("auto", "int8"):
        layout = KVLayout.from_model_config(cfg, bs, torch.float32, kv_cache_dtype=kv_dtype)
        kv = KVCache(layout, 8, torch.device("cpu"))
        table = kv.allocator.allocate(kv.blocks_needed(n))
        fb = ForwardBatch.build([SeqChunk(list(range(n)), 0, table)], bs, torch.device("cpu"))
        codec = kv.mla_codec if layout.c8 else None
        write_rows(kv.mla[0], fb, rows if codec is None else codec.encode(rows))
        if sparse:
            out = sparse_attention(query, fb, kv.mla[0], picks, torch.ones_like(picks, dtype=torch.bool), 0.1,
                                   cfg.kv_lora_rank, codec)
        else:
            out = fb.unpadded(dense_attention(fb.padded(query), fb, kv.mla[0], 0.1, cfg.kv_lora_rank, codec))
        outs.append(out.float())
    cos = F.cosine_similarity(outs[0].flatten(1), outs[1].flatten(1), dim=-1)
    print(f"C8 vs bf16 cache, {'sparse' if sparse else 'dense'} attention output cosine: min {cos.min():.6f}")
    assert cos.min() >= 0.999
    assert isinstance(kv.mla_codec, Int8LatentRows) and kv.mla.dtype == torch.uint8


def test_c8_engine_greedy_is_close_to_the_bf16_cache(tiny):
    """Per step, not free-running: the C8 engine's next token after every prefix of the bf16 engine's greedy
    answer. (Free-running agreement cascades from the first near-tie on this random model's flat logits:
    0.78 on one CPU, above 0.8 on another, for the same code.)"""
    prompts = random_prompts(8, [5, 17, 40, 90], 1024, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bf16 = [o.token_ids for o in LLM(str(tiny), dtype="bfloat16").generate(prompts, params)]
    prefixes = [p + out[:t] for p, out in zip(prompts, bf16) for t in range(len(out))]
    truth = [out[t] for out in bf16 for t in range(len(out))]
    c8 = LLM(str(tiny), dtype="bfloat16", kv_cache_dtype="int8")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    got = [o.token_ids[0] for o in c8.generate(prefixes, one)]
    free = [o.token_ids for o in c8.generate(prompts, params)]
    rate = sum(a == b for a, b in zip(got, truth)) / len(truth)
    free_rate = sum(a == b for x, y in zip(bf16, free) for a, b in zip(x, y)) / len(truth)
    print(f"C8 vs bf16 KV cache greedy match rate: per step {rate:.3f}, free-running {free_rate:.3f}")
    assert rate >= 0.9


def test_w8a8_and_c8_served_disaggregated_equal_in_process(tiny, tmp_path):
    """Prefill pushes C8 rows (int8 latent + scales, FP8 indexer keys) to decode; both run W8A8. Prompts go
    one at a time, chunked alike (16 tokens) on both sides: a chunk's attention form (expanded or absorbed)
    depends on its length, and W8A8's per-token rounding can turn that last-bit difference into another
    greedy token on this random model's flat logits."""
    flags = ["--quantization", "w8a8", "--kv-cache-dtype", "int8", "--block-size", "4"]
    prompts = random_prompts(4, [6, 30, 70], 1024, seed=7)
    prompts += [prompts[2] + [9] * 11]  # a next turn: decode starts it on the C8 blocks it kept of the third
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    local = LLM(str(tiny), dtype="bfloat16", block_size=4, quantization="w8a8", kv_cache_dtype="int8",
                max_num_batched_tokens=16)
    want = [local.generate([p], params)[0].token_ids for p in prompts]
    with Cluster(str(tiny), dtype="bfloat16", log_dir=tmp_path / "logs", extra_decode=flags,
                 extra_prefill=[*flags, "--max-prefill-tokens", "16"]) as cluster:
        got = [concurrent_greedy(cluster.address, [p], max_tokens=10)[0] for p in prompts]
    assert got == want


def _w8a8_rank(rank: int, world: int, path: str, ids: list[int], shape: dict):
    from shared.parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(world=world, **shape), rank, torch.device("cpu"))
    model, _ = load_model(path, "float32", parallel=state, quantization="w8a8")
    int8 = sum(p.numel() for n, p in model.named_parameters() if p.dtype == torch.int8)
    return engine_logits(model, ids), int8


@pytest.mark.parametrize("shape", [dict(dp=2, ep=2), dict(tp=2), dict(dp=2, layer_sharding=("o_proj", "q_b_proj"))],
                         ids=["ep2", "tp2", "layer_sharding2"])
def test_w8a8_under_expert_tensor_and_layer_parallelism(ckpt, shape):
    """Each rank quantizes the weights it holds (EP: its experts; TP: its o_proj input slice, activations
    quantized whole before slicing; layer sharding: int8 weights broadcast): one rank's logits."""
    from tests.dist_utils import run_ranks

    path = str(ckpt("v32_sparse"))
    ids = random_prompts(1, [21], 512, seed=65)[0]
    single, _ = load_model(path, "float32", quantization="w8a8")
    want = engine_logits(single, ids)
    for logits, _ in run_ranks(_w8a8_rank, 2, path, ids, shape):
        cos = F.cosine_similarity(logits, want, dim=-1).min().item()
        print(f"W8A8 {shape}: logits cosine vs one rank {cos:.7f}, max diff {(logits - want).abs().max():.2e}")
        if "tp" in shape:  # each shard's exact integer sum is rescaled in fp32 before the all-reduce: close
            assert cos >= 0.99
        else:
            assert torch.allclose(logits, want, atol=1e-5, rtol=1e-5)


def test_fp8_checkpoint_kept_as_fp8_takes_one_byte_per_parameter(tmp_path, monkeypatch):
    """An FP8 release stays e4m3 + block scales in memory (`--quantization fp8`); the linears dequantize per
    block on the fly, which in fp32 reproduces the dequantize-at-load model exactly (both through torch's
    matmuls: with AVX-512 kernels the fp32 model's prompt rows would take them instead, ops.every_row, and round
    otherwise than the FP8 blocks' torch matmuls)."""
    from shared.loader.tiny import write_checkpoint
    from shared.model import ops

    monkeypatch.setattr(ops, "every_row", lambda weight: False)

    path = write_checkpoint(tmp_path / "fp8", "deepseek_v32", fp8=True, tokenizer=False, index_topk=8)
    dense, _ = load_model(path, dtype="float32", device="cpu")
    kept, _ = load_model(path, dtype="float32", device="cpu", quantization="fp8")
    assert kept.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert kept.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    ids = random_prompts(1, [40], 1024, seed=9)[0]
    assert torch.equal(engine_logits(dense, ids), engine_logits(kept, ids))
    params = dict(kept.named_parameters())
    fp8 = [n for n, p in params.items() if p.dtype == torch.float8_e4m3fn]
    numel = sum(params[n].numel() for n in fp8)
    stored = sum(params[n].numel() + params[n + "_scale_inv"].numel() * 4 for n in fp8)
    total = {name: sum(p.numel() * p.element_size() for p in m.parameters()) for name, m in (("dense", dense),
                                                                                              ("fp8", kept))}
    print(f"FP8 kept: {stored / numel:.4f} bytes per FP8 parameter (scales included); model {total['fp8'] / 2**20:.1f}"
          f" MiB vs {total['dense'] / 2**20:.1f} MiB dequantized to fp32")
    assert stored / numel < 1.01 and total["fp8"] < total["dense"] / 2


def test_fp8_and_int8_linears_stay_bounded_at_real_dimensions(monkeypatch):
    """Real o_proj (7168 × 16384): the on-the-fly FP8 dequant works on bounded tiles (≤ 2^24 weight elements,
    64 MiB in fp32), never the whole weight widened at once; the CPU W8A8 path multiplies in int8 (torch._int_mm
    without the kernels, as TP shards run): nothing but the [rows, out] result is ever fp32."""
    import shared.device as device
    import shared.quant.fp8 as fp8

    out_f, in_f = 7168, 16384
    tiles: list[int] = []
    real_dequant = fp8.dequant_block_fp8

    def recording(w, s, block, scale_fmt=None, dtype=torch.float32):
        tiles.append(w.numel())
        return real_dequant(w, s, block, scale_fmt, dtype)

    monkeypatch.setattr(fp8, "dequant_block_fp8", recording)
    weight = torch.zeros(out_f, in_f, dtype=torch.float8_e4m3fn)
    y = fp8.fp8_linear(torch.randn(2, in_f), weight, torch.ones(out_f // 128, in_f // 128), (128, 128), torch.float32)
    assert y.shape == (2, out_f) and sum(tiles) == out_f * in_f and max(tiles) <= 1 << 24

    widened: list[int] = []
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.numel()) or t.to(torch.float32))
    xq = torch.ones(100, in_f, dtype=torch.int8)
    y = device.int8_matmul(xq, torch.ones(100, 1), torch.ones(out_f, in_f, dtype=torch.int8), torch.ones(out_f))
    assert y.shape == (100, out_f) and torch.equal(y, torch.full((100, out_f), float(in_f)))
    assert max(widened) <= 100 * out_f  # the int32 result only
    print(f"largest FP8 tile {max(tiles):,} / W8A8 fp32 tensor {max(widened):,} elements (weight {out_f * in_f:,})")


def _c8_cp_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    from shared.engine import EngineConfig, LLMEngine
    from shared.parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(world=world, cp=world, ep=world), rank, torch.device("cpu"))
    engine = LLMEngine(EngineConfig(model=path, block_size=4, max_num_batched_tokens=16, num_kv_blocks=96,
                                    kv_cache_dtype="int8", quantization="w8a8"), state)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    return [s.output_token_ids for s in seqs]


def test_c8_and_w8a8_under_context_parallel_prefill(ckpt):
    """CP ranks all-gather each layer's new rows already packed (C8 bytes), so every rank's cache holds the
    same bytes a single rank writes: same greedy tokens."""
    from tests.dist_utils import run_ranks

    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(3, [37, 22, 5], 512, seed=68)
    single = LLM(path, block_size=4, max_num_batched_tokens=16, kv_cache_dtype="int8", quantization="w8a8")
    want = [o.token_ids for o in single.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                                          ignore_eos=True))]
    for tokens in run_ranks(_c8_cp_rank, 2, path, prompts):
        assert tokens == want
