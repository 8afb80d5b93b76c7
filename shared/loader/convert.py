"""Offline checkpoint conversion: `pdserve convert --src DIR --dst DIR --format w8a8 [--ep N]`.

Quantizing at load time makes every instance start pay the FP8 dequant + INT8 quant of every expert;
converting once writes the W8A8 layout (`shared.quant.int8`) the loader reads as stored. The source is
a Hugging Face checkpoint: DeepSeek's FP8 release (e4m3 + `weight_scale_inv` block scales) or bf16/fp32.

* W8A8 targets (`is_w8a8_target`) → int8 `X` + fp32 per-channel `X_scale` (`X.weight_scale` [out], or
  [E, out] for fused 3-D experts); other FP8 tensors → bf16; everything else copied with its dtype;
  `*_scale_inv` consumed with their weight. The MTP layer (index ≥ num_hidden_layers) is copied as
  stored, FP8 and scales included, for the MTP drafter.
* Memory stays bounded by a chunk, not by the model or even one tensor: the source is read with plain
  file reads (no mmap, whose touched pages would count towards RSS while the file is open), a few
  rows at a time (quantization is per output row and FP8 scales per 128-row block, so chunking
  changes no number); the output is streamed: each file's safetensors header is computed up front
  from the source headers, then the tensors' bytes follow one chunk at a time.
* `--ep N` puts routed experts [r·E/N, (r+1)·E/N) in `model-ep{r:03d}-of-{N:03d}.safetensors`, per
  expert (fused 3-D expert tensors are split into per-expert names), so an EP rank opens the shared
  shards and its own file only. The MTP layer's experts stay in the shared shards (every drafter reads
  them all).
"""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from shared.config import Fp8Scheme, ModelConfig
from shared.loader.checkpoint import Progress
from shared.quant.fp8 import dequant_block_fp8
from shared.quant.int8 import QUANT_METHOD, SCALE_SUFFIX, is_w8a8_target, quantize_weight

INDEX = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20  # fp32 working set of one chunk (quantize_weight holds ≈ 3 of these at once)

_ELEM_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
              "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
              "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_TORCH = {"U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E8M0": torch.float8_e8m0fnu}
_FP8 = ("F8_E4M3", "F8_E5M2")
_SOURCE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class SrcTensor:
    """Where one source tensor's bytes are: read with plain file reads, never mapped."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def read(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the flattened tensor, 1-D in its dtype."""
        size = _ELEM_SIZE[self.dtype]
        buf = torch.empty(count * size, dtype=torch.uint8)
        with open(self.file, "rb") as f:  # opened per read: nothing of the source stays resident
            f.seek(self.begin + start * size)
            got = f.readinto(memoryview(buf.numpy())) if count else 0
        if got != count * size:
            raise EOFError(f"{self.file.name}: {self.name} is truncated")
        return buf.view(_TORCH[self.dtype])


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ELEM_SIZE[self.dtype]


@dataclass
class Job:
    """One unit of work written into one output file: its outputs' bytes, in order, by `run`."""

    outputs: list[OutTensor]
    run: Callable[[BinaryIO], None]
    rank: int | None = None  # EP rank file, None: the shared shards
    source_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass
class ConvertSummary:
    tensors: int = 0
    bytes_in: int = 0  # source tensor data read
    bytes_out: int = 0  # output tensor data written (the index's total_size)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0  # getrusage: this process's high-water mark, conversion included

    def __str__(self) -> str:
        gib = 1 << 30
        sizes = f"{self.bytes_in / gib:.3f} GiB in, {self.bytes_out / gib:.3f} GiB out"
        return (f"wrote {self.tensors} tensors in {len(self.files)} files: {sizes}, {self.seconds:.1f}s, "
                f"peak RSS {self.peak_rss_bytes / gib:.2f} GiB")


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header JSON) of one safetensors file, without mapping it."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return 8 + n, json.loads(f.read(n))


def source_tensors(src: Path) -> dict[str, SrcTensor]:
    """Every tensor of the checkpoint (the index's, or every *.safetensors'), in file and offset order."""
    index = src / INDEX
    if index.exists():
        weight_map: dict[str, str] | None = json.loads(index.read_text())["weight_map"]
        fnames = sorted(set(weight_map.values()))
    else:
        weight_map, fnames = None, sorted(p.name for p in src.glob("*.safetensors"))
    if not fnames:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    out: dict[str, SrcTensor] = {}
    for fname in fnames:
        start, header = read_header(src / fname)
        header.pop("__metadata__", None)
        for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if weight_map is not None and weight_map.get(name) != fname:
                continue
            if h["dtype"] not in _ELEM_SIZE:
                raise ValueError(f"{fname}: {name} has unsupported dtype {h['dtype']}")
            b, e = h["data_offsets"]
            out[name] = SrcTensor(name, src / fname, h["dtype"], tuple(h["shape"]), start + b, start + e)
    if weight_map is not None and (missing := set(weight_map) - set(out)):
        raise KeyError(f"{INDEX} lists {len(missing)} tensors not in their files, e.g. {sorted(missing)[:3]}")
    return out


def _write(f: BinaryIO, t: torch.Tensor) -> None:
    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _copy(t: SrcTensor) -> Callable[[BinaryIO], None]:
    def run(f: BinaryIO) -> None:
        buf = bytearray(min(CHUNK_BYTES, t.nbytes))
        with open(t.file, "rb") as g:
            g.seek(t.begin)
            left = t.nbytes
            while left:
                n = g.readinto(memoryview(buf)[: min(left, len(buf))])
                if not n:
                    raise EOFError(f"{t.file.name}: {t.name} is truncated")
                f.write(memoryview(buf)[:n])
                left -= n
    return run


class _Matrix:
    """A source weight viewed as [L, R, C] (L = product of leading dims) whose rows are read as fp32,
    FP8 dequantized with its block scales: each element times its block's scale, as
    dequant_block_fp8 does on the whole tensor, so the numbers do not depend on the chunking."""

    def __init__(self, w: SrcTensor, scale_inv: SrcTensor | None, scheme: Fp8Scheme):
        if len(w.shape) < 2:
            raise ValueError(f"{w.name}: expected a matrix, got shape {w.shape}")
        self.w, self.s, self.scheme = w, scale_inv, scheme
        self.rows, self.cols = w.shape[-2:]
        self.block_rows = scheme.block[0] if scale_inv is not None else 128
        if scale_inv is not None:
            br, bc = scheme.block
            want = (*w.shape[:-2], -(-self.rows // br), -(-self.cols // bc))
            if scale_inv.shape != want:
                raise ValueError(f"{scale_inv.name} shape {scale_inv.shape} does not match {w.name} {w.shape} "
                                 f"with blocks {br}x{bc} (expected {want})")

    def chunks(self, r0: int, r1: int) -> list[tuple[int, int]]:
        """Row ranges covering [r0, r1) of about CHUNK_BYTES fp32 each, cut at block-row multiples."""
        step = max(1, CHUNK_BYTES // (4 * max(self.cols, 1)) // self.block_rows) * self.block_rows
        out, r = [], r0
        while r < r1:
            end = min(r1, (r // step + 1) * step)
            out.append((r, end))
            r = end
        return out

    def read(self, lead: int, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of matrix `lead`, fp32 [r1 - r0, C]."""
        R, C = self.rows, self.cols
        if self.s is None:
            return self.w.read((lead * R + r0) * C, (r1 - r0) * C).view(r1 - r0, C).float()
        br, _ = self.scheme.block
        a0 = r0 // br * br  # dequantize from the start of r0's block row, then drop the extra rows
        q = self.w.read((lead * R + a0) * C, (r1 - a0) * C).view(r1 - a0, C)
        sr, sc = self.s.shape[-2:]
        b0, b1 = a0 // br, -(-r1 // br)
        scale = self.s.read((lead * sr + b0) * sc, (b1 - b0) * sc).view(b1 - b0, sc)
        return dequant_block_fp8(q, scale, self.scheme.block, self.scheme.scale_fmt)[r0 - a0 :]


def _to_bf16(m: _Matrix) -> Callable[[BinaryIO], None]:
    def run(f: BinaryIO) -> None:
        lead = math.prod(m.w.shape[:-2])
        for li in range(lead):
            for r0, r1 in m.chunks(0, m.rows):
                _write(f, m.read(li, r0, r1).to(torch.bfloat16))
    return run


@dataclass(frozen=True)
class _Piece:
    """One int8 output: rows [r0, r1) of matrices `leads` of the source, written as `name` + its scale."""

    name: str
    leads: range
    r0: int
    r1: int
    shape: tuple[int, ...]

    def outputs(self) -> list[OutTensor]:
        return [OutTensor(self.name, "I8", self.shape), OutTensor(self.name + SCALE_SUFFIX, "F32", self.shape[:-1])]


def _quantize(m: _Matrix, pieces: list[_Piece]) -> Callable[[BinaryIO], None]:
    def run(f: BinaryIO) -> None:
        for p in pieces:
            scales = []
            for li in p.leads:
                for r0, r1 in m.chunks(p.r0, p.r1):
                    q, s = quantize_weight(m.read(li, r0, r1))  # per row: chunking changes nothing
                    _write(f, q)
                    scales.append(s)
            _write(f, torch.cat(scales) if scales else torch.empty(0))
    return run


def plan_jobs(tensors: dict[str, SrcTensor], cfg: ModelConfig, ep: int = 1) -> list[Job]:
    """What to write, in source order: the output tensors (names, dtypes, shapes) of every job
    without reading any tensor data."""
    scheme = cfg.fp8 or Fp8Scheme()
    n_experts = cfg.n_routed_experts
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    if ep > 1 and (not n_experts or n_experts % ep):
        raise ValueError(f"--ep {ep} must divide n_routed_experts ({n_experts})")
    per_rank = n_experts // ep if ep > 1 else 0

    def is_mtp(name: str) -> bool:
        layer = _LAYER.match(name)
        return layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers

    def rank_of(expert: int, name: str) -> int:
        if not 0 <= expert < n_experts:
            raise ValueError(f"{name}: expert {expert} is outside n_routed_experts {n_experts}")
        return expert // per_rank

    jobs: list[Job] = []
    for name, t in tensors.items():
        if is_mtp(name):  # the MTP drafter reads them as stored
            jobs.append(Job([OutTensor(name, t.dtype, t.shape)], _copy(t), source_bytes=t.nbytes))
            continue
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in tensors:
                raise KeyError(f"{name} has no weight {name.removesuffix('_scale_inv')}")
            continue  # consumed with its weight
        scale_inv = tensors.get(name + "_scale_inv")
        fp8 = t.dtype in _FP8
        if fp8 and scale_inv is None:
            raise ValueError(f"{name} is FP8 but has no weight_scale_inv")
        src_bytes = t.nbytes + (scale_inv.nbytes if scale_inv is not None else 0)
        if not is_w8a8_target(name):
            if fp8:
                m = _Matrix(t, scale_inv, scheme)
                jobs.append(Job([OutTensor(name, "BF16", t.shape)], _to_bf16(m), source_bytes=src_bytes))
            else:
                jobs.append(Job([OutTensor(name, t.dtype, t.shape)], _copy(t), source_bytes=src_bytes))
            continue
        if not fp8 and t.dtype not in _SOURCE_NAMES:
            raise ValueError(f"{name}: cannot quantize dtype {t.dtype} (expected FP8 or a float)")
        m = _Matrix(t, scale_inv if fp8 else None, scheme)
        expert, fused = _EXPERT.match(name), _FUSED.match(name)
        if ep > 1 and fused:  # split per expert so that each goes to its rank's file
            if len(t.shape) != 3 or t.shape[0] != n_experts:
                raise ValueError(f"{name}: expected [{n_experts}, out, in], got {t.shape}")
            prefix, proj = fused.groups()
            R, C = t.shape[1:]
            for e in range(n_experts):
                if proj == "down_proj":
                    pieces = [_Piece(f"{prefix}.{e}.down_proj.weight", range(e, e + 1), 0, R, (R, C))]
                else:  # gate_up_proj [E, 2I, D]: gate rows first, then up rows
                    if R % 2:
                        raise ValueError(f"{name}: odd gate_up rows {R}")
                    inter = R // 2
                    pieces = [_Piece(f"{prefix}.{e}.gate_proj.weight", range(e, e + 1), 0, inter, (inter, C)),
                              _Piece(f"{prefix}.{e}.up_proj.weight", range(e, e + 1), inter, R, (inter, C))]
                jobs.append(Job([o for p in pieces for o in p.outputs()], _quantize(m, pieces),
                                rank_of(e, name), src_bytes // n_experts))
            continue
        piece = _Piece(name, range(math.prod(t.shape[:-2])), 0, t.shape[-2], t.shape)
        rank = rank_of(int(expert.group(1)), name) if ep > 1 and expert else None
        jobs.append(Job(piece.outputs(), _quantize(m, [piece]), rank, src_bytes))
    seen: set[str] = set()
    for job in jobs:
        for o in job.outputs:
            if o.name in seen:
                raise ValueError(f"two source tensors convert to {o.name}")
            seen.add(o.name)
    return jobs


def assign_files(jobs: list[Job], ep: int, max_shard_bytes: int) -> dict[str, list[Job]]:
    """Output file → its jobs: shared shards of at most `max_shard_bytes` (a bigger job gets one of
    its own) named model-0000i-of-0000K, then one file per EP rank."""
    shards: list[list[Job]] = []
    size = 0
    for job in (j for j in jobs if j.rank is None):
        if not shards or (size + job.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += job.nbytes
    files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
    if ep > 1:
        for r in range(ep):
            files[f"model-ep{r:03d}-of-{ep:03d}.safetensors"] = [j for j in jobs if j.rank == r]
    return files


def _header(jobs: list[Job]) -> bytes:
    """The safetensors header (u64 length + JSON, space-padded to 8 bytes) for these jobs' outputs."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for job in jobs:
        for o in job.outputs:
            header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [offset, offset + o.nbytes]}
            offset += o.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def converted_config(raw: dict[str, Any], source: str, ep: int) -> dict[str, Any]:
    """config.json of the W8A8 checkpoint: the source's, with its quantization_config replaced."""
    quant: dict[str, Any] = {"quant_method": QUANT_METHOD, "weight_granularity": "per_channel",
                             "activation_scheme": "dynamic_per_token", "source": source}
    if ep > 1:
        quant["ep_size"] = ep
    return {**raw, "quantization_config": quant, "torch_dtype": "bfloat16", "dtype": "bfloat16"}


def _copy_other_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config and whatever else ships beside the weights, as they are."""
    for entry in sorted(src.iterdir()):
        if entry.name in ("config.json", INDEX) or entry.suffix == ".safetensors":
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name, ignore=shutil.ignore_patterns("*.safetensors"),
                            dirs_exist_ok=True)
        else:
            shutil.copy2(entry, dst / entry.name)


def convert_checkpoint(src: str | Path, dst: str | Path, fmt: str = "w8a8", ep: int = 1,
                       max_shard_gb: float = 5.0, progress: bool = False) -> ConvertSummary:
    """Convert the checkpoint in `src` to W8A8 INT8 in `dst` (see the module docstring), tensor by
    tensor, a chunk at a time; config.json and the index are written last."""
    if fmt != "w8a8":
        raise ValueError(f"unknown format {fmt!r} (supported: 'w8a8')")
    src, dst = Path(src), Path(dst)
    t0 = time.monotonic()
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError("--dst must differ from --src")
    if dst.exists() and (any(dst.glob("*.safetensors")) or (dst / INDEX).exists()):
        raise FileExistsError(f"{dst} already holds a checkpoint")
    raw_cfg = json.loads((src / "config.json").read_text())
    if (raw_cfg.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD:
        raise ValueError(f"{src} is already W8A8")
    cfg = ModelConfig.from_pretrained(src)
    tensors = source_tensors(src)
    jobs = plan_jobs(tensors, cfg, ep)
    files = assign_files(jobs, ep, int(max_shard_gb * (1 << 30)))
    dtypes = {t.dtype for n, t in tensors.items() if is_w8a8_target(n)}
    source = "fp8" if any(t.dtype in _FP8 for t in tensors.values()) else \
        "/".join(sorted(_SOURCE_NAMES.get(d, d.lower()) for d in dtypes)) or "none"

    dst.mkdir(parents=True, exist_ok=True)
    bar = Progress(len(jobs), f"converting {src.name}", progress)
    summary, weight_map = ConvertSummary(files=list(files)), {}
    for fname, file_jobs in files.items():
        with open(dst / fname, "wb") as f:
            f.write(_header(file_jobs))
            for job in file_jobs:
                start = f.tell()
                job.run(f)
                if f.tell() - start != job.nbytes:
                    raise RuntimeError(f"{fname}: wrote {f.tell() - start} bytes for {job.outputs[0].name}, "
                                       f"expected {job.nbytes}")
                for o in job.outputs:
                    weight_map[o.name] = fname
                summary.tensors += len(job.outputs)
                summary.bytes_in += job.source_bytes
                summary.bytes_out += job.nbytes
                bar.step()
    _copy_other_files(src, dst)
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": summary.bytes_out},
                                         "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(converted_config(raw_cfg, source, ep), indent=2) + "\n")
    summary.seconds = time.monotonic() - t0
    summary.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return summary
