"""Load Hugging Face DeepSeek-V3/V3.2 safetensors checkpoints into DeepseekForCausalLM.

* single `model.safetensors` or sharded with `model.safetensors.index.json`;
* per-expert (`mlp.experts.E.gate_proj.weight`) and fused (`mlp.experts.gate_up_proj`) expert layouts;
* FP8 e4m3 weights with `weight_scale_inv` block scales as `quantization_config` describes them
  (block size from `weight_block_size`, fp32 or e8m0 scales; multipliers; ragged edges), incl. fused
  3-D expert tensors whose scales are sliced with the weights under expert parallelism;
* the MTP layer DeepSeek ships at index `num_hidden_layers` skipped (never read) unless asked for,
  then kept as stored (FP8 stays FP8, scales beside it) for the MTP drafter;
* tensors are read lazily with `safe_open`, one at a time, straight into the parameter.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from shared.config import EngineConfig, Fp8Scheme, ModelConfig, knob_default
from shared.device import check_weight_sharing, get_device, parse_dtype
from shared.loader.shared_weights import share_weights, weights_key
from shared.model import DeepseekForCausalLM
from shared.model.moe import Experts
from shared.model.mtp import MTPLayer
from shared.parallel.state import ParallelState
from shared.quant.fp8 import decode_scales, dequant_block_fp8, quant_block_fp8
from shared.quant.int8 import quantize_weight

_EXPERT = re.compile(r"^((?:model\.layers\.\d+|mtp\.block)\.mlp\.experts)\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj)\.weight(_scale)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FUSED_EXPERTS = (".gate_up_proj", ".down_proj", ".gate_up_proj_scale", ".down_proj_scale")  # [E, ...]: sliced under EP


@dataclass
class LoadReport:
    loaded: int = 0
    skipped_mtp: int = 0
    seconds: float = 0.0
    mtp_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Progress:
    """One-line progress on stderr for long loads (prints nothing when disabled)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.done, self._last, self._t0 = 0, 0.0, time.monotonic()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.5 or self.done >= self.total):
            self._last = now
            pct = 100 * self.done / self.total
            end = "\n" if self.done >= self.total else "\r"
            print(f"{self.label}: {self.done}/{self.total} ({pct:5.1f}%) {now - self._t0:6.1f}s",
                  end=end, file=sys.stderr, flush=True)


def checkpoint_files(path: Path) -> dict[str, list[str]]:
    """file name → tensor names it holds."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = defaultdict(list)
        for name, fname in weight_map.items():
            files[fname].append(name)
        return dict(files)
    singles = sorted(p.name for p in path.glob("*.safetensors"))
    if not singles:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    out = {}
    for fname in singles:
        with safe_open(path / fname, "pt") as f:
            out[fname] = list(f.keys())
    return out


def iter_tensors(path: Path, files: dict[str, list[str]], rows: Callable[[str], slice | None] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, tensor, scale_inv or None), scales paired with their weight even across shards.
    `rows(name)` may return a slice of the first dim to read (others are never read), or None to
    skip the tensor without reading it. A file with no wanted tensor is never opened (an EP rank of a
    `pdserve convert --ep` checkpoint reads the shared shards and its own rank file only). W8A8
    `X.weight_scale` tensors are ordinary tensors here: yielded on their own, scale None."""
    all_names = {n: fname for fname, names in files.items() for n in names}
    for fname, names in files.items():
        wanted = []
        for name in names:
            if not name.endswith("_scale_inv"):  # a scale_inv is read with its weight
                part = rows(name) if rows is not None else slice(None)
                if part is not None:
                    wanted.append((name, part))
        if not wanted:
            continue
        with safe_open(path / fname, "pt") as f:
            for name, part in wanted:
                whole = part == slice(None)
                tensor = f.get_tensor(name) if whole else f.get_slice(name)[part]
                scale = None
                scale_name = name + "_scale_inv"
                if scale_name in all_names:
                    if all_names[scale_name] == fname:
                        scale = f.get_tensor(scale_name) if whole else f.get_slice(scale_name)[part]
                    else:
                        with safe_open(path / all_names[scale_name], "pt") as g:
                            scale = g.get_tensor(scale_name) if whole else g.get_slice(scale_name)[part]
                yield name, tensor, scale


def _dequant(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, scheme: Fp8Scheme | None) -> torch.Tensor:
    if tensor.dtype in _FP8:
        if scale is None:
            raise ValueError(f"{name} is FP8 but has no weight_scale_inv")
        scheme = scheme or Fp8Scheme()
        return dequant_block_fp8(tensor, scale, scheme.block, scheme.scale_fmt)
    return tensor


def load_weights(model: DeepseekForCausalLM, path: str | Path, include_mtp: bool = False,
                 progress: bool = False) -> LoadReport:
    path = Path(path)
    cfg = model.config
    scheme = cfg.fp8
    params = dict(model.named_parameters())
    files = checkpoint_files(path)
    spans = {name: (m.first_expert, m.first_expert + m.num_local)
             for name, m in model.named_modules() if isinstance(m, Experts)}

    def is_mtp(name: str) -> bool:
        layer = _LAYER.match(name)
        return layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers

    def model_name(name: str) -> str | None:
        """An MTP checkpoint name → its place in the model's MTP drafter (None: not loaded)."""
        if model.mtp is None or not is_mtp(name):
            return name
        return MTPLayer.param_name(name.split(".", 3)[3])

    def rows(name: str) -> slice | None:
        """What to read: the MTP layer only when asked; under expert parallelism only this rank's experts."""
        if is_mtp(name):
            if model.mtp is None:
                return slice(None) if include_mtp else None
            name = model_name(name)
            if name is None:
                return None
        expert = _EXPERT.match(name)
        if expert:
            lo, hi = spans[expert.group(1)]
            return slice(None) if lo <= int(expert.group(2)) < hi else None
        prefix = name.rsplit(".", 1)[0]
        if prefix in spans and name.endswith(_FUSED_EXPERTS):
            return slice(*spans[prefix])
        return slice(None)

    n_tensors = sum(1 for names in files.values() for n in names
                    if not n.endswith("_scale_inv") and rows(n) is not None)
    bar = Progress(n_tensors, f"loading {path.name}", progress)
    report, filled, t0 = LoadReport(), set(), time.monotonic()

    report.skipped_mtp = sum(1 for names in files.values() for n in names
                             if is_mtp(n) and not n.endswith("_scale_inv") and rows(n) is None)
    for name, tensor, scale in iter_tensors(path, files, rows):
        bar.step()
        if is_mtp(name) and model.mtp is not None:  # into the MTP drafter
            name = model_name(name)
        elif is_mtp(name):  # kept as stored: FP8 stays FP8 with its scale beside it
            report.mtp_tensors[name] = tensor
            if scale is not None:
                report.mtp_tensors[name + "_scale_inv"] = scale
            continue
        placed = _place(name, params, spans, cfg)
        if placed is None:
            continue
        _fill(name, tensor, scale, placed, scheme, filled)
        report.loaded += 1

    if "lm_head.weight" not in filled and cfg.tie_word_embeddings:
        params["lm_head.weight"].copy_(params["model.embed_tokens.weight"])
        filled.add("lm_head.weight")
    missing = [n for n in params if n not in filled and not _expert_param_filled(n, params, filled, cfg)]
    if missing:
        raise KeyError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    report.seconds = time.monotonic() - t0
    return report


Place = tuple[torch.Tensor, object]  # (destination view, key recorded as filled)


def _fill(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, placed: tuple[Place, Place | None],
          scheme: Fp8Scheme | None, filled: set) -> None:
    """Copy one checkpoint tensor to its place in the model (recording what it filled): FP8 kept as FP8 where
    the model holds FP8, else dequantized, and quantized to INT8 here where the model asks for W8A8."""
    (target, key), scale_place = placed
    if target.dtype == torch.float8_e4m3fn:  # FP8 kept as FP8: stored bytes and block scales as they are
        _load_fp8(name, tensor, scale, scheme or Fp8Scheme(), target, scale_place)
        filled.update((key, scale_place[1]))
        return
    weight = _dequant(name, tensor, scale, scheme)
    if tuple(target.shape) != tuple(weight.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(weight.shape)} != model {tuple(target.shape)}")
    if target.dtype == torch.int8 and weight.dtype != torch.int8:  # W8A8 asked for: quantize this tensor now
        if scale_place is None:
            raise KeyError(f"{name}: int8 parameter without a scale")
        weight, weight_scale = quantize_weight(weight)
        scale_place[0].copy_(weight_scale)
        filled.add(scale_place[1])
    elif weight.dtype == torch.int8 and target.dtype != torch.int8:
        raise ValueError(f"{name}: the checkpoint holds int8 but the model expects {target.dtype}")
    target.copy_(weight.to(target.dtype))
    filled.add(key)


def _place(name: str, params: dict[str, torch.Tensor], spans: dict[str, tuple[int, int]], cfg: ModelConfig,
           ) -> tuple[Place, Place | None] | None:
    """Where checkpoint tensor `name` goes, and where its W8A8 scale goes when the destination is int8
    (None: a tensor the model does not keep, such as rotary inv_freq). Per-expert tensors land in
    their rows of the stacked expert parameters."""
    expert = _EXPERT.match(name)
    if expert:
        prefix, proj, is_scale = expert.group(1), expert.group(3), expert.group(4) is not None
        e = int(expert.group(2)) - spans[prefix][0]
        inter = cfg.moe_intermediate_size
        stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        rows = {"down_proj": slice(None), "gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}[proj]
        key = (f"{prefix}.{stacked}", e, proj)
        scale = None
        if f"{prefix}.{stacked}_scale" in params:  # W8A8: one scale per output channel
            scale_name = f"{prefix}.{stacked}_scale"
            scale = (params[scale_name][e, rows], (scale_name, e, proj))
        elif f"{prefix}.{stacked}_scale_inv" in params:  # FP8 kept: one scale per row-block
            scale_name, br = f"{prefix}.{stacked}_scale_inv", cfg.fp8.block[0] if cfg.fp8 else 128
            blocks = slice(None) if rows == slice(None) else slice(rows.start // br, rows.stop // br)
            scale = (params[scale_name][e, blocks], (scale_name, e, proj))
        if is_scale:
            if scale is None or not scale[1][0].endswith("_scale"):
                raise KeyError(f"checkpoint tensor {name!r} is a W8A8 scale but the model is not W8A8")
            return scale, None
        return (params[f"{prefix}.{stacked}"][e, rows], key), scale
    if name in params:
        scale_name = next((name + s for s in ("_scale", "_scale_inv") if name + s in params), None)
        return (params[name], name), ((params[scale_name], scale_name) if scale_name else None)
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.endswith("_scale"):
        raise KeyError(f"checkpoint tensor {name!r} is a W8A8 scale but the model is not W8A8")
    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")


def _load_fp8(name: str, tensor: torch.Tensor, scale: torch.Tensor | None, scheme: Fp8Scheme,
              target: torch.Tensor, scale_place: Place | None) -> None:
    """Fill an FP8 parameter and its block scales: an FP8 checkpoint tensor is copied as stored (scales
    decoded to fp32 multipliers), a bf16/fp32 one is block-quantized here."""
    if scale_place is None:
        raise KeyError(f"{name}: FP8 parameter without block scales")
    if tensor.dtype in _FP8:
        if scale is None:
            raise ValueError(f"{name} is FP8 but has no weight_scale_inv")
        q, s = tensor.to(torch.float8_e4m3fn), decode_scales(scale, scheme.scale_fmt)
    elif tensor.dim() == 2:
        q, s = quant_block_fp8(tensor, scheme.block[0])
    else:
        raise ValueError(f"{name}: only 2-D weights can be quantized to FP8 while loading")
    for what, got, want in (("shape", q, target), ("scale shape", s, scale_place[0])):
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{name}: checkpoint {what} {tuple(got.shape)} != model {tuple(want.shape)}")
    target.copy_(q)
    scale_place[0].copy_(s)


def _expert_param_filled(name: str, params: dict, filled: set, cfg: ModelConfig) -> bool:
    """Stacked expert params count as loaded when every expert's slices were filled."""
    for stacked, projs in (("experts.down_proj", ("down_proj",)), ("experts.gate_up_proj", ("gate_proj", "up_proj"))):
        if name.endswith((stacked, stacked + "_scale", stacked + "_scale_inv")):
            return all((name, e, p) in filled for e in range(params[name].shape[0]) for p in projs)
    return False


DEFAULT_DTYPE = knob_default(EngineConfig, "dtype")  # the engine's defaults, declared on EngineConfig
DEFAULT_INDEXER_NUMERICS = knob_default(EngineConfig, "indexer_numerics")


def load_model(path: str | Path, dtype: str | torch.dtype = DEFAULT_DTYPE, device: str | None = None,
               indexer_numerics: str = DEFAULT_INDEXER_NUMERICS, progress: bool = False,
               include_mtp: bool = False, parallel: ParallelState | None = None,
               quantization: str | None = None, share_weights_dir: str | None = None, mtp: bool = False,
               ) -> tuple[DeepseekForCausalLM, LoadReport]:
    """Build the model from `path/config.json` and fill it from the safetensors next to it
    (only this rank's experts under expert parallelism), then shard it for TP / layer sharding.
    `quantization` "w8a8" quantizes the W8A8 linears while loading (one tensor at a time); None runs
    the checkpoint's own format (a `pdserve convert`ed checkpoint is W8A8 already).
    `share_weights_dir` (e.g. /dev/shm/pdserve) maps the weights from one node-wide file that every
    co-located process holding the same slice shares, instead of a private copy each (shared_weights)."""
    cfg = ModelConfig.from_pretrained(path)
    dev = get_device(device)
    check_weight_sharing(share_weights_dir, dev)
    dtype = cfg.default_dtype if dtype == "auto" else dtype
    model = DeepseekForCausalLM(cfg, parse_dtype(dtype), dev, indexer_numerics, parallel, quantization, mtp)
    report = load_weights(model, path, include_mtp=include_mtp, progress=progress)
    model = model.to(dev)
    model.apply_parallel()
    if share_weights_dir is not None:
        # what shapes this process's tensors: ranks that hold the same slice (DP ranks, a prefill and
        # a decode instance alike) get the same key and so share one file
        par, pc = model.parallel, model.parallel.config
        extra: dict[str, object] = {"quantization": model.quantization, "indexer_numerics": indexer_numerics,
                                    "tp": pc.tp, "tp_rank": par.tp_rank, "ep": pc.ep, "ep_rank": par.ep_rank,
                                    "layer_sharding": list(pc.layer_sharding)}
        if pc.layer_sharding and pc.world > 1:
            extra.update(world=pc.world, rank=par.rank)
        share_weights(model, weights_key(path, parse_dtype(dtype), extra), share_weights_dir)
    return model, report
