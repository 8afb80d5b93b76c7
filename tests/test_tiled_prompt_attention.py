"""MLA prompt attention in expanded form, tiled over keys: exact against the absorbed form at DeepSeek's
per-layer head dims (128 heads, kv_lora 512, rope 64, nope / v 128) across key and query tile boundaries,
for whole prompts, chunks after cached context and context-parallel pieces; and the choice of form: a
2k-token dense prompt at the real dims now takes the expanded form, with or without an indexer."""

from __future__ import annotations

import pytest
import torch

from shared.kvcache import KVCache, KVLayout
from shared.loader.synthetic import random_model, real_layer_config
from shared.model import ForwardBatch, SeqChunk, attention
from shared.model.attention import HeadDims, PromptForm, prompt_form
from shared.model.cp import build_cp_batch
from shared.model.mla import MLA
from tests.test_attention import BLOCK, _absorbed, _setup

REAL = HeadDims(heads=128, nope=128, rope=64, v=128, latent=512)


def _spy_plans(monkeypatch) -> list[attention.Tiles]:
    plans: list[attention.Tiles] = []
    real = attention.plan_expanded_tiles

    def spy(*args, **kwargs) -> attention.Tiles:
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(attention, "plan_expanded_tiles", spy)
    return plans


@pytest.mark.parametrize("chunks", [[(0, 60)], [(37, 30)], [(0, 23), (20, 41), (64, 9)]],
                         ids=["whole", "after-cache", "mixed"])
def test_tiled_equals_absorbed_and_untiled_at_real_dims(chunks, monkeypatch):
    """Key tiles of two blocks (32 keys) and query tiles of 8 queries: tiles cut across the causal diagonal,
    the cached prefix and the request boundaries; the online softmax gives the absorbed form's output and
    the single-tile (untiled) expanded form's to fp32 rounding."""
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(128, 128, 128, chunks, 11)
    want = _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, 0.07)
    plans = _spy_plans(monkeypatch)
    whole = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.07)
    assert plans[-1].keys >= fb.max_context  # default workspace: one key tile, all queries
    monkeypatch.setattr(attention, "_KEY_TILE", 2 * BLOCK)
    monkeypatch.setattr(attention, "_QUERY_TILE", 8)
    fb.workspace_bytes = 15_000_000  # less than one request's whole expanded context, 2 blocks' keys
    tiled = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.07)
    assert plans[-1] == attention.Tiles(1, 8, 2 * BLOCK)
    assert tiled.shape == (fb.num_tokens, 128, 128)
    assert (tiled - want).abs().max().item() < 2e-5 * want.abs().max().item()
    assert (tiled - whole).abs().max().item() < 2e-5 * want.abs().max().item()


def test_tiled_single_block_tiles_and_bf16_rows(monkeypatch):
    """The smallest tiles (one block of keys, one query) over bf16 rows still match."""
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(8, 128, 128, [(5, 27)], 12, torch.bfloat16)
    want = _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, 0.1)
    plans = _spy_plans(monkeypatch)
    fb.workspace_bytes = 1
    got = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.1)
    assert plans[-1] == attention.Tiles(1, 1, BLOCK)
    assert (got - want).abs().max().item() < 2e-5 * want.abs().max().item()


def test_context_parallel_pieces_attend_exactly(monkeypatch):
    """A CP rank's zigzag pieces of a chunk after cached context (every rank holds the whole prefix, the
    new rows gathered before attention): each piece attends over the cache up to its own positions."""
    fb, pool, w_uk, w_uv_t, _, _ = _setup(128, 128, 128, [(0, 96)], 13)
    table = fb.block_tables[0].tolist()
    gen = torch.Generator().manual_seed(14)
    for rank in range(2):
        cp = build_cp_batch([SeqChunk([1] * 70, 26, table)], rank, 2, BLOCK, torch.device("cpu"), None, 0)
        assert cp.query_index.shape[0] == 2  # two pieces: rank and 2·cp − 1 − rank
        q_nope = torch.randn(cp.num_tokens, 128, 128, generator=gen)
        q_pe = torch.randn(cp.num_tokens, 128, 64, generator=gen)
        want = _absorbed(cp, pool, w_uk, w_uv_t, q_nope, q_pe, 0.07)
        monkeypatch.setattr(attention, "_KEY_TILE", BLOCK)
        cp.workspace_bytes = 8 << 20
        got = attention.expanded_attention(q_nope, q_pe, cp, pool, w_uk, w_uv_t, 0.07)
        assert (got - want).abs().max().item() < 2e-5 * want.abs().max().item()
    for rank in range(2):  # a 2k prompt at cp = 2: each rank's 1,024 queries over its pieces' contexts
        cp = build_cp_batch([SeqChunk([1] * 2048, 0, list(range(32)))], rank, 2, 64, torch.device("cpu"), None, 0)
        assert prompt_form(cp, REAL, sparse=False) is PromptForm.EXPANDED


def _prompt(start: int, n: int) -> ForwardBatch:
    blocks = -(-(start + n) // 64)
    return ForwardBatch.build([SeqChunk([1] * n, start, list(range(1, blocks + 1)))], 64, torch.device("cpu"))


def test_a_2k_dense_prompt_at_real_dims_takes_the_expanded_form():
    """2,048 fresh tokens (index_topk for V3.2: still dense) take the expanded form whatever the workspace;
    so does a 2k chunk after 30k of cached context (deepseek_v3: dense at every length). Decodes, short
    chunks after long context and sparse parts stay absorbed."""
    assert prompt_form(_prompt(0, 2048), REAL, sparse=False) is PromptForm.EXPANDED
    assert prompt_form(_prompt(30720, 2048), REAL, sparse=False) is PromptForm.EXPANDED
    assert prompt_form(_prompt(0, 2048), REAL, sparse=True) is PromptForm.ABSORBED
    assert prompt_form(_prompt(30720, 16), REAL, sparse=False) is PromptForm.ABSORBED
    assert prompt_form(_prompt(0, 300), REAL, sparse=False) is PromptForm.EXPANDED
    decode = ForwardBatch.build([SeqChunk([1], 4000, list(range(64)), generated=True)], 64, torch.device("cpu"))
    assert prompt_form(decode, REAL, sparse=False) is PromptForm.ABSORBED
    for model_type in ("deepseek_v32", "deepseek_v3"):  # the layer's own choice, at the real dims (no weights)
        with torch.device("meta"):
            mla = MLA(real_layer_config(model_type=model_type), torch.float32)
        assert mla.prompt_form(_prompt(0, 2048), sparse=False) is PromptForm.EXPANDED
        mla.expanded_prompts = False
        assert mla.prompt_form(_prompt(0, 2048), sparse=False) is PromptForm.ABSORBED


TINY = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=48,
            index_head_dim=16, index_n_heads=2, vocab_size=97)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "deepseek_v3"])
def test_model_routes_dense_chunks_expanded_and_matches_absorbed(model_type, monkeypatch):
    """A 96-token prompt in chunks of 48 (over the 32 queries per request from which expansion pays at
    these dims) through a one-layer model with index_topk 48: the first chunk is dense and expanded for
    both model types; the second (context 96 > 48) is sparse (absorbed) for V3.2 and dense, expanded, for
    V3. The logits equal those of the all-absorbed layer to fp32 rounding."""
    import shared.model.mla as mla_module

    cfg = real_layer_config(model_type=model_type, **TINY)
    model = random_model(cfg, torch.float32, seed=3)
    calls: list[int] = []
    real = mla_module.expanded_attention
    monkeypatch.setattr(mla_module, "expanded_attention",
                        lambda *a, **k: calls.append(a[2].max_context) or real(*a, **k))
    ids = torch.randint(2, 97, (96,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = {}
    for expanded in (True, False):
        for m in model.modules():
            if isinstance(m, MLA):
                m.expanded_prompts = expanded
        kv = KVCache(KVLayout.from_model_config(cfg, 4, model.dtype), 30, torch.device("cpu"))
        table = kv.allocator.allocate(kv.blocks_needed(96))
        with torch.inference_mode():
            logits[expanded] = torch.cat([model(ForwardBatch.build([SeqChunk(ids[s : s + 48], s, table)], 4,
                                                                   torch.device("cpu")), kv) for s in (0, 48)])
    assert calls == ([48] if model_type == "deepseek_v32" else [48, 96])
    assert (logits[True] - logits[False]).abs().max().item() < 1e-4
