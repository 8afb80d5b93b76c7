"""The trained demo model written as a DeepSeek-V3.2 checkpoint the engine loads: bf16 safetensors (norms and
router bias fp32), config.json, the tokenizer and generation_config.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from shared.demo.model import DemoModel
from shared.demo.recipe import DEMO_SAMPLING, TrainConfig
from shared.loader.tiny import make_config


def _keep_fp32(name: str) -> bool:
    return bool(re.search(r"(norm\.(weight|bias)|layernorm\.weight|e_score_correction_bias)$", name))


def _split_experts(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF module state (fused experts) → checkpoint names (per-expert gate/up/down_proj, DeepSeek's)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        full = prefix + name
        if name.endswith("experts.gate_up_proj"):
            base, inter = full.removesuffix(".gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{base}.{e}.up_proj.weight"] = value[e, inter:]
        elif name.endswith("experts.down_proj"):
            base = full.removesuffix(".down_proj")
            for e in range(value.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = value[e]
        else:
            out[full] = value
    return out


def export_tensors(model: DemoModel) -> dict[str, torch.Tensor]:
    """The checkpoint: HF names, per-expert layout, MTP layer at index N with copies of embed and head;
    bf16, norms and router bias fp32."""
    n = model.lm.config.num_hidden_layers
    tensors = _split_experts("", model.lm.state_dict())
    mtp = f"model.layers.{n}."
    tensors.update(_split_experts(mtp, model.mtp.block.state_dict()))
    tensors.update({
        mtp + "embed_tokens.weight": model.lm.model.embed_tokens.weight,
        mtp + "enorm.weight": model.mtp.enorm.weight, mtp + "hnorm.weight": model.mtp.hnorm.weight,
        mtp + "eh_proj.weight": model.mtp.eh_proj.weight,
        mtp + "shared_head.norm.weight": model.mtp.shared_head_norm.weight,
        mtp + "shared_head.head.weight": model.lm.lm_head.weight,
    })
    return {k: v.detach().to(torch.float32 if _keep_fp32(k) else torch.bfloat16).contiguous().clone()
            for k, v in sorted(tensors.items()) if not k.endswith("rotary_emb.inv_freq")}


def write_checkpoint(out: Path, model: DemoModel, cfg: TrainConfig, tokenizer_file: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {**make_config(**cfg.model), "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(export_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_file != out / "tokenizer.json":
        (out / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>", "model_max_length": config["max_position_embeddings"],
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(  # how the demo samples (greedy text loops)
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], **DEMO_SAMPLING},
        indent=2) + "\n")
