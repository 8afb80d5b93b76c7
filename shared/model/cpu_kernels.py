"""CPU kernels for the decode path: small C functions built on first use, called through ctypes.

On a CPU a decode step is bound by per-op overhead (a few µs per torch op on 2 cores; ~700 ops a step
on the tiny model) and, at large batches, by gathering cached rows: the portable attention copies each
request's rows out of the paged pool into [R, T, 576] (151 MB per layer at batch 256 × 256 context)
and runs two batched matmuls over the copy. The kernels here:
* paged_mqa: attention of decode / verification queries and of indexer picks that reads every row
  once, straight from the pool through the block table or pick list (online softmax, fp32);
* the MoE's (moe_kernels: the router, the picked experts and the shared expert in one call, or apart);
* linear / head_matmul: decode rows of the linears and of MLA's absorbed per-head matmuls;
* rms_norm, rope, mla_kv_write: RMSNorm, RoPE and the cache-row write (norm + rope stored at the slot).

Which rows take which is chosen in shared.model.ops. The C source is csrc/cpu_kernels.c, shipped with
the package; it is built (shared.model.kernel_build) with the system C compiler (`cc -O3 -march=native
-fopenmp`, about a second) into `~/.cache/pdserve/kernels` (`PDSERVE_KERNEL_CACHE` moves it) and called
through ctypes, which drops the GIL while they run. Without a compiler, with
`PDSERVE_CPU_KERNELS=0`, under torch.compile, or for tensors not in host memory, every function says
so (None / False) and the caller keeps its portable torch path. Results agree with it to fp32
rounding (RoPE and the row write bit for bit; sums elsewhere run in another order), except that a bf16
model's attention rounds its probabilities to bf16 before p.V, as the portable path computing in bf16 and
DeepSeek's own model do (closer to the fp32 result than that path comes: tests/test_cpu_kernels.py).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Sequence

import torch

from shared.device import on_host
from shared.kvcache.layout import Fp8KeyRows, Int8LatentRows, PlainRows, RowCodec
from shared.model.kernel_build import build_library, built_once

# Attention is fused for generated tokens (decode, MTP verification, a recompute of earlier outputs) of models
# with at most this many heads: beyond, a batched matmul over the gathered rows reuses each row enough.
MAX_HEADS = 32
BF16_FLAG = {torch.bfloat16: 1, torch.float32: 0}  # the storage types the kernels take, as their bf16 flag
_SOURCE_FILE = "csrc/cpu_kernels.c"  # package data of shared.model (pyproject.toml), found in a source tree too


def runnable(*tensors: torch.Tensor) -> bool:
    """The kernels are built and may run on these tensors: host memory, outside torch.compile tracing."""
    return library() is not None and not torch.compiler.is_compiling() and all(on_host(t) for t in tensors)


_library: ctypes.CDLL | None = None  # built_once's state, per kernel module (tests reset it)
_tried = False


def _declare(lib: ctypes.CDLL, name: str, restype: type | None, *argtypes: type) -> None:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype


def _build() -> ctypes.CDLL | None:
    """Build (or reuse) this module's kernels and declare their signatures; None where they cannot be built."""
    lib = build_library(_SOURCE_FILE)
    if lib is None:
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int32
    _declare(lib, "paged_mqa", i32, ptr, i64, i64, i64, ptr, i32, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, f32,
                  i64, ptr, i32)
    _declare(lib, "paged_mqa_c8", i32, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, i64, ptr, i64, i64, i64, i64,
                  ptr, ptr, ptr, f32, i64, ptr, i32)
    _declare(lib, "c8_rows_decode", i32, ptr, i64, i64, i64, i64, i64, i64, ptr, i64, ptr, i32, i32)
    _declare(lib, "index_keys", i32, ptr, ptr, i64, i64, i64, ptr, i32, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64,
                  f32, ptr, i32)
    _declare(lib, "dots_bf16", i32)
    _declare(lib, "tile_products", i32)
    _declare(lib, "wide_tiles", i32)
    lib.wide = bool(lib.wide_tiles())  # asked once: ops.every_row reads it on every linear
    _declare(lib, "topk_rows", None, ptr, i64, i64, i64, ptr, ptr, i32)
    _declare(lib, "greedy_rows", i32, ptr, i64, i64, ptr, i32)
    _declare(lib, "moe_routed", i32, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i32, f32, ptr, ptr, i64, i32, ptr,
                  ptr, ptr, i64, ptr, ptr, i32)
    _declare(lib, "moe_route", i32, ptr, i64, i64, ptr, i32, ptr, i64, i64, i64, i64, i32, f32, ptr, ptr, i32)
    _declare(lib, "moe_experts", i32, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64, i32, i32, ptr, i32)
    _declare(lib, "rms_norm", None, ptr, ptr, ptr, i64, i64, f32, i32, i32)
    _declare(lib, "rope", None, ptr, i64, i64, ptr, i64, i64, i32, i64, i64, i64, ptr, ptr, i32, i32)
    _declare(lib, "index_rows", i32, ptr, i64, i64, i32, i64, i64, i64, ptr, ptr, i64, i32, i64, ptr, i32)
    _declare(lib, "mla_kv_write", i32, ptr, i32, i64, i64, i64, ptr, f32, ptr, ptr, i32, ptr, i32, i64, ptr, i32)
    _declare(lib, "mla_kv_write_c8", i32, ptr, i32, i64, i64, i64, ptr, f32, ptr, ptr, i32, ptr, i64, i64, ptr, i64,
                  i64)
    _declare(lib, "index_key_write_fp8", i32, ptr, i32, i64, i64, ptr, i64, i64, ptr)
    _declare(lib, "linear_rows", None, ptr, i32, ptr, ptr, i64, i64, i64, i32)
    _declare(lib, "linear_rows_many", i32, ptr, i32, ptr, ptr, ptr, i32, i64, i64, i32)
    _declare(lib, "linear_rows_bf16", i32, ptr, ptr, ptr, i32, i64, i64, i64, i32)
    _declare(lib, "head_matmul", None, ptr, i32, i64, i64, ptr, i32, ptr, i32, i64, i64, i64, i64, i64, i64, i32)
    _declare(lib, "prompt_attention_tile", None, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i32, ptr, ptr,
                  ptr, i32)
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot or should not run (built once per process)."""
    return built_once(sys.modules[__name__], _build)


def prepare(model: torch.nn.Module, *more: Callable[[], ctypes.CDLL | None]) -> float:
    """Build (or load) the kernels now if `model` lives in host memory, so the first requests do not wait for
    the compiler (about a second per library on a cold cache): an engine calls this before it reports ready.
    `more`: other kernel libraries' getters the model uses (int8_kernels.library for W8A8 weights). Returns
    the seconds it took (0 where kernels do not apply)."""
    if not on_host(next(model.parameters())):
        return 0.0
    start = time.perf_counter()
    for get in (library, *more):
        get()
    return time.perf_counter() - start


def attention_usable(query: torch.Tensor, pool: torch.Tensor, out_dim: int, codec: RowCodec | None = None) -> bool:
    """Whether the fused kernel can take this step: host tensors, fp32 or bf16 queries (paged_mqa takes them in
    fp32: the caller converts once this holds), rows stored as they are
    (fp32/bf16) or as C8 MLA rows (`codec` an Int8LatentRows matching the pool, the output within its latent,
    scale groups of whole 16-value blocks), query dims a multiple of 8 and output dims of 16 (its register blocks;
    MLA's 576 / 512 are)."""
    if codec is None:
        rows_ok = pool.dtype in (torch.float32, torch.bfloat16)
    else:
        rows_ok = (isinstance(codec, Int8LatentRows) and pool.dtype == torch.uint8 and pool.shape[-1] == codec.width
                   and query.shape[-1] == codec.dim and out_dim <= codec.latent and codec.group % 16 == 0)
    return (rows_ok and query.dtype in BF16_FLAG and query.shape[-1] % 8 == 0 and out_dim % 16 == 0
            and runnable(query, pool))


def paged_mqa(query: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, block_size: int,
              slot_row: torch.Tensor, counts: torch.Tensor, scale: float, out_dim: int,
              mask: torch.Tensor | None = None, codec: RowCodec | None = None) -> torch.Tensor:
    """query [N, H, D] fp32 over pool rows [..., D] (fp32 or bf16, flat slots; or C8 rows [..., codec.width]
    bytes with `codec` an Int8LatentRows, read and dequantized in place): query i attends to the
    context positions t < counts[i] of table row slot_row[i], whose rows sit at pool slot
    tables[r, t // block_size] * block_size + t % block_size (a block table; block_size 1 for a list of
    slots), skipping positions where `mask` [rows, ≥ counts] is False. Returns [N, H, out_dim] fp32 =
    softmax(scale · q·rowᵀ) · row[:out_dim]. Call only where attention_usable(). The kernel checks every
    position and slot it reads against the table and the pool, and a C8 layout against the rows (ValueError
    if any is outside or does not fit)."""
    n, heads, dim = query.shape
    flat = pool.view(-1, pool.shape[-1])
    rows, width = tables.shape
    row_dim = flat.shape[1] if codec is None else codec.dim
    if (row_dim < dim or out_dim > dim or dim % 8 or out_dim % 16 or slot_row.shape != (n,)
            or counts.shape != (n,) or (mask is not None and mask.shape[0] != rows)
            or (codec is not None and (not isinstance(codec, Int8LatentRows) or flat.dtype != torch.uint8
                                       or flat.shape[1] != codec.width or dim != codec.dim))):
        raise ValueError(f"paged_mqa: queries {tuple(query.shape)}, rows of {flat.shape[1]} {flat.dtype} "
                         f"(codec {type(codec).__name__}), output {out_dim}, slot_row {tuple(slot_row.shape)}, "
                         f"counts {tuple(counts.shape)}")
    query = query.contiguous()
    tables = tables.to(torch.int64).contiguous()
    slot_row = slot_row.to(torch.int64).contiguous()
    counts = counts.to(torch.int64).contiguous()
    if mask is not None:
        mask = mask.to(torch.uint8).contiguous()
    out = torch.empty(n, heads, out_dim, dtype=torch.float32)
    lib = library()
    where = (tables.data_ptr(), rows, width, block_size, 0 if mask is None else mask.shape[1], slot_row.data_ptr(),
             counts.data_ptr(), None if mask is None else mask.data_ptr(), scale, out_dim, out.data_ptr(),
             torch.get_num_threads())
    if codec is None:
        bad = lib.paged_mqa(query.data_ptr(), n, heads, dim, flat.data_ptr(), int(pool.dtype == torch.bfloat16),
                            flat.stride(0), flat.shape[0], *where)
    else:
        bad = lib.paged_mqa_c8(query.data_ptr(), n, heads, dim, flat.data_ptr(), flat.stride(0), flat.shape[0],
                               codec.latent, codec.group, codec.groups, codec.rope, *where)
    if bad == 2:
        raise ValueError(f"paged_mqa: the C8 layout (latent {codec.latent}, groups {codec.groups} of {codec.group}, "
                         f"rope {codec.rope}) does not fit rows of {flat.stride(0)} bytes")
    if bad:
        raise ValueError("paged_mqa: a query's context runs past its table, names a missing table row, or a "
                         "table names a slot outside the pool")
    return out


_KEY_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # index_keys' kinds of plain keys; 2: FP8 keys (C8)


def c8_rows(pool: torch.Tensor, slots: torch.Tensor, codec: RowCodec | None, dtype: torch.dtype,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
    """C8 MLA rows of a [blocks, block_size, width] pool at flat `slots` (any shape) decoded to `dtype` (bf16 or
    fp32) in one call: the bits of codec.decode(gather_rows(pool, slots), dtype), [*slots.shape, codec.dim], into
    `out` where given (contiguous, that shape and dtype). None where the kernel does not apply (not C8 rows,
    another dtype, off the host, kernels off). A slot outside the pool raises ValueError."""
    if (not isinstance(codec, Int8LatentRows) or dtype not in (torch.bfloat16, torch.float32)
            or pool.dtype != torch.uint8 or pool.shape[-1] != codec.width or not pool.is_contiguous()
            or not runnable(pool, slots)):
        return None
    flat = pool.view(-1, codec.width)
    index = slots.reshape(-1).to(torch.int64).contiguous()
    if out is not None and (out.shape != (*slots.shape, codec.dim) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"c8_rows: out {tuple(out.shape)} {out.dtype}, want {(*slots.shape, codec.dim)} {dtype}")
    out = torch.empty(index.numel(), codec.dim, dtype=dtype) if out is None else out.view(index.numel(), codec.dim)
    bad = library().c8_rows_decode(flat.data_ptr(), codec.width, flat.shape[0], codec.latent, codec.group,
                                   codec.groups, codec.rope, index.data_ptr(), index.numel(), out.data_ptr(),
                                   int(dtype == torch.bfloat16), torch.get_num_threads())
    if bad:
        raise ValueError(f"c8_rows: a slot is outside the pool of {flat.shape[0]} rows" if bad == 1 else
                         f"c8_rows: the C8 layout (latent {codec.latent}, rope {codec.rope}) does not fit "
                         f"{codec.width}-byte rows")
    return out.view(*slots.shape, codec.dim)


def _key_kind(pool: torch.Tensor, codec: RowCodec | None, dim: int) -> int | None:
    """How index_keys reads this key pool for keys of `dim` values (None: it cannot): plain fp32 / bf16 rows, or
    C8's FP8 rows (`codec` an Fp8KeyRows matching the pool)."""
    if isinstance(codec, Fp8KeyRows):
        fits = pool.dtype == torch.uint8 and pool.shape[-1] == codec.width and codec.dim == dim
        return 2 if fits else None
    if codec is not None and not isinstance(codec, PlainRows):
        return None
    return _KEY_KINDS.get(pool.dtype) if pool.shape[-1] == dim else None


def index_usable(query: torch.Tensor, pool: torch.Tensor, codec: RowCodec | None) -> bool:
    """Whether index_scores can score these indexer queries (fp32 [N, H, D], D a multiple of 8) against this
    key pool: plain fp32 / bf16 keys or C8's FP8 ones (`codec` an Fp8KeyRows matching the pool), host tensors."""
    return (query.dim() == 3 and query.dtype == torch.float32 and query.shape[-1] % 8 == 0
            and _key_kind(pool, codec, query.shape[-1]) is not None and runnable(query, pool))


def index_scores(query: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, codec: RowCodec | None,
                 tables: torch.Tensor, block_size: int, slot_row: torch.Tensor, counts: torch.Tensor, columns: int,
                 scale: float) -> torch.Tensor:
    """Lightning-indexer scores of queries [N, H, D] fp32 with head weights [N, H] fp32 over the cached keys read
    in place (bf16 widened in registers; FP8 e4m3 bytes and their fp32 scale; no decoded copy): [N, columns]
    fp32 with I[i, t] = Σ_h w[i, h] · ReLU(q[i, h] · key_t · scale) for the positions t < counts[i] of table row
    slot_row[i] (key_t at pool slot tables[r, t // block_size] * block_size + t % block_size) and -inf from
    counts[i] on. Call only where index_usable(). Every position and slot is checked (ValueError)."""
    n, heads, dim = query.shape
    flat = pool.view(-1, pool.shape[-1])
    rows, width = tables.shape
    kind = _key_kind(pool, codec, dim)
    if weights.shape != (n, heads) or slot_row.shape != (n,) or counts.shape != (n,) or kind is None:
        raise ValueError(f"index_scores: queries {tuple(query.shape)}, weights {tuple(weights.shape)}, key rows of "
                         f"{flat.shape[1]} {flat.dtype}, slot_row {tuple(slot_row.shape)}, "
                         f"counts {tuple(counts.shape)}")
    query = query.contiguous()
    weights = weights.float().contiguous()
    tables = tables.to(torch.int64).contiguous()
    slot_row = slot_row.to(torch.int64).contiguous()
    counts = counts.to(torch.int64).contiguous()
    out = torch.empty(n, columns, dtype=torch.float32)
    stride = flat.stride(0) * flat.element_size()  # bytes
    bad = library().index_keys(query.data_ptr(), weights.data_ptr(), n, heads, dim, flat.data_ptr(), kind, stride,
                               flat.shape[0], tables.data_ptr(), rows, width, block_size, slot_row.data_ptr(),
                               counts.data_ptr(), columns, scale, out.data_ptr(), torch.get_num_threads())
    if bad == 2:
        raise ValueError(f"index_scores: keys of {dim} dims do not fit rows of {stride} bytes")
    if bad:
        raise ValueError("index_scores: a query's context runs past its table or the columns, names a missing "
                         "table row, or a table names a slot outside the pool")
    return out


def bf16_dots() -> bool:
    """Whether the built kernels multiply bf16 values by AVX512-BF16 dot products (built for a CPU with that
    instruction set): the indexer's bf16-exact values (the same bits as their fused multiply-adds, faster), a bf16
    query's attention scores over bf16 rows and a bf16 model's experts' gate / up products (their sums in pairs:
    to fp32 rounding of the fused multiply-adds')."""
    return library() is not None and bool(library().dots_bf16())


def tile_products() -> bool:
    """Whether a bf16 model's decode attention multiplies by AMX tile products (a CPU with AMX-BF16, the build for
    it, and Linux granting this process the tile registers): scores and p.V of 16 rows a product, where vdpbf16ps
    makes 16 products of one (the same bounds as bf16_dots' sums, another order)."""
    return library() is not None and bool(library().tile_products())


def wide_tiles() -> bool:
    """Whether the built kernels multiply fp32 weights by wide tiles (linear_rows, moe_experts: AVX-512's two
    outputs' lanes a register, ~0.5-0.8x torch's fp32 GEMM at prompt sizes; AVX2 + FMA's two weight rows by six
    input rows a register block, blocked alike: 0.7-0.9x on a Zen 3), so every row of an fp32 linear takes them
    (ops.linear): each row the bits it has alone."""
    lib = library()
    return lib is not None and lib.wide


def topk_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's top-k of host score rows [N, W] fp32 (W < 2^32) in one call: (positions [N, k], valid
    [N, k]), the min(k, W) largest by value, ties to the earliest position, in that order (a stable descending
    sort's first k: the portable path's picks); valid where the score is finite; positions past W are 0, not
    valid. A selection and a sort of k per row instead of a sort of W. Call only where the kernels run
    (index_usable)."""
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[1] >= 1 << 32 or k < 0:
        raise ValueError(f"topk_rows: scores {tuple(scores.shape)} {scores.dtype}, k {k}")
    scores = scores.contiguous()
    n, width = scores.shape
    picks = torch.empty(n, k, dtype=torch.int64)
    valid = torch.empty(n, k, dtype=torch.bool)
    library().topk_rows(scores.data_ptr(), n, width, k, picks.data_ptr(), valid.data_ptr(), torch.get_num_threads())
    return picks, valid


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """ops.rms_norm's portable ops in one call for host tensors, x and weight both bf16 or both fp32 (the
    sum of squares runs in another order than torch's: equal to fp32 rounding); None where it does not
    apply (the caller runs the torch ops)."""
    bf16 = BF16_FLAG.get(x.dtype)
    if (bf16 is None or x.dtype != weight.dtype or x.shape[-1] != weight.shape[0] or not weight.is_contiguous()
            or not runnable(x, weight)):
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    dim = weight.shape[0]
    library().rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps, bf16,
                       torch.get_num_threads())
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out: torch.Tensor | None = None) -> torch.Tensor | None:
    """ops.rope's portable ops in one call: x [N, d] or [N, H, d] (last dim contiguous, any row and
    head strides), cos/sin [N, d] in x's dtype; the result (bit for bit torch's) goes to `out` (same shape,
    x's dtype or fp32 holding the rounded values; a new tensor when None). None where it does not apply."""
    if (x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype or sin.dtype != x.dtype
            or x.dim() not in (2, 3) or x.stride(-1) != 1 or not runnable(x, cos, sin)):
        return None
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    if (out.shape != x.shape or out.stride(-1) != 1 or out.dtype not in (x.dtype, torch.float32)
            or not on_host(out)):
        return None
    n, d = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape != (n, d) or sin.shape != (n, d):
        return None
    xs_head, ys_head = (x.stride(1), out.stride(1)) if x.dim() == 3 else (d, d)
    library().rope(x.data_ptr(), x.stride(0), xs_head, out.data_ptr(), out.stride(0), ys_head,
                   out.dtype == torch.bfloat16, n, heads, d, cos.data_ptr(), sin.data_ptr(), interleaved,
                   x.dtype == torch.bfloat16)
    return out


def index_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
               quantize_block: int | None) -> torch.Tensor | None:
    """ops.index_rows in one call: indexer rows x [N, H, D] or [N, D] (bf16/fp32, last dim contiguous, D a power
    of two of at least 8, a quantize block a multiple of 8), the first rope_dim values rotated (NeoX; cos/sin
    [N, rope_dim] in x's dtype), then, with a quantize_block, Hadamard-rotated (a fast transform in fp32) and
    FP8-rounded per block with a power-of-two scale. A new contiguous tensor of x's shape and dtype; None where
    it does not apply."""
    bf16 = BF16_FLAG.get(x.dtype)
    if bf16 is None or x.dim() not in (2, 3) or x.stride(-1) != 1 or not runnable(x, cos, sin):
        return None
    n, dim = x.shape[0], x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    block = quantize_block or dim
    if (dim & (dim - 1) or not 0 < rope_dim <= dim or rope_dim % 2 or block <= 0 or dim % block
            or cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != sin.shape or cos.shape != (n, rope_dim)):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    status = library().index_rows(x.data_ptr(), x.stride(0), x.stride(1) if x.dim() == 3 else dim, bf16, n, heads,
                                  dim, cos.data_ptr(), sin.data_ptr(), rope_dim, quantize_block is not None, block,
                                  out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """ops.linear's portable op for host rows x [N, K] (bf16/fp32) and an fp32 weight [M, K] in one call (a
    weight row read once for all rows: for decode rows), the output in x's dtype; bf16 rows times a bf16 weight
    (a bf16 model's, where the CPU multiplies bf16: K a multiple of 16) by vdpbf16ps, exact products summed in
    fp32 as oneDNN's bf16 GEMM does, without its per-call cost (~60 µs at decode sizes). None where it does not
    apply."""
    bf16 = BF16_FLAG.get(x.dtype)
    if bf16 is None or x.dim() != 2 or weight.dtype not in (torch.float32, x.dtype):
        return None
    if weight.dtype == torch.bfloat16 and not bf16_dots():  # checked before anything is allocated
        return None
    (n, k), (m, wk) = x.shape, weight.shape
    if k != wk or not weight.is_contiguous() or not runnable(x, weight):
        return None
    x = x.contiguous()
    y = torch.empty(n, m, dtype=x.dtype)
    if weight.dtype == torch.bfloat16:
        failed = library().linear_rows_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), 1, n, k, m,
                                            torch.get_num_threads())
        return None if failed else y
    library().linear_rows(x.data_ptr(), bf16, weight.data_ptr(), y.data_ptr(), n, k, m, torch.get_num_threads())
    return y


def linear_many(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """linear() of rows x by several fp32 weights in one call, x packed once for all (q_a and kv_a, gate and up):
    each output linear()'s. None where it does not apply (wide tiles only): the caller takes them one at a time."""
    bf16, k = BF16_FLAG.get(x.dtype), x.shape[-1]
    if bf16 is None or x.dim() != 2 or not weights or not wide_tiles() or not runnable(x, *weights) or any(
            w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() for w in weights):
        return None
    x, array = x.contiguous(), ctypes.c_void_p * len(weights)
    ys = [torch.empty(x.shape[0], w.shape[0], dtype=x.dtype) for w in weights]
    failed = library().linear_rows_many(x.data_ptr(), bf16, array(*(w.data_ptr() for w in weights)),
                                        (ctypes.c_int64 * len(weights))(*(w.shape[0] for w in weights)),
                                        array(*(y.data_ptr() for y in ys)), len(weights), x.shape[0], k,
                                        torch.get_num_threads())
    return None if failed else ys


def head_matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """out[i, h] = x[i, h] @ weight[h] for x [N, H, K] (bf16/fp32, last dim contiguous), weight [H, K, M]
    fp32 or bf16 (widened exactly as read), out [N, H, M] (fp32, or bf16 rounded once; last dim contiguous):
    MLA's absorbed matmuls for decode rows, fp32 fused multiply-adds. False (nothing written) where it does
    not apply."""
    x_bf16, out_bf16, w_bf16 = BF16_FLAG.get(x.dtype), BF16_FLAG.get(out.dtype), BF16_FLAG.get(weight.dtype)
    if x_bf16 is None or out_bf16 is None or w_bf16 is None or x.dim() != 3:
        return False
    (n, heads, k), (_, _, m) = x.shape, weight.shape
    if (weight.shape != (heads, k, m) or out.shape != (n, heads, m)
            or x.stride(-1) != 1 or out.stride(-1) != 1 or not weight.is_contiguous() or not runnable(x, weight, out)):
        return False
    library().head_matmul(x.data_ptr(), x_bf16, x.stride(0), x.stride(1), weight.data_ptr(), w_bf16, out.data_ptr(),
                          out_bf16, out.stride(0), out.stride(1), n, heads, k, m, torch.get_num_threads())
    return True


def prompt_attention_tile(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, seen: int,
                          visible: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                          first: bool) -> bool:
    """One key tile of expanded prompt attention folded into its queries' online softmax, in one call: queries
    q [G, S, qk] (scaled; G = heads x R requests, head-major), the tile's keys transposed keys_t [G, qk, K] and
    values [G, K, v] (fp32, contiguous), the first `seen` <= K keys, visible [R, S] the keys each query sees
    (causal). state = (running max [G, S], sum [G, S], unnormalized output [G, S, v]), fp32, started by the call
    with `first`. False (nothing done) where the kernel does not apply: the caller runs the torch ops."""
    g, s, qk = q.shape
    tensors = (q, keys_t, values, *state)
    if (any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors) or keys_t.shape[:2] != (g, qk)
            or values.shape[0] != g or values.shape[1] != keys_t.shape[2] or values.shape[2] % 32
            or not 0 < seen <= keys_t.shape[2] or visible.dim() != 2 or visible.shape[1] != s or g % visible.shape[0]
            or state[0].shape != (g, s) or state[1].shape != (g, s) or state[2].shape != (g, s, values.shape[2])
            or not runnable(*tensors)):
        return False
    visible = visible.to(torch.int64).contiguous()
    library().prompt_attention_tile(q.data_ptr(), g, visible.shape[0], s, qk, keys_t.data_ptr(), keys_t.shape[2],
                                    values.data_ptr(), values.shape[2], seen, visible.data_ptr(), int(first),
                                    state[0].data_ptr(), state[1].data_ptr(), state[2].data_ptr(),
                                    torch.get_num_threads())
    return True


def index_key_write(keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, codec: RowCodec | None) -> bool:
    """C8 indexer keys in one call: row i of keys [N, D] (bf16/fp32) encoded as codec.encode does (an
    Fp8KeyRows: FP8 e4m3 bytes | fp32 scale; the same bytes) and written at pool slot slots[i] (pool
    [blocks, block_size, codec.width] bytes). False (nothing written) where it does not apply (keys of a dim that
    is not a multiple of 8 among them)."""
    bf16 = BF16_FLAG.get(keys.dtype)
    if (bf16 is None or not isinstance(codec, Fp8KeyRows) or keys.dim() != 2 or keys.shape[1] != codec.dim
            or codec.dim % 8
            or pool.dtype != torch.uint8 or pool.shape[-1] != codec.width or not pool.is_contiguous()
            or slots.shape != (keys.shape[0],) or slots.dtype != torch.int64 or not runnable(keys, pool)):
        return False
    keys, slots = keys.contiguous(), slots.contiguous()
    status = library().index_key_write_fp8(keys.data_ptr(), bf16, keys.shape[0], codec.dim, pool.data_ptr(),
                                           codec.width, pool.numel() // codec.width, slots.data_ptr())
    if status == 1:
        raise ValueError("index_key_write: a slot is outside the key pool")
    return status == 0


def mla_kv_write(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool, pool: torch.Tensor, slots: torch.Tensor, codec: RowCodec | None = None) -> bool:
    """MLA's new cache rows in one call: row i = [RMSNorm(kv[i, :c]) | RoPE(kv[i, c:])] (the same bits as
    rms_norm and rope here), written at pool slot slots[i]. kv [N, c + r] and norm_weight in the model
    dtype (bf16/fp32), cos/sin [N, r], pool [blocks, block_size, c + r] (bf16/fp32), or with `codec` an
    Int8LatentRows, pool [blocks, block_size, codec.width] bytes and each row encoded as codec.encode does
    (the same bits). False (nothing written) where it does not apply."""
    bf16 = BF16_FLAG.get(kv.dtype)
    pool_bf16 = BF16_FLAG.get(pool.dtype) if codec is None else 0
    if bf16 is None or pool_bf16 is None or kv.dim() != 2 or not kv.is_contiguous():
        return False
    (n, width), c = kv.shape, norm_weight.shape[0]
    if codec is None:
        row_width = width
    elif (isinstance(codec, Int8LatentRows) and pool.dtype == torch.uint8 and codec.latent == c
          and codec.dim == width):
        row_width = codec.width
    else:
        return False
    if (norm_weight.dtype != kv.dtype or cos.dtype != kv.dtype or sin.dtype != kv.dtype
            or cos.shape != (n, width - c) or sin.shape != (n, width - c) or pool.shape[-1] != row_width
            or slots.shape != (n,) or slots.dtype != torch.int64 or not pool.is_contiguous()
            or not norm_weight.is_contiguous() or not runnable(kv, pool)):
        return False
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    where = (kv.data_ptr(), bf16, n, c, width - c, norm_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
             interleaved, pool.data_ptr())
    if codec is None:
        bad = library().mla_kv_write(*where, pool_bf16, pool.numel() // width, slots.data_ptr(),
                                     torch.get_num_threads())
    else:
        bad = library().mla_kv_write_c8(*where, row_width, pool.numel() // row_width, slots.data_ptr(),
                                        codec.group, codec.groups)
    if bad:
        raise ValueError("mla_kv_write: a slot is outside the KV pool")
    return True
