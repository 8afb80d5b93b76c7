"""The one place that names devices and distributed backends.

Everything else asks this module for a device or a backend, so the rest of the code base runs
unchanged on CPU (gloo), CUDA (nccl) and Ascend NPU (hccl, through torch-npu).
"""

from __future__ import annotations

import functools
import os
import warnings

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
    except Exception:  # noqa: BLE001 - a broken NPU runtime means "no NPU"
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


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU); used by benchmarks for honest timings."""
    if device.type == _CUDA:
        torch.cuda.synchronize(device)
    elif device.type == _NPU:
        torch.npu.synchronize(device)


_GROUPED_MM_MISSING: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) whose kernel is missing


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
