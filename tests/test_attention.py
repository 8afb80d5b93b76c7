"""MLA prompt attention in expanded (MHA) form against the absorbed form it replaces for prompt chunks."""

from __future__ import annotations

import pytest
import torch

from shared.kvcache.layout import Int8LatentRows
from shared.model import attention
from shared.model.batch import ForwardBatch, SeqChunk

BLOCK = 16
LATENT, ROPE = 512, 64


def _setup(heads: int, nope: int, v_dim: int, chunks: list[tuple[int, int]], seed: int, pool_dtype=torch.float32):
    """Requests (context before this step, new tokens) with scattered blocks; random rows, weights, queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(start + n) // BLOCK) for start, n in chunks]
    num_blocks = sum(need) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    seqs, used = [], 0
    for (start, n), blocks in zip(chunks, need):
        seqs.append(SeqChunk([1] * n, start, order[used : used + blocks]))
        used += blocks
    fb = ForwardBatch.build(seqs, BLOCK, torch.device("cpu"), split=False)
    pool = torch.randn(num_blocks, BLOCK, LATENT + ROPE, generator=gen).to(pool_dtype)
    w_uk = torch.randn(heads, nope, LATENT, generator=gen) / LATENT**0.5
    w_uv_t = torch.randn(heads, LATENT, v_dim, generator=gen) / LATENT**0.5
    q_nope = torch.randn(fb.num_tokens, heads, nope, generator=gen)
    q_pe = torch.randn(fb.num_tokens, heads, ROPE, generator=gen)
    return fb, pool, w_uk, w_uv_t, q_nope, q_pe


def _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, scale, codec=None) -> torch.Tensor:
    latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, c]
    query = torch.cat([latent, q_pe], -1)
    o_lat = fb.unpadded(attention.dense_attention(fb.padded(query), fb, pool, scale, LATENT, codec))
    return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [N, H, v]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_expanded_equals_absorbed_with_cached_context(pool_dtype):
    """Prompt chunks of different lengths, some after cached context (chunked prefill, prefix-cache
    hits), over scattered blocks: the MHA form gives the absorbed form's output to fp32 rounding."""
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(4, 32, 32, [(0, 70), (45, 50), (130, 64)], 1, pool_dtype)
    got = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.11)
    assert got is not None and got.shape == (fb.num_tokens, 4, 32)
    want = _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, 0.11)
    assert (got - want).abs().max().item() < 2e-5


def test_expanded_over_c8_rows_and_small_workspaces():
    """C8 rows are unpacked like the absorbed path does; a workspace that holds one request's expanded
    context at a time (request and query tiles) changes nothing."""
    codec = Int8LatentRows(LATENT, ROPE)
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(4, 32, 32, [(0, 60), (16, 48), (0, 80)], 2)
    pool = codec.encode(pool.view(-1, LATENT + ROPE)).view(pool.shape[0], BLOCK, -1)
    want = _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, 0.1, codec)
    whole = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.1, codec)
    assert (whole - want).abs().max().item() < 2e-5
    fb.workspace_bytes = 2_500_000
    tiled = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.1, codec)
    assert (tiled - want).abs().max().item() < 2e-5


def test_expanded_declines_decodes_and_short_chunks_after_long_context():
    """Few queries per request over a longer context (decodes, verification, a short chunk after a cached
    prefix) stay absorbed: expanding every key would cost more than it saves. A context past the
    workspace no longer sends a prompt to the absorbed form: the expanded form tiles its keys
    (tests/test_tiled_prompt_attention.py)."""
    dims = attention.HeadDims(4, 32, ROPE, 32, LATENT)
    fb = _setup(4, 32, 32, [(100, 1), (40, 1), (7, 1)], 3)[0]
    assert attention.prompt_form(fb, dims, sparse=False) is attention.PromptForm.ABSORBED
    fb = _setup(4, 32, 32, [(300, 8), (200, 6)], 3)[0]
    assert attention.prompt_form(fb, dims, sparse=False) is attention.PromptForm.ABSORBED
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(4, 32, 32, [(0, 200)], 4)
    assert attention.prompt_form(fb, dims, sparse=False) is attention.PromptForm.EXPANDED
    fb.workspace_bytes = 200 * 4 * (96 + 32 + 64) * 4  # less than the expanded keys and values alone
    got = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.1)
    assert (got - _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, 0.1)).abs().max().item() < 2e-5


def test_expanded_at_real_head_dims():
    """DeepSeek's per-layer dims (128 heads, nope 128, v 128): a 256-token prompt takes the MHA form within
    the default 256 MiB workspace and matches the absorbed form; a 2k-token prompt takes it too (its
    expanded keys alone would be 600 MB: they are expanded key tile by key tile); 16 tokens after 2k of
    cached context stay absorbed."""
    dims = attention.HeadDims(128, 128, ROPE, 128, LATENT)
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(128, 128, 128, [(0, 256)], 5)
    plans = []
    real = attention.plan_expanded_tiles
    try:
        attention.plan_expanded_tiles = lambda *a, **k: plans.append((a, real(*a, **k))) or plans[-1][1]
        got = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.07)
    finally:
        attention.plan_expanded_tiles = real
    assert attention.prompt_form(fb, dims, sparse=False) is attention.PromptForm.EXPANDED
    (_, _, _, _, per_pair, per_key, budget), tiles = plans[0]
    assert tiles.keys == 256
    assert tiles.requests * (tiles.queries * tiles.keys * per_pair + tiles.keys * per_key) <= budget
    want = _absorbed(fb, pool, w_uk, w_uv_t, q_nope, q_pe, 0.07)
    assert (got - want).abs().max().item() < 1e-4
    for (start, n), form in (((0, 2048), attention.PromptForm.EXPANDED), ((2048, 16), attention.PromptForm.ABSORBED)):
        fb = ForwardBatch.build([SeqChunk([1] * n, start, list(range(-(-(start + n) // BLOCK))))], BLOCK,
                                torch.device("cpu"))
        assert attention.prompt_form(fb, dims, sparse=False) is form


def test_fused_prompt_tiles_match_the_torch_ops_and_keep_a_request_to_itself(monkeypatch):
    """On the host, each key tile's scores, causal cut and online softmax run in one kernel call
    (cpu_kernels.prompt_attention_tile): the torch ops' result to fp32 rounding, over tiled keys too; a
    request's rows are the same bits alone or beside others (each query's sums are its own, whatever its
    pass-mates see), and a query told it sees more keys than the tile holds, or fewer than none, is held to
    the tile."""
    from shared.model import cpu_kernels

    calls = []
    fused = cpu_kernels.prompt_attention_tile
    monkeypatch.setattr(cpu_kernels, "prompt_attention_tile", lambda *a: calls.append(1) or fused(*a))
    fb, pool, w_uk, w_uv_t, q_nope, q_pe = _setup(4, 32, 32, [(0, 70), (45, 50), (130, 67)], 6)
    got = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.11)
    fb.workspace_bytes = 200 * 4 * (96 + 32 + 64) * 4  # key tiles: the softmax runs online across calls
    tiled = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.11)
    assert calls and not got.isnan().any()
    monkeypatch.setattr(cpu_kernels, "prompt_attention_tile", lambda *a: False)
    want = attention.expanded_attention(q_nope, q_pe, fb, pool, w_uk, w_uv_t, 0.11)
    assert (got - want).abs().max().item() < 1e-6 and (tiled - want).abs().max().item() < 1e-6
    monkeypatch.setattr(cpu_kernels, "prompt_attention_tile", fused)
    first = ForwardBatch.build([SeqChunk([1] * 70, 0, fb.block_tables[0, :5].tolist())], BLOCK, torch.device("cpu"))
    alone = attention.expanded_attention(q_nope[:70], q_pe[:70], first, pool, w_uk, w_uv_t, 0.11)
    assert torch.equal(alone, got[:70])

    g, s, qk, k, v = 8, 5, 96, 40, 32
    q, keys_t, values = torch.randn(g, s, qk), torch.randn(g, qk, k), torch.randn(g, k, v)
    state = (torch.empty(g, s), torch.empty(g, s), torch.empty(g, s, v))
    visible = torch.tensor([[-5, 0, 3, 40, 10**9]]).repeat(2, 1)
    assert cpu_kernels.prompt_attention_tile(q, keys_t, values, 33, visible, state, True)
    scores = torch.einsum("gsd,gdk->gsk", q, keys_t)[..., :33]
    for col, n in enumerate([0, 0, 3, 33, 33]):
        if n == 0:
            assert (state[1][:, col] == 0).all() and (state[2][:, col] == 0).all()
            continue
        p = torch.softmax(scores[:, col, :n], -1)
        want = torch.einsum("gk,gkv->gv", p, values[:, :n])
        assert torch.allclose(state[2][:, col] / state[1][:, col, None], want, atol=1e-5)
