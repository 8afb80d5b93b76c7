"""The model's ops, each run by a CPU kernel (shared.model.cpu_kernels) where one applies and by its portable
torch form elsewhere. The choice is made here, call by call, from explicit arguments only, so the model files
read as model math.

A kernel applies to host tensors, with the kernels built, outside torch.compile tracing. The kernels whose sums
run in another order than torch's (linear, head_matmul, moe, the dense attention of a step) take exactly the
step's generated tokens: a step lists its generated chunks first (ForwardBatch.generated), and `generated` below
is how many leading rows of x those are (0 for rows that are not the step's own, one per token). A prompt token
is then computed alike however it is chunked or split over CP ranks, and a generated token however it is
batched (a kernel computes each row with the same operations whatever rows sit beside it). RMSNorm, RoPE, the
MLA cache-row write and attention over indexer picks compute each row on its own and run for every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

import shared.model.attention as attention
import shared.model.cpu_kernels as cpu_kernels
import shared.model.int8_kernels as int8_kernels
import shared.model.moe_kernels as moe_kernels
from shared.device import compute_dtype, host_gemm_rows, on_host
from shared.kvcache.layout import RowCodec
from shared.model.batch import ForwardBatch, write_rows
from shared.quant import fp8, int8

Rows = TypeVar("Rows", torch.Tensor, tuple[torch.Tensor, torch.Tensor])  # one result per row, or two


def generated_first(x: torch.Tensor, generated: int, kernel: Callable[[torch.Tensor], Rows | None],
                    portable: Callable[[torch.Tensor, int], Rows]) -> Rows:
    """kernel(the leading `generated` rows of x) joined with portable(the other rows, 0); portable(x, generated)
    where there are no generated rows or the kernel does not apply (returns None). `portable` takes the
    generated count of its rows too, for the ops it calls in turn. Results are a tensor or a pair of them (the
    router's ids and weights), joined row-wise."""
    y = kernel(x[:generated]) if generated else None
    if y is None:
        return portable(x, generated)
    if generated == x.shape[0]:
        return y
    rest = portable(x[generated:], 0)
    if isinstance(y, tuple):
        return torch.cat([y[0], rest[0]]), torch.cat([y[1], rest[1]])
    return torch.cat([y, rest])


def every_row(weight: torch.Tensor) -> bool:
    """fp32 weights where the kernels have wide tiles (cpu_kernels.wide_tiles: AVX-512, or AVX2 + FMA): every row
    of a step, prompt rows too, takes the kernels, whose rows round alike whatever rows share the step (torch's
    fp32 GEMMs round a row by its batch's size: a prompt's cached rows then depended on the prompts prefilled
    beside it), at 0.5-1x torch's rate on prompt rows. A CPU without bf16 arithmetic computes a bf16 model so
    (its weights' fp32 copies), as an fp32 model is computed anywhere."""
    return weight.dtype == torch.float32 and on_host(weight) and cpu_kernels.wide_tiles()


def matmul_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x in the weight's dtype: weights may be held in the compute dtype (see store_for_compute)."""
    return x if x.dtype == weight.dtype else x.to(weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, generated: int = 0) -> torch.Tensor:
    """x · weightᵀ in x's dtype, the product in the weight's dtype; the leading `generated` rows in one kernel
    call (each weight row read once for all of them); every row where every_row(weight)."""

    def portable(rows: torch.Tensor, _: int) -> torch.Tensor:
        return matmul_rows(matmul_input(rows, weight), weight).to(rows.dtype)

    if x.dim() == 2 and every_row(weight):
        generated = x.shape[0]
    return generated_first(x, generated, lambda rows: cpu_kernels.linear(rows, weight), portable)


def linear_many(x: torch.Tensor, weights: list[torch.Tensor], generated: int = 0) -> list[torch.Tensor]:
    """linear(x, w, generated) for each of `weights` (layers fed the same rows: MLA's q_a and kv_a, an MLP's gate
    and up), in one kernel call where every row takes the kernels (every_row): the rows packed once for all."""
    if x.dim() == 2 and x.shape[0] and all(every_row(w) for w in weights):
        ys = cpu_kernels.linear_many(x, weights)
        if ys is not None:
            return ys
    return [linear(x, w, generated) for w in weights]


def matmul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), on the host at host_gemm_rows' row counts (the last row repeated): in bf16 oneDNN
    builds no new primitive for a new prompt length, and a single row is never computed alone (oneDNN multiplies
    one row by another routine, a GEMV, that rounds otherwise than its GEMM at some shapes: DeepSeek's q_a_proj,
    q_b_proj and o_proj; extra rows cost no more there)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = host_gemm_rows(rows, x.dtype) if on_host(x) and rows else rows
    if padded == rows:
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    flat = torch.cat([flat, flat[-1:].expand(padded - rows, -1)])
    return F.linear(flat, weight)[:rows].view(*x.shape[:-1], weight.shape[0])


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 x · weightᵀ (shared.quant.int8) in x's dtype: on the host one kernel call quantizes each row,
    multiplies in int32 and rescales (the portable path's bits: integer sums are exact, so every row alike
    whatever its batch); elsewhere the portable quantize + int8_matmul."""
    fused = int8_kernels.linear(x, weight, scale)
    return fused if fused is not None else int8.w8a8_linear(x, weight, scale)


def greedy_tokens(logits: torch.Tensor) -> list[int] | None:
    """Each row's argmax (the earliest of ties, as torch's) of host fp32 logits [M, V], in one kernel pass that
    also checks they are finite: None where the kernel does not run or a row holds a NaN or an infinity (the
    sampler's own path sanitizes those first)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or not cpu_kernels.runnable(logits):
        return None
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if cpu_kernels.library().greedy_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                                         torch.get_num_threads()):
        return None
    return out.tolist()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · (x / rms(x)), normalized in fp32 and cast back to x's dtype before the weight (as transformers);
    one kernel call instead of 8 ops."""
    fused = cpu_kernels.rms_norm(x, weight, eps)
    if fused is not None:
        return fused
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, ..., d] rotated: x·cos + swap(x)·sin, with cos/sin [N, d] widened to the rotary width and the
    rotation's sign folded into sin (rope.RopeAngles); swap exchanges the pairs (2i, 2i+1) when `interleaved`,
    else the halves (NeoX). `out` (optional, x's shape; x's dtype or fp32) receives the result. The kernel
    gives torch's bits."""
    fused = cpu_kernels.rope(x, cos, sin, interleaved, out)
    if fused is not None:
        return fused
    if interleaved:
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    y = x * _bcast(cos, x) + swapped * _bcast(sin, x)
    if out is None:
        return y
    out.copy_(y)
    return out


def index_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, quantize_block: int | None) -> torch.Tensor:
    """The lightning indexer's query or key rows x [N, ..., D]: the first cos.shape[-1] values rotated (NeoX
    halves), then, with a quantize_block, DeepSeek's Hadamard rotation and FP8 e4m3 round trip per block
    (shared.quant.fp8). The kernel computes each row on its own (the rotation as a fast transform: its sums in
    another order than the portable matmul's, within a rounding of it), for every token."""
    rope_dim = cos.shape[-1]
    fused = cpu_kernels.index_rows(x, cos, sin, rope_dim, quantize_block)
    if fused is not None:
        return fused
    y = torch.cat([rope(x[..., :rope_dim], cos, sin, False), x[..., rope_dim:]], -1)
    return y if quantize_block is None else fp8.fake_quant_ue8m0(fp8.hadamard_transform(y), quantize_block)


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[N, d] → [N, 1, ..., d] to broadcast over x's middle dims."""
    return t.view((t.shape[0],) + (1,) * (x.dim() - 2) + (t.shape[-1],))


class Norm(Protocol):
    """An RMSNorm module (layers.RMSNorm): called on rows; its weight and eps are what the kernel reads."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def write_mla_rows(kv: torch.Tensor, norm: Norm, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                   pool: torch.Tensor, fb: ForwardBatch, codec: RowCodec | None = None) -> None:
    """MLA's new cache rows, row i = [norm(c_kv) | rope(k_pe)] of kv [N, c + r] (kv_a_proj's output), written
    at the step's slots: straight into the pool in one kernel call where rows are stored as they are or as C8
    rows (encoded in the call) and no CP gather follows; else norm, rotation, concatenation, the codec and
    write_rows."""
    if fb.cp is None and cpu_kernels.mla_kv_write(kv, norm.weight, norm.eps, cos, sin, interleaved, pool,
                                                  fb.slot_mapping, codec):
        return
    c = norm.weight.shape[0]
    c_kv, k_pe = kv.split([c, kv.shape[-1] - c], -1)
    row = torch.cat([norm(c_kv), rope(k_pe, cos, sin, interleaved)], -1)
    write_rows(pool, fb, row if codec is None else codec.encode(row))


def write_index_keys(keys: torch.Tensor, pool: torch.Tensor, fb: ForwardBatch, codec: RowCodec | None) -> None:
    """The indexer's new keys [N, D] at the step's slots, as the codec stores them: C8's FP8 rows encoded and
    written in one kernel call where no CP gather follows (the bytes of codec.encode), else write_rows."""
    if fb.cp is None and cpu_kernels.index_key_write(keys, pool, fb.slot_mapping, codec):
        return
    write_rows(pool, fb, keys if codec is None else codec.encode(keys))


def head_matmul(x: torch.Tensor, weight: torch.Tensor, generated: bool,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Per head, x[i, h] @ weight[h]: x [N, H, K] and weight [H, K, M] (MLA's absorbed W_UK, W_UV^T) give
    [N, H, M] in the weight's dtype, written into `out` when given (a view in that dtype). One batched matmul
    over the heads, or for `generated` rows (all of x) one kernel call (any rows where every_row(weight))."""
    if generated or every_row(weight):
        dest = out if out is not None else x.new_empty(*x.shape[:2], weight.shape[-1], dtype=weight.dtype)
        if cpu_kernels.head_matmul(x, weight, dest):
            return dest
    heads_first = x.to(weight.dtype).transpose(0, 1)
    if out is None:
        return torch.bmm(heads_first, weight).transpose(0, 1)
    torch.bmm(heads_first, weight, out=out.transpose(0, 1))
    return out


def _fused_heads(query: torch.Tensor) -> bool:
    """Whether the attention kernel takes these heads: up to cpu_kernels.MAX_HEADS, and any whole multiple of it
    where the step computes in fp32 (a CPU without bf16 arithmetic, an fp32 model) or multiplies by AMX tile
    products (cpu_kernels.tile_products), MAX_HEADS heads a call elsewhere (_paged_mqa): the batched matmuls of
    the path beyond round a row by its batch's sizes (a token decoded alone and beside others differed by 0.016
    in the logits at DeepSeek's 128 heads in fp32; in bf16 on an AMX CPU, whose oneDNN products pick their
    blocking by the batch, by 0.031), where AVX512-BF16's bf16 ones round each row alike."""
    heads = query.shape[-2]
    return heads <= cpu_kernels.MAX_HEADS or (heads % cpu_kernels.MAX_HEADS == 0 and (
        compute_dtype(query.dtype, query.device) == torch.float32 or cpu_kernels.tile_products()))


def _paged_mqa(query: torch.Tensor, pool: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """cpu_kernels.paged_mqa over query [N, H, D] in slices of MAX_HEADS heads, all heads in one call over bf16 rows
    where tile products take 16 heads a product (each head attends on its own: the bits of one call)."""
    tiles = pool.dtype == torch.bfloat16 and kwargs.get("codec") is None and cpu_kernels.tile_products()
    step = query.shape[1] if tiles else cpu_kernels.MAX_HEADS
    if query.shape[1] <= step:
        return cpu_kernels.paged_mqa(query, pool, *args, **kwargs)
    return torch.cat([cpu_kernels.paged_mqa(query[:, h: h + step].contiguous(), pool, *args, **kwargs)
                      for h in range(0, query.shape[1], step)], dim=1)


def dense_attention(query: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, scale: float, out_dim: int,
                    codec: RowCodec | None = None) -> torch.Tensor:
    """attention.dense_attention (padded queries [R, S, H, D] → [R, S, H, out_dim]). Generated tokens
    (decodes, MTP verification, a recompute of a request's earlier outputs) with few heads attend in one
    kernel call that reads each cached row in place through the block table (C8 rows dequantized in registers
    and tile scratch, never unpacked into a gathered copy), each query on its own with fp32 queries and sums:
    a generated token's row is the same however it is batched, which a migrated or preempted request's
    recompute relies on (its outputs are recomputed as generated rows: shared.engine.scheduler). Prompt tokens
    take it where the kernel's arithmetic is the portable path's kind (sparse_attention's rule): there torch's
    fp32 matmuls over the step's padded context would round a row by the longest context beside it."""
    r_all, s_all, heads, dim = query.shape
    prompt_ok = codec is None and compute_dtype(query.dtype, query.device) == torch.float32
    if (prompt_ok or fb.generated == fb.num_tokens) and _fused_heads(query):
        flat = query.reshape(r_all * s_all, heads, dim)
        if cpu_kernels.attention_usable(flat, pool, out_dim, codec):
            requests, counts = fb.query_rows
            out = _paged_mqa(flat.float(), pool, fb.block_tables, fb.block_size, requests, counts, scale, out_dim,
                             codec=codec)
            return out.view(r_all, s_all, heads, out_dim).to(query.dtype)
    return attention.dense_attention(query, fb, pool, scale, out_dim, codec)


def sparse_attention(query: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, picks: torch.Tensor,
                     valid: torch.Tensor, scale: float, out_dim: int, codec: RowCodec | None = None) -> torch.Tensor:
    """attention.sparse_attention (flat queries [N, H, D] over their picked positions [N, k]); with few heads,
    one kernel call that reads each picked row in place (a one-row block table of slots per query), for a
    step's generated tokens as dense attention does. Prompt tokens take it only where the kernel's arithmetic
    is the portable path's kind (rows stored as they are, fp32 compute): over C8 rows the kernel dequantizes
    in fp32 where the portable path rounds rows to the compute dtype, and on CPUs with bf16 arithmetic the
    portable path multiplies in bf16, so a prompt token attends alike, sparse or dense (its chunk's context
    under index_topk), however its prompt is chunked."""
    n_all = query.shape[0]
    prompt_ok = codec is None and compute_dtype(query.dtype, query.device) == torch.float32
    if _fused_heads(query) and (prompt_ok or fb.generated == fb.num_tokens):
        if cpu_kernels.attention_usable(query, pool, out_dim, codec):
            slots = fb.slots_of(fb.token_request, picks)  # [N, k]
            rows = torch.arange(n_all, device=query.device)
            counts = torch.full((n_all,), picks.shape[1], dtype=torch.long, device=query.device)
            return _paged_mqa(query.float(), pool, slots, 1, rows, counts, scale, out_dim, mask=valid,
                              codec=codec).to(query.dtype)
    return attention.sparse_attention(query, fb, pool, picks, valid, scale, out_dim, codec)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, k: int, scale: float,
                 compute: torch.dtype, codec: RowCodec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attention.indexer_topk for flat queries q [N, H, D] and head weights [N, H]: the top-k context
    positions [N, k] of each and which are real picks. With fp32 scoring (DeepSeek's numerics) on a CPU the
    scores come from one kernel call per query tile that reads the keys in place, bf16 or C8's FP8 (each
    query computed on its own: every token takes it; no fp32 copy of the contexts' keys); the top-k is the
    same ordering (value, then earliest position)."""
    if compute == torch.float32 and cpu_kernels.index_usable(qf := q.float(), pool, codec):
        return _indexer_topk_kernel(qf, weights, fb, pool, k, scale, codec)
    picks, valid = attention.indexer_topk(fb.padded(q), fb.padded(weights), fb, pool, k, scale, compute, codec)
    return fb.unpadded(picks), fb.unpadded(valid)


def _indexer_topk_kernel(q: torch.Tensor, weights: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor, k: int,
                         scale: float, codec: RowCodec) -> tuple[torch.Tensor, torch.Tensor]:
    n_all = q.shape[0]
    picks = torch.empty(n_all, k, dtype=torch.long, device=q.device)
    valid = torch.empty(n_all, k, dtype=torch.bool, device=q.device)
    counts_all = fb.positions + 1  # the causal keys of each query
    columns = fb.max_context  # at least every count, known on the host (-inf past a query's count)
    # the scores, 4 bytes per (query, key), tiled to the workspace (the top-k's scratch is one row per thread)
    step = max(1, fb.workspace_bytes // (4 * columns))
    for n0 in range(0, n_all, step):
        tile = slice(n0, min(n_all, n0 + step))
        scores = cpu_kernels.index_scores(q[tile], weights[tile], pool, codec, fb.block_tables, fb.block_size,
                                          fb.token_request[tile], counts_all[tile], columns, scale)
        picks[tile], valid[tile] = cpu_kernels.topk_rows(scores, k)  # by value, ties to the earliest position
    return picks, valid


@dataclass(frozen=True)
class MoEWeights:
    """DeepSeek's router and experts as the fused MoE kernel reads them: every routed expert on this rank,
    unquantized; `shared` is the shared expert's (gate [Is, D], up [Is, D], down [D, Is]) if the model has one."""

    gate: torch.Tensor  # [E, D]
    bias: torch.Tensor  # [E] e_score_correction_bias
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    scaling: float
    gate_up: torch.Tensor  # [E, 2I, D], gate rows first
    down: torch.Tensor  # [E, D, I]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, generated: torch.Tensor | int | None,
                   gate_up: torch.Tensor, down: torch.Tensor,
                   portable: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed experts of rows x [N, D] for picks made by a router (ids local to gate_up / down, [N, k]; on
    an EP rank the foreign ones out of range): the rows `generated` marks ([N] bool: a step's generated tokens,
    wherever they came from; an int: the leading rows, one rank's step) in one kernel call where it takes them,
    `portable(rows, ids, weights)` for the rest. fp32 [N, D]. One rank and every EP rank call this, so a
    generated token's experts have the kernel's arithmetic in every instance shape. Widened bf16 experts
    (moe_kernels.widened_experts) and fp32 ones where every_row() holds take every row there."""
    usable = moe_kernels.experts_usable(x, gate_up, down)
    if usable and (moe_kernels.widened_experts(gate_up) or every_row(gate_up)):
        return moe_kernels.moe_experts(x, ids, weights, gate_up, down)
    if generated is None or not usable:
        return portable(x, ids, weights)
    if isinstance(generated, int):  # the leading rows: no mask to read back (a recorded step can take it)
        return generated_first(x, generated, lambda rows: moe_kernels.moe_experts(
            rows, ids[:generated], weights[:generated], gate_up, down),
            lambda rows, g: portable(rows, ids[x.shape[0] - rows.shape[0]:], weights[x.shape[0] - rows.shape[0]:]))
    rows = generated.nonzero().squeeze(1)
    if rows.numel() == x.shape[0]:
        return moe_kernels.moe_experts(x, ids, weights, gate_up, down)
    if rows.numel() == 0:
        return portable(x, ids, weights)
    rest = (~generated).nonzero().squeeze(1)
    y = torch.empty(x.shape, dtype=torch.float32)
    y[rows] = moe_kernels.moe_experts(x[rows], ids[rows], weights[rows], gate_up, down)
    y[rest] = portable(x[rest], ids[rest], weights[rest])
    return y


def moe(x: torch.Tensor, generated: int, weights: MoEWeights | None,
        portable: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """DeepSeek's MoE of rows x in x's dtype: the leading `generated` rows in one kernel call (router, routed
    and shared experts) where `weights` are given and the kernel takes them; `portable(rows, generated)` (the
    MoE module's own router, grouped experts and EP exchange) for the rest; every row where every_row() holds
    for the fused weights."""
    if weights is not None and every_row(weights.gate_up):
        generated = x.shape[0]

    def fused(rows: torch.Tensor) -> torch.Tensor | None:
        if weights is None:
            return None
        w = weights
        if not moe_kernels.moe_usable(rows, w.gate, w.gate_up, w.down, *(w.shared or ())):
            return None
        y, _ = moe_kernels.moe_routed(rows, w.gate, w.bias, w.n_group, w.topk_group, w.top_k, w.norm_topk_prob,
                                      w.scaling, w.gate_up, w.down, w.shared)
        return y.to(rows.dtype)

    return generated_first(x, generated, fused, portable)
