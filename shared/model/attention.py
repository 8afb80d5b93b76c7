"""MLA attention and indexer scoring over the paged cache, in bounded working memory.

Untiled, a step would hold tokens × heads × context scores (4k tokens × 128 heads × 4k context in
fp32 is 8.6 GB for one layer). Every function here cuts the work into tiles — request groups ×
query tiles × key tiles — whose working set fits `fb.workspace_bytes`:
* small steps are one tile: a single batched matmul, the fastest form on CPU;
* long contexts stream the keys through in tiles, with an online softmax (dense attention) or a
  running top-k merge (indexer), so memory no longer depends on the context length;
* sparse attention gathers each query's selected rows only: work O(S·k), not O(S·T);
* dense prompt chunks expand the latent rows into per-head keys and values (MHA form) where that is
  cheaper (prompt_form), key tile by key tile with an online softmax: no context ceiling.
These are the portable forms: shared.model.ops runs decode steps and indexer picks through the fused CPU
kernel where it applies.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

import shared.model.cpu_kernels as cpu_kernels
from shared.device import compute_dtype
from shared.kvcache.layout import RowCodec
from shared.model.batch import ForwardBatch, gather_blocks, gather_rows

_MIN_QUERY_TILE = 16
_KEY_TILE = 512  # expanded form: keys expanded per tile (whole blocks); 256-1024 measure alike
_QUERY_TILE = 128  # expanded form: queries per scores tile


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


def _rows_at(pool: torch.Tensor, slots: torch.Tensor, codec: RowCodec | None, dtype: torch.dtype,
             reuse: torch.Tensor | None = None) -> torch.Tensor:
    """Pool rows at flat slots in `dtype`: C8 rows gathered and decoded in one kernel pass on the host (the bits
    of the torch decode, which takes five passes over them), else gathered and decoded. `reuse`: an earlier
    result of at least as many rows, written over where the rows go straight in (a fresh tile-sized tensor
    costs more in first-touch page faults than the gather itself: 94 vs 13 ms for 64 × 2,048 bf16 rows)."""
    rows, out = slots.numel(), None
    if reuse is not None and reuse.is_contiguous() and reuse.dtype == dtype and reuse.numel() >= rows * reuse.shape[-1]:
        out = reuse.view(-1)[: rows * reuse.shape[-1]].view(*slots.shape, reuse.shape[-1])
    fused = cpu_kernels.c8_rows(pool, slots, codec, dtype, out)
    if fused is not None:
        return fused
    if codec is None and pool.dtype == dtype and out is not None:
        return torch.index_select(pool.view(-1, pool.shape[-1]), 0, slots.reshape(-1), out=out.view(rows, -1)).view(
            out.shape)
    return _decode(codec, gather_rows(pool, slots), dtype)


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


class PromptForm(enum.Enum):
    """How a part's queries attend (see the module docstring)."""

    EXPANDED = "expanded"  # per-head keys and values built from the latent rows, key tile by key tile
    ABSORBED = "absorbed"  # queries taken into the latent space; decodes and sparse picks always


@dataclass(frozen=True)
class HeadDims:
    """MLA's per-head dims: heads, the no-rope and rope parts of q·k, v, and the latent (kv_lora_rank)."""

    heads: int
    nope: int
    rope: int
    v: int
    latent: int


def prompt_form(fb: ForwardBatch, dims: HeadDims, sparse: bool) -> PromptForm:
    """Expanded or absorbed attention for the queries of one attention part. Per request of S queries over
    T keys and per head, absorbed costs S·T·(2c + rope) multiply-adds, expanded T·(c·(nope + v) + S·(qk +
    v)) (each side's W_UK / W_UV matmuls included), so expanded pays once a request has enough queries
    (expand_from: 22 at the tiny test dims, 171 at DeepSeek's), whatever its context (a chunk of a 2k prompt,
    a long dense prompt), never a decode. The rule looks at queries per request only: a request's form does
    not move with how long its context is, and since steps put requests on either side of expand_from in
    separate parts, not with which requests share its step either. It has no context ceiling (keys stream
    through in tiles), so a dense prompt of any length, up to index_topk for deepseek_v32 and at every
    length for deepseek_v3 (no indexer), takes it; sparse parts (each query over its own top-k picks) and
    generated rows (decode, MTP verification) stay absorbed. It is exact for chunked prefill, prefix-cache
    hits and context-parallel pieces alike: every query sees the cached keys up to its own position (CP
    ranks hold the whole prefix, gathered before attention)."""
    if sparse or fb.generated > 0:
        return PromptForm.ABSORBED
    per_query, per_request = _expansion_costs(dims)
    if fb.num_tokens * per_query <= fb.query_index.shape[0] * per_request:
        return PromptForm.ABSORBED
    return PromptForm.EXPANDED


def _expansion_costs(dims: HeadDims) -> tuple[int, int]:
    """Per key and head, in multiply-adds: what the expanded form saves per query over the absorbed one, and
    what expanding costs per request (its W_UK / W_UV matmuls): prompt_form's rule in two numbers."""
    c, qk = dims.latent, dims.nope + dims.rope
    return 2 * c + dims.rope - qk - dims.v, c * (dims.nope + dims.v)


def expand_from(dims: HeadDims) -> int:
    """The fewest queries a request needs in a step for prompt_form to expand it: steps put requests on either
    side of this count in separate parts (ForwardBatch.build), so a request's form is its own, whichever
    requests share the step (batch-invariant prompt rows: a migrated request's re-prefill matches)."""
    per_query, per_request = _expansion_costs(dims)
    return 1 if per_query <= 0 else per_request // per_query + 1


def plan_expanded_tiles(num_requests: int, num_queries: int, context: int, block_size: int, per_pair: int,
                        per_key: int, budget: int) -> Tiles:
    """Tiles of the expanded form, whose working set r · (k · per_key + q · k · per_pair) fits `budget`:
    whole contexts with every query for as many requests as fit (one batched matmul: small steps), else
    one request at a time with key tiles of about _KEY_TILE (whole blocks) and query tiles of at most
    _QUERY_TILE. The smallest tile is one block by one query: there is no context ceiling."""
    whole = num_queries * context * per_pair + context * per_key
    if whole <= budget:
        return Tiles(min(num_requests, max(1, budget // whole)), num_queries, context)
    keys = min(_KEY_TILE, budget // (2 * per_key)) // block_size * block_size
    keys = min(context, max(block_size, keys))
    queries = min(num_queries, _QUERY_TILE, max(1, (budget - keys * per_key) // (keys * per_pair)))
    return Tiles(1, queries, keys)


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor,
                       w_uk: torch.Tensor, w_uv_t: torch.Tensor, scale: float,
                       codec: RowCodec | None = None) -> torch.Tensor:
    """Causal MLA attention of prompt rows in its MHA form, as vLLM and SGLang prefill dense MLA: each
    cached latent row is expanded once per head into a key [k_nope | k_pe] and a value (c_kv · W_UK^T,
    c_kv · W_UV), and queries [q_nope | q_pe] score against those. Per query-key pair that is
    H·(nope + rope + v) multiply-adds instead of the absorbed H·(2·kv_lora + rope) (prompt_form says
    when that pays). Keys are expanded tile by tile (key tiles outer, so each row is expanded once per
    call) and the softmax runs online over key tiles with fp32 running max / sum / output per query, so
    the working set fits `fb.workspace_bytes` at any context; query tiles that see none of a key tile are
    skipped and only tiles crossing the causal diagonal are masked. q_nope [N, H, nope] and the rotated
    q_pe [N, H, rope] are flat; returns [N, H, v] in the weights' dtype."""
    r_all, s_all = fb.query_index.shape
    heads, nope, c = w_uk.shape
    rope, v_dim = q_pe.shape[-1], w_uv_t.shape[-1]
    qk, cdt = nope + rope, w_uk.dtype
    isz = torch.empty((), dtype=cdt).element_size()
    per_key = pool.shape[-1] * pool.element_size() + (c + rope + heads * (qk + nope + v_dim)) * isz
    per_pair = heads * (isz + (0 if cdt == torch.float32 else 4 + isz)) + 1
    last = int(fb.query_pos.max()) + 1  # no query sees beyond this key
    tiles = plan_expanded_tiles(r_all, s_all, -(-last // fb.block_size) * fb.block_size, fb.block_size,
                                per_pair, per_key, fb.workspace_bytes)
    out = q_nope.new_empty(r_all, s_all, heads, v_dim, dtype=cdt)
    for r0 in range(0, r_all, tiles.requests):
        rows = slice(r0, min(r_all, r0 + tiles.requests))
        for queries, o in _expanded_group(fb.padded(q_nope), fb.padded(q_pe), scale, fb, pool, rows, tiles, w_uk,
                                          w_uv_t, codec):
            out[rows, queries] = o
    return fb.unpadded(out)


@dataclass
class _QueryTile:
    """One query tile's queries [H·r, q, qk] and online-softmax state (fp32): running max and sum [H·r, q],
    unnormalized output [H·r, q, v]; `first`/`last` are the lowest / highest query positions in the tile."""

    queries: slice
    q: torch.Tensor
    first: int
    last: int
    run_max: torch.Tensor | None = None
    run_sum: torch.Tensor | None = None
    acc: torch.Tensor | None = None


class _Scratch:
    """Flat buffers reused by every tile of a call (a fresh tensor of tens of MB per tile costs its page
    faults on every allocation); `take` views the first elements of one as a contiguous shape."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        n, dtype = math.prod(shape), dtype or like.dtype
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self.buffers[name] = like.new_empty(n, dtype=dtype)
        return buf[:n].view(shape)


def _expanded_group(q_nope: torch.Tensor, q_pe: torch.Tensor, scale: float, fb: ForwardBatch, pool: torch.Tensor,
                    rows: slice, tiles: Tiles, w_uk: torch.Tensor, w_uv_t: torch.Tensor, codec: RowCodec | None,
                    ) -> list[tuple[slice, torch.Tensor]]:
    """Expanded attention of the padded queries [R, S, H, ·] of requests `rows`: (query slice, output
    [r, q, H, v]) per query tile. Batches are head-major (H·r) throughout, so one matmul expands k_nope
    for every request."""
    s_all, heads, nope = q_nope.shape[1:]
    c = w_uk.shape[-1]
    v_dim, cdt, size = w_uv_t.shape[-1], w_uk.dtype, fb.block_size
    qk = nope + q_pe.shape[-1]
    r = rows.stop - rows.start
    pos = fb.query_pos[rows]
    qtiles = []
    for s0 in range(0, s_all, tiles.queries):
        queries = slice(s0, min(s_all, s0 + tiles.queries))
        tile_pos = pos[:, queries]
        q = q_nope.new_empty(heads, r, queries.stop - s0, qk, dtype=cdt)  # scaled [q_nope | q_pe], head-major
        torch.mul(q_nope[rows, queries].permute(2, 0, 1, 3), scale, out=q[..., :nope])
        torch.mul(q_pe[rows, queries].permute(2, 0, 1, 3), scale, out=q[..., nope:])
        qtiles.append(_QueryTile(queries, q.view(heads * r, -1, qk), int(tile_pos.min()), int(tile_pos.max())))
    w_k = w_uk.view(heads * nope, c)  # a view: no copy of the weights
    scratch = _Scratch()
    end = max(t.last for t in qtiles) + 1
    for t0 in range(0, end, tiles.keys):
        latent = _decode(codec, gather_blocks(pool, fb.block_tables[rows, t0 // size : (t0 + tiles.keys) // size]),
                         cdt)  # [r, k, c + rope]
        k = latent.shape[1]
        c_kv = latent[..., :c].reshape(r * k, c)
        k_nope = torch.mm(w_k, c_kv.t(), out=scratch.take("k_nope", (heads * nope, r * k), latent))
        keys_t = scratch.take("keys", (heads, r, qk, k), latent)  # keys, transposed: [k_nope | k_pe]
        keys_t[:, :, :nope] = k_nope.view(heads, nope, r, k).transpose(1, 2)
        keys_t[:, :, nope:] = latent[..., c:].transpose(1, 2)  # k_pe: one per row, shared by the heads
        values = scratch.take("values", (heads, r * k, v_dim), latent)
        for h in range(heads):
            torch.mm(c_kv, w_uv_t[h], out=values[h])
        keys_t, values = keys_t.view(heads * r, qk, k), values.view(heads * r, k, v_dim)
        for tile in qtiles:
            if tile.last < t0:
                continue  # every query of the tile comes before this key tile
            n, seen = tile.q.shape[1], min(k, tile.last + 1 - t0)  # no query of the tile sees past `seen`
            if _fused_update(tile, keys_t, values, seen, pos[:, tile.queries] - (t0 - 1)):
                continue
            scores = torch.bmm(tile.q, keys_t[..., :seen], out=scratch.take("scores", (heads * r, n, seen), latent))
            if cdt != torch.float32:
                scores = scratch.take("scores32", scores.shape, latent, torch.float32).copy_(scores)
            if tile.first < t0 + seen - 1:  # some query sees only part of the tile
                visible = fb.visible(rows, tile.queries, t0, t0 + seen)  # [r, q, seen]
                scores.view(heads, r, n, seen).masked_fill_(~visible, float("-inf"))
            _online_update(tile, scores, values[:, :seen], scratch)
    outs = []
    for tile in qtiles:
        o = tile.acc.div_(tile.run_sum[..., None]).to(cdt)
        outs.append((tile.queries, o.view(heads, r, -1, v_dim).permute(1, 2, 0, 3)))
    return outs


def _fused_update(tile: _QueryTile, keys_t: torch.Tensor, values: torch.Tensor, seen: int,
                  visible: torch.Tensor) -> bool:
    """_online_update of one key tile in one kernel call where it runs (host fp32: cpu_kernels.
    prompt_attention_tile): scores, the causal cut (visible [r, q] keys per query) and the softmax in one pass
    over the tile, no masked score or exp of -inf. False: the torch ops run instead."""
    if tile.q.dtype != torch.float32 or not cpu_kernels.runnable(tile.q):
        return False  # an accelerator's or a bf16 compute dtype's tile: no state allocated for nothing
    g, n = tile.q.shape[:2]
    first = tile.acc is None
    state = ((tile.q.new_empty(g, n), tile.q.new_empty(g, n), tile.q.new_empty(g, n, values.shape[-1])) if first
             else (tile.run_max, tile.run_sum, tile.acc))
    if not cpu_kernels.prompt_attention_tile(tile.q, keys_t, values, seen, visible, state, first):
        return False
    tile.run_max, tile.run_sum, tile.acc = state
    return True


def _online_update(tile: _QueryTile, scores: torch.Tensor, values: torch.Tensor, scratch: _Scratch) -> None:
    """Fold one key tile's scores [H·r, q, k] (fp32, overwritten) into the tile's running softmax. Key
    tiles come in order from key 0, which every query sees, so the running max is finite from the first."""
    first = tile.acc is None
    tile_max = scores.amax(-1)
    new_max = tile_max if first else torch.maximum(tile.run_max, tile_max)
    probs = scores.sub_(new_max[..., None]).exp_()
    tile_sum = probs.sum(-1)
    if values.dtype != torch.float32:
        probs = scratch.take("probs", probs.shape, values).copy_(probs)
    if first:
        tile.run_sum = tile_sum
        tile.acc = torch.bmm(probs, values).float()  # [H·r, q, v]
    else:
        alpha = tile.run_max.sub_(new_max).exp_()
        tile.run_sum.mul_(alpha).add_(tile_sum)
        tile.acc.mul_(alpha[..., None])
        if values.dtype == torch.float32:
            tile.acc.baddbmm_(probs, values)
        else:
            tile.acc.add_(torch.bmm(probs, values, out=scratch.take("pv", tile.acc.shape, values)))
    tile.run_max = new_max


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
    keys = None  # the first tile's rows: the largest; later tiles' rows go into them
    for n0 in range(0, n_all, step):
        tile = slice(n0, min(n_all, n0 + step))
        keys = _rows_at(pool, fb.slots_of(fb.token_request[tile], picks[tile]), codec, cdt, reuse=keys)  # [n, k, D]
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
