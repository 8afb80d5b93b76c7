"""Building a CPU kernel library: compile one of shared/model/csrc's C files with the system compiler for this
CPU (or PDSERVE_KERNEL_ARCH) into a cache keyed by source, flags, compiler and CPU, load it through ctypes, and
do that once per process per kernel module (cpu_kernels, whose library moe_kernels shares; int8_kernels)."""

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
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from types import ModuleType

# -march=native for the CPU the service runs on; 256-bit vectors even where GCC's tuning prefers 128 (AMD
# Zen); no FMA contraction: the fused multiply-adds are spelled out (vfma, fmaf), so a row's arithmetic is
# the source's on every compiler and ISA, whichever code path computes it.
_FLAGS = ["-O3", "-mprefer-vector-width=256", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
# glibc's mallopt parameters (malloc.h) and the values _keep_freed_memory sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_KEEP_BYTES = 512 << 20  # free memory at the heap's top glibc keeps instead of returning it
_HEAP_BLOCKS_UPTO = 32 << 20  # blocks up to this come from the heap (glibc's ceiling for the mmap threshold)
_heap_kept = False


def _cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pdserve" / "kernels"))


def _march(arch: str | None = None) -> str:
    """The ISA the kernels are built for: `arch`, else `PDSERVE_KERNEL_ARCH` (e.g. haswell, x86-64-v3: one build
    for a mixed fleet; the tests build for several to check invariance on each), else this CPU's (native)."""
    return f"-march={arch or os.environ.get('PDSERVE_KERNEL_ARCH', 'native')}"


def _cpu_signature() -> str:
    """What -march=native compiled for: a cached build is reused only on the same kind of CPU."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


def _source(source_file: str) -> str | None:
    """A kernel library's C source, read from the package (an installed wheel or the source tree); None, with a
    warning, where the file is missing (a broken install: the portable path runs)."""
    try:
        return resources.files(__package__).joinpath(source_file).read_text(encoding="utf-8")
    except OSError as exc:
        warnings.warn(f"the CPU kernels' source is missing ({exc}); using the portable path", RuntimeWarning,
                      stacklevel=5)
        return None


def build_library(source_file: str, arch: str | None = None) -> ctypes.CDLL | None:
    """Compile (or reuse) the C file `source_file` (relative to shared.model) for this CPU (or for `arch`, as
    _march); None, with a warning, where that is not possible. Each file is its own shared object, cached by its
    source, flags, compiler and CPU; the caller declares its functions' signatures."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler: the CPU kernels are off; the portable (slower) path runs", RuntimeWarning,
                      stacklevel=4)
        return None
    source = _source(source_file)
    if source is None:
        return None
    march = _march(arch)
    key = hashlib.sha256("\0".join([source, march, *_FLAGS, compiler, _cpu_signature()]).encode()).hexdigest()[:16]
    stem = Path(source_file).stem
    target = _cache_dir() / f"{stem}-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / f"{stem}.c"
                src.write_text(source)
                built = Path(tmp) / f"{stem}.so"
                result = subprocess.run([compiler, march, *_FLAGS, str(src), "-o", str(built), "-lm"],
                                        capture_output=True, text=True, timeout=120)
                if result.returncode != 0:
                    raise OSError(result.stderr.strip() or f"{compiler} exited {result.returncode}")
                os.replace(built, target)  # atomic: processes building at once each publish a whole file
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"building the CPU kernels in {target.parent} failed ({exc}); using the portable "
                      "path (set PDSERVE_KERNEL_CACHE to a writable directory)", RuntimeWarning, stacklevel=4)
        return None
    return lib


def built_once(module: ModuleType, build: Callable[[], ctypes.CDLL | None]) -> ctypes.CDLL | None:
    """A kernel module's library, `build()` run once per process (None where kernels cannot or should not
    run: PDSERVE_CPU_KERNELS=0, no compiler). The state lives on the module (`_tried`, `_library`), where
    tests reset it."""
    if not module._tried:
        with _lock:
            if not module._tried:
                if os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0":
                    module._library = build()
                if module._library is not None:
                    _keep_freed_memory()
                module._tried = True
    return module._library


def _keep_freed_memory() -> None:
    """Keep the host kernels' (and torch's) freed scratch in the process heap for the next step, once per process
    (glibc's mallopt; nothing elsewhere). With glibc's defaults a freed block of a few MB is unmapped or trimmed,
    and the next step's block of the same size faults its pages in again, each zeroed: the routed experts of a
    4,096-row prefill chunk (~40 MB of scratch) took twice as long (23 vs 11.5 ms). The price: up to
    _HEAP_KEEP_BYTES of freed heap stays the process's instead of going back to the system."""
    global _heap_kept
    if _heap_kept or platform.libc_ver()[0] != "glibc":
        return
    _heap_kept = True
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_TRIM_THRESHOLD, _HEAP_KEEP_BYTES)
        mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UPTO)
