"""W8A8 on the CPU: int8 × int8 → int32 matmuls with the per-token activation quantization fused in, and a
W8A8 MoE's routed (+ shared) experts in one call.

The C source is csrc/int8_kernels.c, its own library (kernel_build.build_library: built for this CPU on first
use, cached, PDSERVE_KERNEL_ARCH overrides -march, PDSERVE_CPU_KERNELS=0 turns it off). It multiplies with
AVX-512 VNNI, AVX2 or portable C, whichever the build targets (`isa()`); every path sums the same integers
exactly, so all give the same bits, which equal the portable torch path (`quantize_activation` and an exact
int32 matmul, then `.float() * s_x * s_w`), and a row's result never depends on the rows beside it. Where the
library cannot run (no compiler, kernels off, torch.compile, tensors off the host, shapes or dtypes it does not
take) every function here returns None and the caller keeps the portable path.
"""

from __future__ import annotations

import ctypes
import sys

import torch

import shared.model.kernel_build as kernel_build
from shared.device import on_host

_SOURCE_FILE = "csrc/int8_kernels.c"
_ISA_NAMES = {2: "avx512-vnni", 1: "avx2", 0: "portable C"}
_FLOAT_KIND = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' x_kind / out_kind codes
_INT8_KIND, _INT32_KIND = 2, 2
# Below this many input features a linear's int32 products come from torch._int_mm (oneDNN's int8 GEMM, exact
# like the kernel): the kernel's per-output reduction costs more than its K/64 multiply steps there (measured
# 64 x 64 x 2048: 175 us vs 53 us); quantization and rescaling stay fused either way. DeepSeek's W8A8 linears
# have K >= 1536; the tiny models' q_b / wq_b / o_proj have 64-128.
SMALL_K = 256
# From this many rows on (prompt chunks) oneDNN's int8 GEMM beats the kernel at every K (measured 4096 rows:
# 3.7 vs 5.5 ms at K 256, 12.2 vs 13.0 ms at K 1024), so prompt rows take it too, a tile of rows at a time whose
# int32 products (INT32_TILE_BYTES) stay in cache until they are rescaled: untiled, 4096 x 2048 products
# (32 MiB) made K 64 3.5x slower than bf16. Exact either way: the tiles' results are the kernel's bits.
MANY_ROWS = 128
INT32_TILE_BYTES = 1 << 20
INT32_TILE_MAX_BYTES = 64 << 20
# bytes of the MoE call's scratch per call (fp32 expert activations and outputs of its picks): longer steps are
# split into row chunks of at least one row (rows are independent, so chunking changes no result)
MOE_SCRATCH_BYTES = 64 << 20

_library: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    lib = kernel_build.build_library(_SOURCE_FILE)
    if lib is None:
        return None
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.int8_isa.argtypes, lib.int8_isa.restype = [], i32
    lib.quantize_rows.argtypes = [ptr, i32, i64, i64, i64, ptr, ptr, i32]
    lib.quantize_rows.restype = None
    lib.w8a8_matmul.argtypes = [ptr, i32, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i32, i32]
    lib.w8a8_matmul.restype = None
    lib.moe_w8a8.argtypes = [ptr, i32, i64, i64, ptr, ptr, i64, i64, i32, i32, ptr, ptr, ptr, ptr, i64,
                             ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i32]
    lib.moe_w8a8.restype = i32
    lib.w8a8_rescale.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i32, i32]
    lib.w8a8_rescale.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The built library, or None where it cannot or should not run (built once per process)."""
    return kernel_build.built_once(sys.modules[__name__], _build)


def isa() -> str | None:
    """The instruction set the kernels multiply with here ('avx512-vnni', 'avx2', 'portable C'); None if off."""
    lib = library()
    return None if lib is None else _ISA_NAMES[lib.int8_isa()]


def _runnable(*tensors: torch.Tensor) -> bool:
    return library() is not None and not torch.compiler.is_compiling() and all(on_host(t) for t in tensors)


def _weight_ok(weight: torch.Tensor, scale: torch.Tensor | None, n: int, k: int) -> bool:
    return (weight.dtype == torch.int8 and weight.shape == (n, k) and weight.is_contiguous()
            and (scale is None or (scale.dtype == torch.float32 and scale.shape == (n,) and scale.is_contiguous())))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernels' fused quantizer on its own: x [M, K] (bf16/fp32) → (int8 [M, K], fp32 scales [M, 1]), the
    bits of shared.quant.int8.quantize_activation. None where the kernels do not apply."""
    if x.dim() != 2 or x.dtype not in _FLOAT_KIND or not _runnable(x):
        return None
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, 1, dtype=torch.float32)
    library().quantize_rows(x.data_ptr(), _FLOAT_KIND[x.dtype], m, k, k, q.data_ptr(), s.data_ptr(),
                            torch.get_num_threads())
    return q, s


def row_tile(k: int, n: int) -> int:
    """Rows per oneDNN int8 GEMM call: few enough that their int32 products stay in cache (INT32_TILE_BYTES),
    and at least K / 2, so the products of a tile outweigh the weight bytes that each tile reads again, up to
    INT32_TILE_MAX_BYTES of products (DeepSeek's o_proj, K 16,384: 2,340 rows, not 8,192)."""
    return max(32, min(max(INT32_TILE_BYTES // (4 * n), k // 2), INT32_TILE_MAX_BYTES // (4 * n)))


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None,
           ) -> torch.Tensor | None:
    """W8A8 y = x · Wᵀ: x [..., K] bf16/fp32 quantized per token inside the kernel, weight int8 [N, K] with
    fp32 per-channel scales [N]; y [..., N] in `out_dtype` (bf16/fp32; default x's dtype). None where the
    kernels do not apply (the caller quantizes in torch and calls shared.device.int8_matmul)."""
    out_dtype = out_dtype or x.dtype
    if (x.dtype not in _FLOAT_KIND or out_dtype not in _FLOAT_KIND or x.dim() < 1
            or not _weight_ok(weight, scale, weight.shape[0], x.shape[-1]) or not _runnable(x, weight, scale)):
        return None
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    lib, threads = library(), torch.get_num_threads()
    if (k < SMALL_K or m >= MANY_ROWS) and m:
        tile = row_tile(k, n)
        rows = rows.contiguous()
        for r0 in range(0, m, tile):
            part, out = rows[r0 : r0 + tile], y[r0 : r0 + tile]
            xq, sx = quantize(part)
            acc = torch._int_mm(xq, weight.t())
            lib.w8a8_rescale(acc.data_ptr(), part.shape[0], n, sx.data_ptr(), scale.data_ptr(), out.data_ptr(),
                             _FLOAT_KIND[out_dtype], threads)
    else:
        lib.w8a8_matmul(rows.data_ptr(), _FLOAT_KIND[x.dtype], rows.stride(0), None, m, k, weight.data_ptr(),
                        scale.data_ptr(), n, y.data_ptr(), _FLOAT_KIND[out_dtype], threads)
    return y.view(*shape[:-1], n)


def int_matmul(xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The exact int32 products xq [M, K] int8 · weight [N, K] int8ᵀ (what the tests compare with an int64
    matmul); None where the kernels do not apply. Weights must stay within ±127 (W8A8's quantizer)."""
    if (xq.dtype != torch.int8 or xq.dim() != 2 or not _weight_ok(weight, None, weight.shape[0], xq.shape[1])
            or not _runnable(xq, weight)):
        return None
    xq = xq.contiguous()
    m, k = xq.shape
    y = torch.empty(m, weight.shape[0], dtype=torch.int32)
    library().w8a8_matmul(xq.data_ptr(), _INT8_KIND, k, None, m, k, weight.data_ptr(), None, weight.shape[0],
                          y.data_ptr(), _INT32_KIND, torch.get_num_threads())
    return y


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
        down: torch.Tensor, down_scale: torch.Tensor, round_to: torch.dtype, padded: bool = False,
        shared: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
    """A W8A8 MoE's experts for rows x [N, D] (bf16/fp32) in one call: y fp32 [N, D] = Σ_j weights[i, j] ·
    expert_{ids[i, j]}(x_i) with int8 gate_up [E, 2I, D] / down [E, D, I] and fp32 per-channel scales [E, 2I]
    / [E, D], each expert's output rounded to `round_to` (the model dtype) before the weighted sum, as
    moe.Experts computes it; plus, given `shared` = (gate, gate_scale, up, up_scale, down, down_scale) int8 /
    fp32, the shared expert as layers.MLP computes it with W8A8 linears. ids [N, k] are local expert ids:
    with `padded`, ids outside 0..E-1 are other ranks' picks (nothing added); without, such an id raises
    ValueError. None where the kernels do not apply."""
    if x.dim() != 2 or x.dtype not in _FLOAT_KIND or round_to not in _FLOAT_KIND:
        return None
    (n, dim), (experts, two_inter, _) = x.shape, gate_up.shape
    inter = two_inter // 2
    if (gate_up.dtype != torch.int8 or gate_up.shape != (experts, 2 * inter, dim) or not gate_up.is_contiguous()
            or down.dtype != torch.int8 or down.shape != (experts, dim, inter) or not down.is_contiguous()
            or gate_up_scale.dtype != torch.float32 or gate_up_scale.shape != (experts, 2 * inter)
            or down_scale.dtype != torch.float32 or down_scale.shape != (experts, dim)
            or not gate_up_scale.is_contiguous() or not down_scale.is_contiguous()
            or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != n):
        return None
    shared_inter = 0
    if shared is not None:
        sg, sgs, su, sus, sd, sds = shared
        shared_inter = sg.shape[0]
        if not (_weight_ok(sg, sgs, shared_inter, dim) and _weight_ok(su, sus, shared_inter, dim)
                and _weight_ok(sd, sds, dim, shared_inter)):
            return None
    if not _runnable(x, ids, weights, gate_up, down, *(shared or ())):
        return None
    top_k = ids.shape[1]
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    y = torch.empty(n, dim, dtype=torch.float32)
    per_row = top_k * 4 * (3 * inter + dim) + 4 * (2 * shared_inter + dim)
    chunk = max(1, MOE_SCRATCH_BYTES // per_row)
    ptrs = [t.data_ptr() for t in shared] if shared is not None else [None] * 6
    lib = library()
    for r0 in range(0, n, chunk):
        m = min(chunk, n - r0)
        bad = lib.moe_w8a8(x[r0].data_ptr(), _FLOAT_KIND[x.dtype], m, dim, ids[r0].data_ptr(), weights[r0].data_ptr(),
                           top_k, experts, int(padded), int(round_to == torch.bfloat16), gate_up.data_ptr(),
                           gate_up_scale.data_ptr(), down.data_ptr(), down_scale.data_ptr(), inter, *ptrs, shared_inter,
                           y[r0].data_ptr(), torch.get_num_threads())
        if bad:
            raise ValueError(f"moe: an expert id is outside 0..{experts - 1} (ids {ids.min().item()}.."
                             f"{ids.max().item()})")
    return y
