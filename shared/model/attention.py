"""MLA attention and indexer scoring over the paged cache, in bounded working memory.

Untiled, a step would hold tokens × heads × context scores (4k tokens × 128 heads × 4k context in
fp32 is 8.6 GB for one layer). Every function here cuts the work into tiles — request groups ×
query tiles × key tiles — whose working set fits `fb.workspace_bytes`:
* small steps are one tile: a single batched matmul, the fastest form on CPU;
* long contexts stream the keys through in tiles, with an online softmax (dense attention) or a
  running top-k merge (indexer), so memory no longer depends on the context length;
* sparse attention gathers each query's selected rows only: work O(S·k), not O(S·T);
* dense prompt chunks may expand the latent rows into per-head keys and values (MHA form), only
  where whole contexts fit the workspace; otherwise they take the absorbed, key-tiled path.
These are the portable forms: shared.model.ops runs decode steps and indexer picks through the fused CPU
kernel where it applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.device import compute_dtype
from shared.kvcache.layout import RowCodec
from shared.model.batch import ForwardBatch, gather_blocks, gather_rows

_MIN_QUERY_TILE = 16


@dataclass(frozen=True)
class Tiles:
    requests: int
    queries: int
    keys: int  # a whole number of blocks, or the whole padded context


def plan_tiles(num_requests: int, num_queries: int, context: int, block_size: int, per_pair: int,
               per_query: int, per_key: int, budget: int) -> Tiles:
    """Largest tiles whose bytes, r · (q · k · per_pair + q · per_query + k · per_key), fit `budget`:
    whole contexts for as many requests as fit; else one request with all its keys and as many
    queries as fit; else key tiles (whole blocks) for a query tile."""

    def cost(r: int, q: int, k: int) -> int:
        return r * (q * k * per_pair + q * per_query + k * per_key)

    whole = cost(1, num_queries, context)
    if whole <= budget:
        return Tiles(min(num_requests, max(1, budget // whole)), num_queries, context)
    queries = (budget - context * per_key) // (context * per_pair + per_query)
    if queries >= min(num_queries, _MIN_QUERY_TILE):
        return Tiles(1, min(num_queries, queries), context)
    queries = min(num_queries, 4 * _MIN_QUERY_TILE)
    keys = (budget - queries * per_query) // (queries * per_pair + per_key)
    keys = max(block_size, keys // block_size * block_size)
    return Tiles(1, queries, min(keys, context))


def _decode(codec: RowCodec | None, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered pool rows → rows in `dtype` (C8 rows are unpacked here, one tile at a time)."""
    return stored.to(dtype) if codec is None else codec.decode(stored, dtype)


def dense_attention(query: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, scale: float,
                    out_dim: int, codec: RowCodec | None = None) -> torch.Tensor:
    """Causal attention of padded queries [R, S, H, D] over each request's cached rows [T, D]
    (MQA: one row shared by all heads); returns the first `out_dim` dims of p·rows, [R, S, H, out_dim].
    Matmuls run in `compute_dtype` (fp32 on CPUs without bf16 arithmetic); `codec` unpacks stored rows."""
    r_all, s_all, heads, dim = query.shape
    size, t_pad = fb.block_size, fb.padded_context
    cdt = compute_dtype(query.dtype, query.device)
    isz = torch.empty((), dtype=cdt).element_size()
    tiles = plan_tiles(r_all, s_all, t_pad, size, per_pair=heads * (4 + isz),
                       per_query=heads * out_dim * 4 * 2, per_key=dim * isz + pool.shape[-1] * pool.element_size(),
                       budget=fb.workspace_bytes)
    out = query.new_empty(r_all, s_all, heads, out_dim)
    for r0 in range(0, r_all, tiles.requests):
        rows = slice(r0, min(r_all, r0 + tiles.requests))
        for s0 in range(0, s_all, tiles.queries):
            queries = slice(s0, min(s_all, s0 + tiles.queries))
            q = query[rows, queries].to(cdt)
            if tiles.keys >= t_pad:
                out[rows, queries] = _attend_whole(q, fb, pool, rows, queries, scale, out_dim, codec)
            else:
                out[rows, queries] = _attend_online(q, fb, pool, rows, queries, scale, out_dim, tiles.keys, codec)
    return out


def _attend_whole(q: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, rows: slice, queries: slice,
                  scale: float, out_dim: int, codec: RowCodec | None) -> torch.Tensor:
    r, s, heads, dim = q.shape
    keys = _decode(codec, gather_blocks(pool, fb.block_tables[rows]), q.dtype)  # [r, T, D]
    scores = torch.bmm(q.reshape(r, s * heads, dim), keys.transpose(1, 2)).view(r, s, heads, -1).mul_(scale)
    scores.masked_fill_(~fb.visible(rows, queries, 0, keys.shape[1])[:, :, None, :], float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype).view(r, s * heads, -1)
    return torch.bmm(probs, keys)[..., :out_dim].view(r, s, heads, out_dim)


def _attend_online(q: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, rows: slice, queries: slice,
                   scale: float, out_dim: int, key_tile: int, codec: RowCodec | None) -> torch.Tensor:
    """Flash-style: keys stream through in tiles; running max / sum / output in fp32. Tiles start at
    key 0, which every query sees, so the running max is finite after the first tile."""
    r, s, heads, dim = q.shape
    size = fb.block_size
    last = int(fb.query_pos[rows, queries].max()) + 1  # no query sees beyond this
    flat_q = q.reshape(r, s * heads, dim)
    run_max = torch.full((r, s, heads), float("-inf"), device=q.device)
    run_sum = torch.zeros(r, s, heads, device=q.device)
    acc = torch.zeros(r, s, heads, out_dim, device=q.device)
    blocks_per_tile = key_tile // size
    for b0 in range(0, -(-last // size), blocks_per_tile):
        keys = _decode(codec, gather_blocks(pool, fb.block_tables[rows, b0 : b0 + blocks_per_tile]), q.dtype)
        t0 = b0 * size
        scores = torch.bmm(flat_q, keys.transpose(1, 2)).view(r, s, heads, -1).float().mul_(scale)
        scores.masked_fill_(~fb.visible(rows, queries, t0, t0 + keys.shape[1])[:, :, None, :], float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(-1))
        alpha = torch.exp(run_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        run_sum = run_sum * alpha + p.sum(-1)
        pv = torch.bmm(p.to(q.dtype).view(r, s * heads, -1), keys)[..., :out_dim].view(r, s, heads, out_dim)
        acc = acc * alpha[..., None] + pv.float()
        run_max = new_max
    return acc / run_sum[..., None]


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor,
                       w_uk: torch.Tensor, w_uv_t: torch.Tensor, scale: float,
                       codec: RowCodec | None = None) -> torch.Tensor | None:
    """Causal MLA attention of prompt rows in its MHA form, as vLLM and SGLang prefill dense MLA: each
    cached latent row is expanded once per head into a key [k_nope | k_pe] and a value (c_kv · W_UK^T,
    c_kv · W_UV), and queries [q_nope | q_pe] score against those. Per query-key pair that is
    H·(nope + rope + v) multiply-adds instead of the absorbed H·(2·kv_lora + rope), so it wins once
    each row is seen by many queries (a prompt chunk), not for decodes. q_nope [N, H, nope] and the
    rotated q_pe [N, H, rope] are flat; returns [N, H, v] in the weights' dtype, or None where the
    absorbed form is cheaper or a request's expanded context does not fit `fb.workspace_bytes` (the
    caller then attends in absorbed form, which tiles keys)."""
    r_all, s_all = fb.query_index.shape
    heads, nope, c = w_uk.shape
    rope, v_dim, t_pad = q_pe.shape[-1], w_uv_t.shape[-1], fb.padded_context
    qk = nope + rope
    # Per request of S queries over T keys: absorbed S·T·(2c + rope), expanded T·(c·(nope + v) + S·(qk + v))
    # (per head, each side's W_UK / W_UV matmuls included): expanded only pays with enough queries per
    # request (34 at the tiny test dims, 171 at DeepSeek's), never for decodes.
    if fb.num_tokens * (2 * c + rope - qk - v_dim) <= r_all * c * (nope + v_dim):
        return None
    cdt = w_uk.dtype
    isz = torch.empty((), dtype=cdt).element_size()
    per_key = pool.shape[-1] * pool.element_size() + (c + rope + heads * (qk + nope + 2 * v_dim)) * isz
    tiles = plan_tiles(r_all, s_all, t_pad, fb.block_size, per_pair=heads * (4 + 4),
                       per_query=heads * (qk * isz + v_dim * 4), per_key=per_key, budget=fb.workspace_bytes)
    if tiles.keys < t_pad:
        return None
    query = fb.padded(torch.cat([q_nope.to(cdt), q_pe.to(cdt)], -1))  # [R, S, H, qk]
    out = query.new_empty(r_all, s_all, heads, v_dim)
    w_k = w_uk.view(heads * nope, c).t()  # [c, H·nope]: a view, no copy of the weights
    for r0 in range(0, r_all, tiles.requests):
        rows = slice(r0, min(r_all, r0 + tiles.requests))
        latent = _decode(codec, gather_blocks(pool, fb.block_tables[rows]), cdt)  # [r, T, c + rope]
        r, t = latent.shape[:2]
        c_kv = latent[..., :c].reshape(r * t, c)
        keys = latent.new_empty(r, heads, t, qk)
        keys[..., :nope] = (c_kv @ w_k).view(r, t, heads, nope).transpose(1, 2)
        keys[..., nope:] = latent[:, None, :, c:]  # k_pe: one per row, shared by the heads
        values = torch.stack([c_kv @ w_uv_t[h] for h in range(heads)], 1).view(r, t, heads, v_dim).transpose(1, 2)
        for s0 in range(0, s_all, tiles.queries):
            queries = slice(s0, min(s_all, s0 + tiles.queries))
            scores = torch.matmul(query[rows, queries].transpose(1, 2), keys.transpose(2, 3)).mul_(scale)
            scores.masked_fill_(~fb.visible(rows, queries, 0, t)[:, None], float("-inf"))  # [r, H, s, T]
            probs = scores.softmax(-1, dtype=torch.float32).to(cdt)
            out[rows, queries] = torch.matmul(probs, values).transpose(1, 2)
    return fb.unpadded(out)


def sparse_attention(query: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, picks: torch.Tensor,
                     valid: torch.Tensor, scale: float, out_dim: int, codec: RowCodec | None = None) -> torch.Tensor:
    """Each flat query [N, H, D] attends only to its selected context positions `picks` [N, k]
    (`valid` marks real picks): their rows are gathered per query tile, so work and memory are
    O(N · k) whatever the context length."""
    n_all, heads, dim = query.shape
    k = picks.shape[1]
    cdt = compute_dtype(query.dtype, query.device)
    isz = torch.empty((), dtype=cdt).element_size()
    per_query = k * (dim * isz + pool.shape[-1] * pool.element_size()) + heads * k * (4 + isz) + k * 8
    step = max(1, fb.workspace_bytes // per_query)
    out = query.new_empty(n_all, heads, out_dim)
    for n0 in range(0, n_all, step):
        tile = slice(n0, min(n_all, n0 + step))
        keys = _decode(codec, gather_rows(pool, fb.slots_of(fb.token_request[tile], picks[tile])), cdt)  # [n, k, D]
        scores = torch.bmm(query[tile].to(cdt), keys.transpose(1, 2)).mul_(scale)  # [n, H, k]
        scores.masked_fill_(~valid[tile, None, :], float("-inf"))
        probs = scores.softmax(-1, dtype=torch.float32).to(cdt)
        out[tile] = torch.bmm(probs, keys)[..., :out_dim]
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, k: int,
                 scale: float, compute_dtype: torch.dtype, codec: RowCodec | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning-indexer selection for padded queries q [R, S, H, D] with head weights [R, S, H] (fp32):
    I[s, t] = Σ_h w[s, h] · ReLU(q[s, h] · key[t] · scale) over causal keys t ≤ pos(s); returns the
    top-k context positions [R, S, k] and which of them are real (finite score) picks. q·k runs in
    `compute_dtype` with the per-head scores kept in fp32; key tiles merge into a running top-k."""
    r_all, s_all, heads, dim = q.shape
    size, t_pad = fb.block_size, fb.padded_context
    csz = torch.tensor([], dtype=compute_dtype).element_size()
    tiles = plan_tiles(r_all, s_all, t_pad, size, per_pair=heads * (4 + csz) + 8,
                       per_query=2 * k * 12, per_key=dim * csz + pool.shape[-1] * pool.element_size(),
                       budget=fb.workspace_bytes)
    picks = torch.empty(r_all, s_all, k, dtype=torch.long, device=q.device)
    valid = torch.empty(r_all, s_all, k, dtype=torch.bool, device=q.device)
    q = q.to(compute_dtype)
    for r0 in range(0, r_all, tiles.requests):
        rows = slice(r0, min(r_all, r0 + tiles.requests))
        for s0 in range(0, s_all, tiles.queries):
            queries = slice(s0, min(s_all, s0 + tiles.queries))
            qt, wt = q[rows, queries], weights[rows, queries]
            r, s = qt.shape[:2]
            last = int(fb.query_pos[rows, queries].max()) + 1
            best_val = best_idx = None
            for t0 in range(0, last, tiles.keys):
                keys = gather_blocks(pool, fb.block_tables[rows, t0 // size : (t0 + tiles.keys) // size])
                scores = torch.bmm(qt.reshape(r, s * heads, dim), _decode(codec, keys, compute_dtype).transpose(1, 2))
                scores = torch.relu(scores.float().mul_(scale)).view(r, s, heads, -1)
                index = torch.einsum("rsh,rsht->rst", wt, scores)
                index.masked_fill_(~fb.visible(rows, queries, t0, t0 + keys.shape[1]), float("-inf"))
                positions = torch.arange(t0, t0 + keys.shape[1], device=q.device).expand(r, s, -1)
                if best_val is not None:  # running merge: the top-k of (best so far ∪ this tile)
                    index, positions = torch.cat([best_val, index], -1), torch.cat([best_idx, positions], -1)
                best_val, best_idx = _topk_ties_to_earliest(index, positions, min(k, index.shape[-1]))
            n = best_val.shape[-1]
            picks[rows, queries, :n], valid[rows, queries, :n] = best_idx, torch.isfinite(best_val)
            if n < k:  # fewer keys than k in the whole range: the rest are padding
                picks[rows, queries, n:], valid[rows, queries, n:] = 0, False
    return picks, valid


def _topk_ties_to_earliest(values: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by value where equal values go to the earliest positions. DeepSeek's FP8 indexer scores tie
    exactly (often at 0 after the ReLU); plain topk breaks ties by where a candidate sits in the tile, so
    the picks, and the tokens, would depend on how a step's keys were tiled (chunking, batch
    composition). Candidates are put in position order, then stably sorted by value."""
    order = positions.argsort(-1)
    values, positions = values.gather(-1, order), positions.gather(-1, order)
    best, perm = values.sort(dim=-1, descending=True, stable=True)
    return best[..., :k], positions.gather(-1, perm[..., :k])
