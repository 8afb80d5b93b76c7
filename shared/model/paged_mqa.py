"""Fused paged MQA attention for host (CPU) pools: a small C kernel built on first use.

The portable path (shared.model.attention) gathers each request's rows out of the paged pool into a
[R, T, 576] copy and runs two batched matmuls over it. With few query heads per row (MLA decode on
a small model, or a TP/DP shard) that copy is most of the step: at batch 256 × 256 context it moves
151 MB per layer, and CPU gathers run at a fraction of memory speed. This kernel reads every row
once, straight from the pool through the block table / pick list, and keeps the scores of a tile
of rows in cache for both the softmax and the p·V product (online softmax, fp32 throughout).

It is built with the system C compiler (`cc -O3 -march=native -fopenmp`, under a second) into
`~/.cache/pdserve/kernels` (`PDSERVE_KERNEL_CACHE` moves it) and called through ctypes, which drops
the GIL while it runs. Without a compiler, with `PDSERVE_CPU_KERNELS=0`, or for pools that are not
in host memory, callers get None and keep the portable path. Results agree with it to fp32
rounding (not bit for bit: the sums run in another order); prefill chunks and decode steps each
take one path consistently (shared.model.attention decides by queries per request and heads).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from shared.device import on_host

# Fused when a step has at most this many queries per request (decode, MTP verification) and this
# many heads: beyond them a batched matmul over the gathered rows reuses each row enough to win.
MAX_QUERIES_PER_REQUEST = 8
MAX_HEADS = 32

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32  /* rows whose scores stay in cache between the softmax and p.V */
#define HB 4     /* heads per register block */
#define CW 16    /* output dims per register block */
#define DW 8     /* query dims per register block: one 8-float vector */

/* GCC/Clang vector extensions: AVX2 registers on x86, NEON pairs on Arm (built with -march=native) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) ((v8) * (const v8u *)(p))
#define STORE(p, v) (*(v8u *)(p) = (v))

/* Rows of a tile as fp32: fp32 pools are read in place, bf16 pools widened into `buf`. */
static const float *row_of(const void *pool, int bf16, int64_t slot, int64_t stride, int64_t dim, float *buf) {
    if (!bf16) return (const float *)pool + slot * stride;
    const uint16_t *src = (const uint16_t *)pool + slot * stride;
    uint32_t *dst = (uint32_t *)buf;
    #pragma omp simd
    for (int64_t d = 0; d < dim; d++) dst[d] = (uint32_t)src[d] << 16;
    return buf;
}

/* out[i, h, :out_dim] = softmax_t(scale * q[i, h] . row_t) @ row_t[:out_dim] over the context positions
   t < counts[i] of table row slot_row[i]: row_t is pool slot tables[slot_row[i], t / bs] * bs + t % bs
   (a block table; a list of slots with bs = 1); mask [rows, mask_width], if given, drops positions.
   dim % DW == 0 and out_dim % CW == 0 (the caller checks). Every index is checked against the table
   (table_rows x table_width, mask_width) and the pool (num_slots rows): a query naming anything
   outside them gets no output and the call returns 1 (0: all good). */
int32_t paged_mqa(const float *q, int64_t n, int64_t heads, int64_t dim,
                  const void *pool, int32_t pool_bf16, int64_t row_stride, int64_t num_slots,
                  const int64_t *tables, int64_t table_rows, int64_t table_width, int64_t bs, int64_t mask_width,
                  const int64_t *slot_row, const int64_t *counts, const uint8_t *mask,
                  float scale, int64_t out_dim, float *out, int32_t threads) {
    const int64_t hp = (heads + HB - 1) / HB * HB;  /* heads padded to whole blocks (zero queries) */
    int32_t bad = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *qp = calloc(hp * dim, sizeof(float));
        float *acc = malloc(sizeof(float) * hp * out_dim);
        float *mx = malloc(sizeof(float) * hp);
        float *sum = malloc(sizeof(float) * hp);
        float *score = malloc(sizeof(float) * hp * TILE);
        float *buf = pool_bf16 ? malloc(sizeof(float) * TILE * dim) : NULL;
        const float *rows[TILE];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++) {
            int64_t limit = table_width * bs < (mask ? mask_width : INT64_MAX) ? table_width * bs : mask_width;
            if (slot_row[i] < 0 || slot_row[i] >= table_rows || counts[i] < 0 || counts[i] > limit) {
                #pragma omp atomic write
                bad = 1;
                continue;
            }
            memcpy(qp, q + i * heads * dim, sizeof(float) * heads * dim);
            const int64_t *trow = tables + slot_row[i] * table_width;
            const uint8_t *mrow = mask ? mask + slot_row[i] * mask_width : NULL;
            for (int64_t h = 0; h < hp; h++) { mx[h] = -INFINITY; sum[h] = 0.f; }
            memset(acc, 0, sizeof(float) * hp * out_dim);
            for (int64_t t0 = 0; t0 < counts[i]; t0 += TILE) {
                int64_t end = counts[i] - t0 < TILE ? counts[i] - t0 : TILE;
                int used = 0;
                for (int64_t j = 0; j < end; j++) {
                    int64_t t = t0 + j;
                    if (mrow && !mrow[t]) continue;
                    int64_t slot = trow[t / bs] * bs + t % bs;
                    if (trow[t / bs] < 0 || slot >= num_slots) {
                        #pragma omp atomic write
                        bad = 1;
                        continue;
                    }
                    rows[used] = row_of(pool, pool_bf16, slot, row_stride, dim, buf ? buf + used * dim : NULL);
                    used++;
                }
                if (!used) continue;
                for (int64_t h0 = 0; h0 < hp; h0 += HB) {
                    /* scores of HB heads against the tile's rows: each row chunk loaded once for HB heads */
                    for (int j = 0; j < used; j++) {
                        const float *r = rows[j];
                        v8 part[HB] = {0};
                        for (int64_t d0 = 0; d0 < dim; d0 += DW) {
                            v8 rv = LOAD(r + d0);
                            for (int hh = 0; hh < HB; hh++) part[hh] += LOAD(qp + (h0 + hh) * dim + d0) * rv;
                        }
                        for (int hh = 0; hh < HB; hh++) {
                            float sc = 0.f;
                            for (int dd = 0; dd < DW; dd++) sc += part[hh][dd];
                            score[(h0 + hh) * TILE + j] = sc * scale;
                        }
                    }
                    /* online softmax: rescale what was accumulated if the running max grew */
                    for (int hh = 0; hh < HB; hh++) {
                        int64_t h = h0 + hh;
                        float *sh = score + h * TILE, tile_max = -INFINITY;
                        for (int j = 0; j < used; j++) tile_max = sh[j] > tile_max ? sh[j] : tile_max;
                        float new_max = tile_max > mx[h] ? tile_max : mx[h];
                        float alpha = expf(mx[h] - new_max);  /* 0 on the first tile */
                        if (alpha != 1.f) {
                            float *ah = acc + h * out_dim;
                            for (int64_t c = 0; c < out_dim; c++) ah[c] *= alpha;
                        }
                        sum[h] *= alpha;
                        mx[h] = new_max;
                        for (int j = 0; j < used; j++) { sh[j] = expf(sh[j] - new_max); sum[h] += sh[j]; }
                    }
                    /* acc[h, c] += sum_j p[h, j] row_j[c], HB x CW accumulators held in registers */
                    for (int64_t c0 = 0; c0 < out_dim; c0 += CW) {
                        v8 a[HB][2];
                        for (int hh = 0; hh < HB; hh++) {
                            a[hh][0] = LOAD(acc + (h0 + hh) * out_dim + c0);
                            a[hh][1] = LOAD(acc + (h0 + hh) * out_dim + c0 + 8);
                        }
                        for (int j = 0; j < used; j++) {
                            v8 r0 = LOAD(rows[j] + c0), r1 = LOAD(rows[j] + c0 + 8);
                            for (int hh = 0; hh < HB; hh++) {
                                float p = score[(h0 + hh) * TILE + j];
                                a[hh][0] += p * r0;
                                a[hh][1] += p * r1;
                            }
                        }
                        for (int hh = 0; hh < HB; hh++) {
                            STORE(acc + (h0 + hh) * out_dim + c0, a[hh][0]);
                            STORE(acc + (h0 + hh) * out_dim + c0 + 8, a[hh][1]);
                        }
                    }
                }
            }
            float *oi = out + i * heads * out_dim;
            for (int64_t h = 0; h < heads; h++) {
                float inv = sum[h] > 0.f ? 1.f / sum[h] : 0.f;
                for (int64_t c = 0; c < out_dim; c++) oi[h * out_dim + c] = acc[h * out_dim + c] * inv;
            }
        }
        free(qp); free(acc); free(mx); free(sum); free(score); free(buf);
    }
    return bad;
}
"""

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pdserve" / "kernels"))


def _cpu_signature() -> str:
    """What -march=native compiled for: a cached build is reused only on the same kind of CPU."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


def _build() -> ctypes.CDLL | None:
    """Compile (or reuse) the kernel for this CPU; None, with a warning, where that is not possible."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler: CPU attention uses the portable (slower) path", RuntimeWarning, stacklevel=3)
        return None
    key = hashlib.sha256("\0".join([_SOURCE, *_FLAGS, compiler, _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_mqa-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "paged_mqa.c"
                src.write_text(_SOURCE)
                built = Path(tmp) / "paged_mqa.so"
                result = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(built), "-lm"],
                                        capture_output=True, text=True, timeout=120)
                if result.returncode != 0:
                    raise OSError(result.stderr.strip() or f"{compiler} exited {result.returncode}")
                os.replace(built, target)  # atomic: processes building at once each publish a whole file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"building the CPU attention kernel in {target.parent} failed ({exc}); using the portable "
                      "path (set PDSERVE_KERNEL_CACHE to a writable directory)", RuntimeWarning, stacklevel=3)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_mqa.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int32, i64, i64, ptr, i64, i64, i64, i64, ptr, ptr,
                              ptr, ctypes.c_float, i64, ptr, ctypes.c_int32]
    lib.paged_mqa.restype = ctypes.c_int32
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot or should not run (built once per process)."""
    global _library, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0":
                    _library = _build()
                _tried = True
    return _library


def usable(query: torch.Tensor, pool: torch.Tensor, out_dim: int) -> bool:
    """Whether the fused kernel can take this step: host tensors, fp32 queries, fp32/bf16 rows, query
    dims a multiple of 8 and output dims of 16 (its register blocks; MLA's 576 / 512 are)."""
    return (on_host(pool) and on_host(query) and query.dtype == torch.float32
            and pool.dtype in (torch.float32, torch.bfloat16) and query.shape[-1] % 8 == 0
            and out_dim % 16 == 0 and library() is not None)


def paged_mqa(query: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, block_size: int,
              slot_row: torch.Tensor, counts: torch.Tensor, scale: float, out_dim: int,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """query [N, H, D] fp32 over pool rows [..., D] (fp32 or bf16, flat slots): query i attends to the
    context positions t < counts[i] of table row slot_row[i], whose rows sit at pool slot
    tables[r, t // block_size] * block_size + t % block_size (a block table; block_size 1 for a list of
    slots), skipping positions where `mask` [rows, ≥ counts] is False. Returns [N, H, out_dim] fp32 =
    softmax(scale · q·rowᵀ) · row[:out_dim]. Call only where usable(). The kernel checks every position
    and slot it reads against the table and the pool (ValueError if any is outside)."""
    n, heads, dim = query.shape
    flat = pool.view(-1, pool.shape[-1])
    rows, width = tables.shape
    if (flat.shape[1] < dim or out_dim > dim or dim % 8 or out_dim % 16 or slot_row.shape != (n,)
            or counts.shape != (n,) or (mask is not None and mask.shape[0] != rows)):
        raise ValueError(f"paged_mqa: queries {tuple(query.shape)}, rows of {flat.shape[1]} dims, output {out_dim}, "
                         f"slot_row {tuple(slot_row.shape)}, counts {tuple(counts.shape)}")
    query = query.contiguous()
    tables = tables.to(torch.int64).contiguous()
    slot_row = slot_row.to(torch.int64).contiguous()
    counts = counts.to(torch.int64).contiguous()
    if mask is not None:
        mask = mask.to(torch.uint8).contiguous()
    out = torch.empty(n, heads, out_dim, dtype=torch.float32)
    bad = library().paged_mqa(query.data_ptr(), n, heads, dim, flat.data_ptr(), int(pool.dtype == torch.bfloat16),
                              flat.stride(0), flat.shape[0], tables.data_ptr(), rows, width, block_size,
                              0 if mask is None else mask.shape[1], slot_row.data_ptr(), counts.data_ptr(),
                              None if mask is None else mask.data_ptr(), scale, out_dim, out.data_ptr(),
                              torch.get_num_threads())
    if bad:
        raise ValueError("paged_mqa: a query's context runs past its table, names a missing table row, or a "
                         "table names a slot outside the pool")
    return out
