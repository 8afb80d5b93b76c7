"""The one place that names devices and distributed backends.

Everything else asks this module for a device or a backend, so the rest of the code base runs
unchanged on CPU (gloo), CUDA (nccl) and Ascend NPU (hccl, through torch-npu).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch

_CPU = "cpu"
_CUDA = "cuda"
_NPU = "npu"


def _npu_available() -> bool:
    # Importing torch_npu without CANN breaks; only try when the user asked for NPU autoload.
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "0":
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # a broken NPU runtime means "no NPU"
        return False


def default_device_type() -> str:
    """Best available accelerator, else CPU. `PDSERVE_DEVICE` overrides (e.g. `cpu`)."""
    forced = os.environ.get("PDSERVE_DEVICE")
    if forced:
        return forced
    if _npu_available():
        return _NPU
    if torch.cuda.is_available():
        return _CUDA
    return _CPU


def get_device(name: str | None = None) -> torch.device:
    """Resolve a user device string ('auto'/None, 'cpu', 'cuda:1', 'npu') to a torch.device."""
    if name in (None, "", "auto"):
        return torch.device(default_device_type())
    return torch.device(name)


def dist_backend(device: torch.device) -> str:
    """torch.distributed backend for a device: hccl (NPU), nccl (CUDA), gloo (CPU)."""
    return {_NPU: "hccl", _CUDA: "nccl"}.get(device.type, "gloo")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' / 'fp32' / 'bfloat16' / 'bf16' / 'float16' → torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    table = {
        "float32": torch.float32, "fp32": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16,
    }
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(table)}") from None


@functools.lru_cache(maxsize=1)
def _cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: the CPU multiplies bf16 in hardware (else oneDNN emulates it, ~10-250x slower)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention matmuls run in for tensors stored as `dtype`: the storage dtype on
    accelerators and bf16-capable CPUs; fp32 on CPUs without bf16 arithmetic (accumulation is fp32
    either way, so only speed and the rounding of intermediate scores differ)."""
    if dtype in (torch.bfloat16, torch.float16) and device.type == _CPU and not _cpu_has_native_bf16():
        return torch.float32
    return dtype


def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype KV cache rows are stored in for a model stored as `dtype`: the model's own where attention
    reads it in place (bf16 on every CPU: the host kernels widen bf16 rows in registers, exactly, and a
    bf16 model's rows are bf16 values whatever the CPU computes in), else the compute dtype (fp16 on a CPU
    without fp16 arithmetic: fp32). Half the bytes of fp32 rows a step reads and a block holds, and one
    layout for a model across CPUs."""
    if dtype == torch.bfloat16:
        return dtype
    return compute_dtype(dtype, device)


def check_weight_sharing(share_weights_dir: str | None, device: torch.device) -> None:
    """--share-weights-dir maps one host-memory file into every co-located process: it shares weights that
    live in host memory, i.e. on CPU instances. On an accelerator the weights live in device memory,
    which a file mapping cannot share (that would take IPC memory handles), so it is refused instead of
    silently doing nothing."""
    if share_weights_dir and device.type != "cpu":
        raise ValueError(f"--share-weights-dir shares host memory between co-located processes; on {device.type} "
                         "the weights live in device memory, which it cannot share: leave it off there (each "
                         "accelerator instance holds its own copy)")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU); used by benchmarks for honest timings."""
    if device.type == _CUDA:
        torch.cuda.synchronize(device)
    elif device.type == _NPU:
        torch.npu.synchronize(device)


def step_graphs(device: torch.device) -> bool:
    """Whether decode steps on `device` may be recorded and replayed (shared.engine.graphs): the host tape on
    CPU. CUDA graphs and torch-npu's ACL graphs are not built yet: steps there run eagerly."""
    return device.type == _CPU


def accelerator() -> torch.device | None:
    """The accelerator torch can reach, whatever `PDSERVE_DEVICE` says (tests that need one); None on CPU."""
    if _npu_available():
        return torch.device(_NPU)
    if torch.cuda.is_available():
        return torch.device(_CUDA)
    return None


def _os_threads() -> int | None:
    """This process's threads, native ones included (Linux); None where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


_THREADS_AT_IMPORT = _os_threads()  # torch's own helpers, before this process ran a parallel region


def process_start_method(child_threads: int | None = None) -> str:
    """How a service starts its engine core and its follower ranks (run_ranks: rank_start_method): "fork" where no
    accelerator is reachable and this process runs one Python thread and no OpenMP pool, so the child starts
    from the parent's imports (torch's import, ~2 s of CPU on a 2-core host, is not paid again by every core and
    rank); else "spawn": a CUDA or NPU runtime, or a lock another thread holds, does not survive a fork, and a
    forked child that runs a parallel region of its own waits forever on the OpenMP pool threads it did not
    inherit (libgomp is not fork-safe). A child that runs one thread (`child_threads` 1) never enters that pool."""
    if threading.active_count() > 1 or accelerator() is not None:
        return "spawn"
    now = _os_threads()
    if now is None or _THREADS_AT_IMPORT is None or (now > _THREADS_AT_IMPORT and child_threads != 1):
        return "spawn"
    return "fork"


def rank_start_method(child_threads: int) -> str:
    """How `run_ranks` starts the ranks of tests and benches: as process_start_method says, except where that is
    spawn on a host with no accelerator (this process runs other threads, as a test process does once a server
    or a gRPC poller ran in it): then multiprocessing's fork server, a clean process that imported torch and the
    engine once (shared.parallel.launch.FORK_SERVER_PRELOAD), forks every rank, instead of each importing them
    again (~2.5 s of CPU a rank on a 2-core host)."""
    method = process_start_method(child_threads=child_threads)
    return "forkserver" if method == "spawn" and accelerator() is None else method


def _runtime(device: torch.device) -> Any:  # torch.cuda or torch.npu, same API
    return torch.npu if device.type == _NPU else torch.cuda


def on_host(tensor: torch.Tensor) -> bool:
    """Whether the tensor lives in host memory (sockets and numpy can use it in place)."""
    return tensor.is_cpu  # (a property: ~1 µs cheaper than device.type, on every kernel call)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>


@functools.cache
def _madvise() -> Any | None:
    import ctypes

    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):  # Linux with THP only
        return None
    madvise = getattr(ctypes.CDLL(None), "madvise", None)  # the process's libc (as kernel_build's mallopt)
    if madvise is not None:
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, in host memory backed by 2 MiB pages where the kernel allows them (transparent huge pages,
    `madvise` or `always`; asked for before the memory is first touched, so each page faults in whole). For the KV
    pools: attention reads a step's context blocks scattered over the whole pool, and with 4 KiB pages each block
    costs TLB misses (in a VM, nested page walks): a batch-256 decode layer's attention read 7 % faster (10.3 vs
    11.1 GB/s). Elsewhere (accelerators, small tensors, no THP) plain torch.zeros."""
    if device.type != _CPU:
        return torch.zeros(shape, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype)
    start, nbytes = out.data_ptr(), out.numel() * out.element_size()
    lo, hi = -(-start // _HUGE_PAGE) * _HUGE_PAGE, (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    madvise = _madvise() if hi > lo else None
    if madvise is not None:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: refused (THP off), the pages are plain ones
    return out.zero_()


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host bytes that feed copies to `device`: page-locked for an accelerator, so the copy is an
    async DMA off a side stream (pageable memory would make it synchronous); plain on CPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != _CPU)


def copy_stream(device: torch.device) -> Any | None:
    """A side stream for host→device copies that overlap compute; None on CPU (copy on a thread instead)."""
    return None if device.type == _CPU else _runtime(device).Stream(device)


def new_event(device: torch.device) -> Any:
    """A device event, to order one stream after work queued on another."""
    return _runtime(device).Event()


def current_stream(device: torch.device) -> Any:
    """The stream compute is queued on."""
    return _runtime(device).current_stream(device)


def on_stream(stream: Any) -> AbstractContextManager:
    """Context that queues work on `stream` (a copy_stream)."""
    return _runtime(stream.device).stream(stream)


def allocated_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds in tensors on `device` (0 on CPU: not tracked)."""
    return 0 if device.type == _CPU else _runtime(device).memory_allocated(device)


_GROUPED_MM_MISSING: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) whose kernel is missing


HOST_GEMM_BUCKET_LIMIT = 256  # host GEMMs of up to this many rows run at a few row counts (host_gemm_rows)
BUCKETED_GEMM_DTYPES = (torch.bfloat16, torch.float16)  # oneDNN's: a primitive built per row count


def host_gemm_rows(rows: int, dtype: torch.dtype) -> int:
    """The row count a host GEMM of `rows` rows of `dtype` runs at (the rest repeat its last row; their results
    are dropped). bf16 / fp16 (oneDNN): oneDNN builds a primitive (JIT code, ~0.5 ms on this CPU) for every new
    (rows, K, N); a short prompt's step paid it for each linear and each expert's group (a demo-model prefill of
    50 tokens: about half its time), and every new prompt length paid again. Rounded up to one of
    host_gemm_sizes(), each is built once, before the engine reports ready (Model.warm_host_gemms): up to 8 rows
    multiples of 4, to 64 of 8, to HOST_GEMM_BUCKET_LIMIT of 16 (at most one row in nine is padding there),
    beyond as they are (the GEMM outweighs building it). oneDNN gives a row the same bits at every row count
    from 2 (measured 2-300) but runs one row alone by a GEMV that rounds otherwise. fp32 (torch's fp32 GEMM,
    no per-shape build; a row's bits there depend on the rows beside it at some counts, so counts stay as they
    are): one row runs as two, as before."""
    if dtype not in BUCKETED_GEMM_DTYPES:
        return 2 if rows == 1 else rows
    if rows <= 8:
        return -(-rows // 4) * 4
    if rows <= 64:
        return -(-rows // 8) * 8
    if rows <= HOST_GEMM_BUCKET_LIMIT:
        return -(-rows // 16) * 16
    return rows


def host_gemm_sizes() -> list[int]:
    """Every row count host_gemm_rows runs bf16 GEMMs of up to HOST_GEMM_BUCKET_LIMIT rows at (21 sizes)."""
    return sorted({host_gemm_rows(r, torch.bfloat16) for r in range(1, HOST_GEMM_BUCKET_LIMIT + 1)})


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x [M, K] in consecutive groups (group g ends at offsets[g], int32, on the device) times
    w[g] [K, N]: one grouped matmul with no host read-back (`F.grouped_mm`). A device or dtype whose
    torch build lacks that kernel (NPU, CUDA before sm90, ...) gets `grouped_mm_loop` instead, with a
    warning once; shapes are checked first, so a caller's bug is raised, never hidden by the fall-back.
    Rows past the last offset are left undefined either way."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or offsets.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, offsets {tuple(offsets.shape)}")
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM_MISSING:
        try:
            return torch.nn.functional.grouped_mm(x, w, offs=offsets)
        except (RuntimeError, NotImplementedError) as exc:  # the kernel is missing for this device/dtype
            _GROUPED_MM_MISSING.add(key)
            warnings.warn(f"F.grouped_mm unavailable for {key} ({exc}); MoE uses a per-expert loop, which "
                          "reads the group offsets back to the host", RuntimeWarning, stacklevel=2)
    return grouped_mm_loop(x, w, offsets)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same product as grouped_mm, one matmul per non-empty group (reads the offsets back once)."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g]
        start = end
    return out


_INT_MM_MIN_ROWS = 32  # CUDA's _int_mm needs more than 16 rows: fewer are padded to this many zero-filled rows
_INT8_PACK_MAX_ROWS = 64  # CUDA's small shapes: the int8-weight kernel while rows are few; above, fp32 tiles
_INT8_TILE_ELEMS = 1 << 24  # fp32 weight tile of the large-batch CPU path: 64 MiB, whatever the weight


@functools.lru_cache(maxsize=64)
def _ones_bf16(n: int, device: torch.device) -> torch.Tensor:
    """Unit scales for the int8-weight kernel (the real scales are applied in fp32): made once per width."""
    return torch.ones(n, dtype=torch.bfloat16, device=device)


def int8_matmul(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """W8A8 product (xq · wqᵀ) · sx · sw in fp32 for int8 xq [M, K] with per-row scales sx [M, 1] and int8
    wq [N, K] with per-channel scales sw [N].

    * CUDA: `torch._int_mm` (int8 × int8 → int32, exact) when K and N are multiples of 8; fewer than 17 rows are
      padded with zero rows to its minimum (a lent H100 showed the bf16-rounded path below made W8A8 decode
      tokens differ from the CPU's and depend on the batch).
    * Ascend: `torch_npu.npu_quant_matmul` with the per-token scale (not exercised on this CI).
    * CPU: `torch._int_mm` (oneDNN's int8 GEMM: exact int32 sums, any shape, no widened weight copy). The CPU
      kernels (shared.model.int8_kernels) give the same bits with the quantization fused in; this is the path
      without them (no compiler, kernels off, torch.compile, TP shards). Exact sums make a row's result
      independent of how many rows share the call (a prompt gives the same tokens chunked or whole).
    * CUDA with K or N not a multiple of 8: few rows → `torch._weight_int8pack_mm` on the int8 values held in
      bf16 (exact: |q| ≤ 127) with fp32 accumulation, its result rounded to bf16 once; many rows → the int8
      weight widened to fp32 in bounded row tiles, the integer sums rounded to bf16 the same way.
    """
    m, k = xq.shape
    n = wq.shape[0]
    dev = xq.device.type
    if dev == _CPU:
        return torch._int_mm(xq, wq.t()).float() * sx * sw
    if dev == _CUDA and k % 8 == 0 and n % 8 == 0:
        pad = _INT_MM_MIN_ROWS - m
        xp = torch.cat([xq, xq.new_zeros(pad, k)]) if pad > 0 else xq
        return torch._int_mm(xp, wq.t())[:m].float() * sx * sw
    if dev == _NPU:  # pragma: no cover - needs Ascend CANN
        import torch_npu

        return torch_npu.npu_quant_matmul(xq, wq.t(), sw, pertoken_scale=sx.view(-1),
                                          output_dtype=torch.bfloat16).float()
    # torch 2.13's AVX-512 _weight_int8pack_mm reads past a row whose length is not a multiple of 16 once it
    # packs 4+ rows (a segfault on Zen 4 with K = 200): such shapes take the tile path below.
    if m <= _INT8_PACK_MAX_ROWS and k % 16 == 0 and hasattr(torch, "_weight_int8pack_mm"):
        return torch._weight_int8pack_mm(xq.to(torch.bfloat16), wq, _ones_bf16(n, xq.device)).float() * sx * sw
    xf = xq.float()
    out = xf.new_empty(m, n)
    step = max(1, _INT8_TILE_ELEMS // max(k, 1))
    for n0 in range(0, n, step):
        rows = slice(n0, min(n, n0 + step))
        out[:, rows] = (xf @ wq[rows].float().t()).to(torch.bfloat16)
    return out.mul_(sx).mul_(sw)
