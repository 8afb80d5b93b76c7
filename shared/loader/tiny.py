"""Tiny random DeepSeek checkpoints in exactly the Hugging Face layout, plus a tokenizer.

    python -m shared.loader.tiny OUT_DIR [--model-type deepseek_v32|deepseek_v3] [--fp8] [--shards N]

Weights are random (seeded) so that tests, the demo and the benchmarks run without downloads; the
files are what `save_pretrained` writes (config.json, per-expert tensor names, safetensors, optional
`model.safetensors.index.json`), and `--fp8` stores linears as float8_e4m3fn with 128×128
`weight_scale_inv` like the real DeepSeek release.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shared.config import ModelConfig
from shared.loader.tokenizer_train import train_tokenizer
from shared.model import DeepseekForCausalLM
from shared.quant.fp8 import quant_block_fp8

# The embedded tiny model (the benchmark's config): hidden 256, 4 layers, 8 experts top-2.
TINY: dict[str, Any] = {
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "index_topk": 64, "index_head_dim": 128, "index_n_heads": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

_FP8_SKIP = re.compile(r"(embed_tokens|lm_head|norm|layernorm|mlp\.gate\.|weights_proj|k_norm|e_score)")


def make_config(model_type: str = "deepseek_v32", **overrides: Any) -> dict[str, Any]:
    cfg = {**TINY, **overrides, "model_type": model_type}
    cfg["architectures"] = ["DeepseekV32ForCausalLM" if model_type == "deepseek_v32" else "DeepseekV3ForCausalLM"]
    n_layers = cfg["num_hidden_layers"]
    n_dense = min(cfg["first_k_dense_replace"], n_layers)
    cfg["mlp_layer_types"] = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    cfg["head_dim"] = cfg["qk_rope_head_dim"]
    if model_type == "deepseek_v3":
        for key in ("index_topk", "index_head_dim", "index_n_heads"):
            cfg.pop(key, None)
        cfg["rope_interleave"] = True
    return cfg


def random_state_dict(cfg: dict[str, Any], seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors: linears ~ N(0, std), norms 1, LayerNorm bias 0, small random router bias."""
    model = DeepseekForCausalLM(ModelConfig.from_dict(cfg), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = torch.ones(param.shape)
        elif name.endswith("k_norm.bias"):
            value = torch.zeros(param.shape)
        elif name.endswith("e_score_correction_bias"):
            value = torch.randn(param.shape, generator=gen) * 0.01
        else:
            value = torch.randn(param.shape, generator=gen) * std
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name.removesuffix(".gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = value[e].clone()
        else:
            out[name] = value
    return out


def random_mtp_layer(cfg: dict[str, Any], main: dict[str, torch.Tensor], seed: int, std: float = 0.02,
                     ) -> dict[str, torch.Tensor]:
    """A random MTP layer in DeepSeek's layout at index num_hidden_layers: a full decoder block plus enorm,
    hnorm, eh_proj, shared_head.norm and copies of the embedding and head (see shared.model.mtp)."""
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    deeper_cfg = {**cfg, "num_hidden_layers": n + 1, "mlp_layer_types": [*cfg["mlp_layer_types"], "sparse"]}
    deeper = random_state_dict(deeper_cfg, seed + 1, std)
    prefix = f"model.layers.{n}."
    out = {k: v for k, v in deeper.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 2)
    out.update({
        prefix + "enorm.weight": torch.ones(hidden), prefix + "hnorm.weight": torch.ones(hidden),
        prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * std,
        prefix + "shared_head.norm.weight": torch.ones(hidden),
        prefix + "embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
        prefix + "shared_head.head.weight": main["lm_head.weight"].clone(),
    })
    return out


def to_fp8(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Block-quantize the linears DeepSeek ships in FP8; returns (tensors, quantized names)."""
    out, quantized = {}, []
    for name, t in tensors.items():
        if t.dim() == 2 and not _FP8_SKIP.search(name):
            q, scale = quant_block_fp8(t)
            out[name], out[name + "_scale_inv"] = q, scale
            quantized.append(name)
        else:
            out[name] = t
    return out, quantized


def write_checkpoint(out_dir: str | Path, model_type: str = "deepseek_v32", seed: int = 0, fp8: bool = False,
                     shards: int = 1, tokenizer: bool = True, mtp: bool = False, std: float = 0.02,
                     **overrides: Any) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(model_type, **overrides)
    tensors = random_state_dict(cfg, seed, std)
    if mtp:  # one multi-token-prediction layer, as DeepSeek ships it
        tensors.update(random_mtp_layer(cfg, tensors, seed, std))
        cfg["num_nextn_predict_layers"] = 1
    if fp8:
        tensors, _ = to_fp8(tensors)
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    names = sorted(tensors)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        weight_map, per = {}, -(-len(names) // shards)
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i * per : (i + 1) * per]
            # keep a weight and its scale in different shards sometimes: the loader must pair them anyway
            save_file({n: tensors[n].contiguous() for n in part}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer:
        train_tokenizer(cfg["vocab_size"], out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
            "eos_token": "<｜end▁of▁sentence｜>", "model_max_length": cfg["max_position_embeddings"],
        }, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2))
    return out


def ensure_tiny_model(out_dir: str | Path, model_type: str = "deepseek_v32") -> Path:
    """The embedded tiny model, generated on first use."""
    out = Path(out_dir)
    if not (out / "config.json").exists():
        write_checkpoint(out, model_type)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--model-type", default="deepseek_v32", choices=["deepseek_v32", "deepseek_v3"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="store linears as FP8 e4m3 with 128x128 block scales")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a config field, e.g. --set num_hidden_layers=2 --set index_topk=16")
    args = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    out = write_checkpoint(args.out_dir, args.model_type, args.seed, args.fp8, args.shards, **overrides)
    print(f"wrote {args.model_type} checkpoint to {out}")


if __name__ == "__main__":
    main()
