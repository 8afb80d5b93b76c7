"""A checkpoint in exactly the layout DeepSeek publishes for DeepSeek-V3.2, built by hand here.

Independent of the project's own generator (shared.loader.tiny): the config is written like the
release's config.json (legacy `rope_scaling`, `quantization_config` with ue8m0, an MTP layer,
`torch_dtype` bfloat16) and the tensors follow the release's names and dtypes — FP8 e4m3 linears with
128×128 power-of-two fp32 `weight_scale_inv` (ragged edges: kv_a_proj has 512 + 64 rows), the indexer's
`wq_b`/`wk` FP8, bf16 `weights_proj`, embeddings, router gate and MTP `eh_proj`/`shared_head.head`,
fp32 norms, `k_norm` weight + bias and `e_score_correction_bias` — split over two shards with an index
that puts some scales in a different shard than their weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8_MAX = 448.0
BLOCK = 128

CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "ep_size": 1,
    "q_lora_rank": 192, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "index_topk": 16, "index_head_dim": 128, "index_n_heads": 8,
    "max_position_embeddings": 8192, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128×128 block: a power-of-two scale ≥ amax/448 (ue8m0), e4m3 values."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = torch.empty(br, bc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            s = 2.0 ** torch.ceil(torch.log2(block.abs().max().clamp(min=1e-12) / FP8_MAX))
            scale[i, j] = s
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_hand(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[i, j] = float(q[i, j]) * scale[i // 128, j // 128], block by block."""
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] *= scale[i, j]
    return out


def _layer(i: int, cfg: dict, moe: bool, gen: torch.Generator) -> tuple[dict, dict]:
    """(fp8 linears as fp32 to quantize, other tensors in their release dtype) of decoder layer i."""
    h, heads, ql = cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    nidx, didx = cfg["index_n_heads"], cfg["index_head_dim"]

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:
        return 1 + rnd(n, std=0.05)

    p = f"model.layers.{i}."
    lin = {
        p + "self_attn.q_a_proj.weight": rnd(ql, h),
        p + "self_attn.q_b_proj.weight": rnd(heads * qk, ql),
        p + "self_attn.kv_a_proj_with_mqa.weight": rnd(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
        p + "self_attn.kv_b_proj.weight": rnd(heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                                               cfg["kv_lora_rank"]),
        p + "self_attn.o_proj.weight": rnd(h, heads * cfg["v_head_dim"]),
        p + "self_attn.indexer.wq_b.weight": rnd(nidx * didx, ql),
        p + "self_attn.indexer.wk.weight": rnd(didx, h),
    }
    other = {
        p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
        p + "self_attn.q_a_layernorm.weight": norm(ql),
        p + "self_attn.kv_a_layernorm.weight": norm(cfg["kv_lora_rank"]),
        p + "self_attn.indexer.k_norm.weight": norm(didx), p + "self_attn.indexer.k_norm.bias": rnd(didx),
        p + "self_attn.indexer.weights_proj.weight": rnd(nidx, h).to(torch.bfloat16),
    }
    if moe:
        inter = cfg["moe_intermediate_size"]
        for e in range(cfg["n_routed_experts"]):
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                lin[p + f"mlp.experts.{e}.{proj}.weight"] = rnd(*shape)
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            lin[p + f"mlp.shared_experts.{proj}.weight"] = rnd(*shape)
        other[p + "mlp.gate.weight"] = rnd(cfg["n_routed_experts"], h).to(torch.bfloat16)
        other[p + "mlp.gate.e_score_correction_bias"] = rnd(cfg["n_routed_experts"], std=0.01)
    else:
        inter = cfg["intermediate_size"]
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            lin[p + f"mlp.{proj}.weight"] = rnd(*shape)
    return lin, other


def build_official_checkpoint(out: Path, seed: int = 0, **config_overrides: object) -> Path:
    """Write config.json, two safetensors shards + index, and a tokenizer.json into `out`."""
    from shared.loader.tokenizer_train import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    cfg = {**CONFIG, **config_overrides}
    gen = torch.Generator().manual_seed(seed)
    n, h, v = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16),
        "model.norm.weight": 1 + torch.randn(h, generator=gen) * 0.05,
        "lm_head.weight": (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16),
    }
    for i in range(n + cfg["num_nextn_predict_layers"]):  # layer n is the MTP layer: a full MoE layer + extras
        lin, other = _layer(i, cfg, moe=i >= cfg["first_k_dense_replace"], gen=gen)
        for name, w in lin.items():
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(w)
        tensors.update(other)
    for i in range(n, n + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "embed_tokens.weight"] = (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16)
        tensors[p + "enorm.weight"] = torch.ones(h)
        tensors[p + "hnorm.weight"] = torch.ones(h)
        tensors[p + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=gen) * 0.02).to(torch.bfloat16)
        tensors[p + "shared_head.norm.weight"] = torch.ones(h)
        tensors[p + "shared_head.head.weight"] = (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16)

    names = sorted(tensors)  # sorted: "x.weight" and "x.weight_scale_inv" sit side by side ...
    half = len(names) // 2
    while not names[half].endswith("_scale_inv"):  # ... so split right before a scale: it lands apart
        half += 1
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    train_tokenizer(min(v, 1024), out / "tokenizer.json")
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A single-file copy of `src` with other tensors (and optionally another config)."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst
