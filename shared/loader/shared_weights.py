"""One copy of the read-only weights per node, mapped by every co-located process.

DP ranks of one instance, or a prefill and a decode instance on the same host, each load the same
weights; without sharing every process holds a private copy. `share_weights` writes the loaded
model's tensors once to `<directory>/<key>.safetensors` (tmpfs: /dev/shm by default) and points every
tensor at a copy-on-write private mapping of that file, so the pages are the page cache's, shared by
all processes that map it, and the process's own copies are freed.

* The file is a valid safetensors file: 64-byte aligned data (header padded with spaces, gaps filled
  by `__pad__.N` u8 tensors, since safetensors forbids holes), so each `torch.frombuffer` view is
  aligned; `__metadata__` holds the key, the tensor count and the byte total, checked with the
  header's names, dtypes and shapes before a file is mapped (a stale or truncated file is rewritten).
* It is written once per key: under an `fcntl.flock` lock, streamed tensor by tensor to a temporary
  name, fsynced, then renamed into place, so a reader never sees a partial file and a mapped inode
  is never rewritten in place.
* Inference only: parameters stay the same `nn.Parameter` objects with `requires_grad=False` (a
  parameter that requires grad is refused). The mapping is private copy-on-write, so a stray
  in-place write costs that process a private page and never reaches the file or other processes.
* Covered: every parameter, buffer and plain tensor attribute of every module (MLA's absorbed
  `w_uk` / `w_uv_t`) on the CPU. Accelerator-resident tensors are per-device memory and are left
  alone, as are empty tensors.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import hashlib
import json
import mmap
import os
import re
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

DEFAULT_DIR = "/dev/shm/pdserve"
ALIGN = 64
FORMAT = "pdserve-shared-weights/1"
_PAD = "__pad__."

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e8m0fnu", "F8_E8M0")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


@dataclass
class ShareReport:
    path: Path
    bytes_mapped: int  # tensor bytes now viewing the mapping (the file's data, padding excluded)
    created: bool  # this process wrote the file
    tensors: int  # distinct tensors mapped (aliases of one tensor count once)


Slot = tuple[nn.Module, str, str, torch.Tensor]  # (module, "param" | "buffer" | "attr", name, tensor held)


@dataclass
class _Entry:
    """One distinct tensor: its name in the file and every module slot that holds it."""

    name: str
    tensor: torch.Tensor
    slots: list[Slot]


def weights_key(checkpoint_path: str | Path, dtype: str | torch.dtype, extra: dict[str, Any] | None = None) -> str:
    """A file name that identifies what the shared file holds: the checkpoint (its resolved path, and
    each safetensors file's and config.json's size and mtime, so a re-downloaded checkpoint gets a new
    key), the dtype and `extra` (callers pass what else shapes the tensors: the parallel slice,
    quantization, ...), so different ranks' slices or formats never collide."""
    path = Path(checkpoint_path).resolve()
    files = sorted(path.glob("*.safetensors")) + [p for p in (path / "config.json",) if p.exists()]
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps({"path": str(path), "files": stats, "dtype": str(dtype), "extra": extra or {}},
                      sort_keys=True, default=str)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)[:48] or "model"
    return f"{label}-{hashlib.sha256(blob.encode()).hexdigest()[:24]}"


def shareable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """name → tensor for everything `share_weights` maps (one name per distinct tensor)."""
    return {e.name: e.tensor for e in _collect(model)}


def share_weights(model: nn.Module, key: str, directory: str | Path = DEFAULT_DIR) -> ShareReport:
    """Point the loaded model's CPU tensors at the node-wide file `<directory>/<key>.safetensors`,
    writing it first if no complete one exists (one writer per key, others wait on the lock and map
    it); frees this process's own copies."""
    _check_key(key)
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"{key}.safetensors"
    entries = _collect(model)
    for entry in entries:
        if entry.tensor.requires_grad:
            raise ValueError(f"{entry.name} requires grad: shared weights are read-only (inference only)")
    if not entries:
        return ShareReport(path, 0, False, 0)
    created = False
    opened = _open_valid(path, key, entries)
    if opened is None:
        with open(directory / f"{key}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            opened = _open_valid(path, key, entries)  # another process may have written it meanwhile
            if opened is None:
                _write(path, key, entries)
                created = True
                opened = _open_valid(path, key, entries)
                if opened is None:
                    raise RuntimeError(f"{path} does not validate right after it was written")
    nbytes = _map(opened, entries)
    _refresh_layer_sharder(model)
    _release_freed_memory()
    return ShareReport(path, nbytes, created, len(entries))


def cleanup(directory: str | Path, key: str) -> None:
    """Remove the shared file of `key` (its lock and leftover temporaries too). Unlinking is safe while
    processes map it: they keep the inode and the pages go when the last of them exits (truncating or
    rewriting the file in place would not be: mappers would fault)."""
    _check_key(key)
    directory = Path(directory)
    for p in [directory / f"{key}.safetensors", directory / f"{key}.lock", *directory.glob(f".{key}.*.tmp")]:
        p.unlink(missing_ok=True)


def _check_key(key: str) -> None:
    """A key is a plain file name: no path separators, no hidden or temporary names."""
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", key):
        raise ValueError(f"weights key {key!r} must be a plain file name ([A-Za-z0-9_.-], not starting with '.')")


def private_bytes() -> int:
    """Private_Clean + Private_Dirty of this process (pages no other process maps), in bytes."""
    r = _smaps_rollup()
    return r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)


def shared_bytes() -> int:
    """Shared_Clean + Shared_Dirty of this process (pages other processes map too), in bytes."""
    r = _smaps_rollup()
    return r.get("Shared_Clean", 0) + r.get("Shared_Dirty", 0)


def _smaps_rollup() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """A module's own tensors: parameters, buffers, then plain tensor attributes (sorted: stable names)."""
    yield from (("param", n, t) for n, t in module._parameters.items() if t is not None)
    yield from (("buffer", n, t) for n, t in module._buffers.items() if t is not None)
    attrs = sorted((n, t) for n, t in vars(module).items() if isinstance(t, torch.Tensor))
    yield from (("attr", n, t) for n, t in attrs)


def _collect(model: nn.Module) -> list[_Entry]:
    """Distinct non-empty CPU tensors in a deterministic order. The same object in several slots, or
    separate objects viewing the same memory the same way (tied weights), become one entry."""
    entries: list[_Entry] = []
    by_id: dict[int, _Entry] = {}
    by_view: dict[tuple, _Entry] = {}
    for prefix, module in model.named_modules():
        for kind, attr, t in _module_tensors(module):
            if t.device.type != "cpu" or t.numel() == 0 or t.is_sparse or t.dtype not in _DTYPES:
                continue
            slot = (module, kind, attr, t)
            entry = by_id.get(id(t))
            if entry is None:
                entry = by_view.get((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()))
            if entry is None:
                entry = _Entry(f"{prefix}.{attr}" if prefix else attr, t, [])
                entries.append(entry)
                by_view[(t.data_ptr(), t.dtype, tuple(t.shape), t.stride())] = entry
            entry.slots.append(slot)
            by_id[id(t)] = entry
    return entries


def _layout(key: str, entries: list[_Entry]) -> tuple[bytes, list[tuple[_Entry | None, int]]]:
    """The padded JSON header and the data plan: (entry, bytes) or (None, pad bytes) in file order."""
    header: dict[str, Any] = {}
    plan: list[tuple[_Entry | None, int]] = []
    pos = total = 0
    for entry in entries:
        gap = -pos % ALIGN
        if gap:
            header[f"{_PAD}{len(plan)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            plan.append((None, gap))
            pos += gap
        t = entry.tensor
        n = t.numel() * t.element_size()
        header[entry.name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        plan.append((entry, n))
        pos += n
        total += n
    header["__metadata__"] = {"format": FORMAT, "key": key, "tensors": str(len(entries)),
                              "tensor_bytes": str(total), "data_bytes": str(pos)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # data starts 64-byte aligned
    return raw, plan


def _write(path: Path, key: str, entries: list[_Entry]) -> None:
    """Stream the file tensor by tensor to a temporary name, fsync, rename: readers see all or nothing."""
    header, plan = _layout(key, entries)
    need = 8 + len(header) + sum(n for _, n in plan)
    st = os.statvfs(path.parent)
    if st.f_bavail * st.f_frsize < need:
        raise OSError(f"{path.parent} has {st.f_bavail * st.f_frsize} bytes free, the weights need {need}")
    for stale in path.parent.glob(f".{key}.*.tmp"):  # a crashed writer's leftovers (we hold the lock)
        stale.unlink(missing_ok=True)
    tmp = path.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for entry, n in plan:
                if entry is None:
                    f.write(b"\0" * n)
                else:  # one tensor at a time: at most one tensor's temporary copy (if non-contiguous)
                    f.write(memoryview(entry.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _open_valid(path: Path, key: str, entries: list[_Entry]) -> tuple[dict[str, Any], mmap.mmap] | None:
    """The file's checked header and a copy-on-write mapping of that same open file (so what was
    checked is what is mapped, even if the name is replaced meanwhile); None if it is missing,
    incomplete, another key's, or holds other tensors."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}: refusing to map weights another user wrote")
        try:
            header = _check(f, st.st_size, key, entries)
        except (OSError, ValueError, TypeError, KeyError, AttributeError, struct.error):
            return None
        if header is None:
            return None
        return header, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # the tensors keep it alive


def _check(f: BinaryIO, size: int, key: str, entries: list[_Entry]) -> dict[str, Any] | None:
    """Header checks: metadata (format, key, tensor count, byte total = the file's size, so a truncated
    file fails) and every tensor's name, dtype, shape and aligned in-bounds offsets."""
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size or n > 1 << 30 or (8 + n) % ALIGN:
        return None
    header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    data_bytes = int(meta.get("data_bytes", -1))
    if (meta.get("format") != FORMAT or meta.get("key") != key or int(meta.get("tensors", -1)) != len(entries)
            or size != 8 + n + data_bytes):
        return None
    tensors = {name: info for name, info in header.items() if not name.startswith(_PAD)}
    if len(tensors) != len(entries):
        return None
    for entry in entries:
        info, t = tensors.get(entry.name), entry.tensor
        if info is None or info["dtype"] != _DTYPES[t.dtype] or info["shape"] != list(t.shape):
            return None
        begin, end = info["data_offsets"]
        if begin % ALIGN or end - begin != t.numel() * t.element_size() or end > data_bytes:
            return None
    return {"data_start": 8 + n, "tensors": tensors}


def _map(opened: tuple[dict[str, Any], mmap.mmap], entries: list[_Entry]) -> int:
    """Point every entry's slots at its view of the mapping."""
    header, mm = opened
    start, total = header["data_start"], 0
    with torch.no_grad():
        for entry in entries:
            t = entry.tensor
            begin, _ = header["tensors"][entry.name]["data_offsets"]
            view = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=start + begin).view(t.shape)
            _point(entry, view)
            total += t.numel() * t.element_size()
    return total


def _point(entry: _Entry, view: torch.Tensor) -> None:
    """Point every slot of `entry` at `view`. Normally in place (`.data`): the same Python object, so a
    Parameter stays that Parameter and every other holder of it sees the mapping too. An inference
    tensor cannot take new data safely, so its slots get a new tensor (one per distinct tensor)."""
    replacements: dict[int, torch.Tensor] = {}
    for module, kind, attr, held in entry.slots:
        if not held.is_inference():
            held.data = view
            continue
        new = replacements.get(id(held))
        if new is None:
            new = nn.Parameter(view, requires_grad=False) if kind == "param" else view
            replacements[id(held)] = new
        if kind == "param":
            module._parameters[attr] = new
        elif kind == "buffer":
            module._buffers[attr] = new
        else:
            module.__dict__[attr] = new


def _refresh_layer_sharder(model: nn.Module) -> None:
    """Layer sharding keeps its own handles on the owned weights: point them at the mapped ones."""
    sharder = getattr(model, "sharder", None)
    owned = getattr(sharder, "owned", None)
    if not owned:
        return
    for (layer, name) in list(owned):
        owned[(layer, name)] = sharder._module(layer, name).weight.data


def _release_freed_memory() -> None:
    """Return the freed copies to the OS: glibc keeps freed heap chunks in its arenas otherwise."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    try:
        ctypes.CDLL(libc_name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
