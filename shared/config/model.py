"""The model's typed configuration, read from a Hugging Face `config.json`.

Supports `model_type` `deepseek_v32` (MLA + lightning indexer) and `deepseek_v3` (dense MLA), in
both the legacy (`rope_scaling` + `rope_theta`) and the transformers-5 (`rope_parameters`) spelling.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "deepseek_v3")
W8A8_METHOD = "w8a8_int8"  # quantization_config.quant_method of W8A8 checkpoints (shared.quant.int8)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE / YaRN parameters, normalized from either HF spelling."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class Fp8Scheme:
    """`quantization_config` of an FP8 block-quantized checkpoint (DeepSeek's release: fmt e4m3,
    weight_block_size [128, 128], scale_fmt ue8m0, activation_scheme dynamic). Weight scales are
    `weight_scale_inv` multipliers per block, stored as fp32 (powers of two under ue8m0) or as raw
    e8m0 exponent bytes (float8_e8m0fnu, or uint8 with scale_fmt ue8m0)."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None
    activation_scheme: str = "dynamic"

    @classmethod
    def from_quantization_config(cls, q: dict[str, Any]) -> Fp8Scheme | None:
        if not q or q.get("quant_method") == W8A8_METHOD:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported "
                             f"(supported: 'fp8', {W8A8_METHOD!r})")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (supported: 'e4m3')")
        block = q.get("weight_block_size") or [128, 128]
        if len(block) != 2 or min(int(b) for b in block) <= 0:
            raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
        scale_fmt = q.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r} is not supported (None or 'ue8m0')")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported ('dynamic')")
        return cls((int(block[0]), int(block[1])), scale_fmt, scheme)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    num_nextn_predict_layers: int = 0
    quantization: dict[str, Any] = field(default_factory=dict)
    checkpoint_dtype: str | None = None  # config.json "torch_dtype" / "dtype"

    @property
    def default_dtype(self) -> str:
        """dtype "auto": the checkpoint's own compute dtype (FP8 releases compute in bfloat16)."""
        if self.quantization or self.checkpoint_dtype not in ("float32", "bfloat16", "float16"):
            return "bfloat16"
        return self.checkpoint_dtype

    @property
    def fp8(self) -> Fp8Scheme | None:
        """The checkpoint's FP8 block quantization, read from `quantization_config` (None: unquantized)."""
        return Fp8Scheme.from_quantization_config(self.quantization)

    @property
    def w8a8(self) -> bool:
        """The checkpoint holds W8A8 INT8 weights (written by `pdserve convert --format w8a8`)."""
        return self.quantization.get("quant_method") == W8A8_METHOD

    @property
    def has_indexer(self) -> bool:
        return self.model_type == "deepseek_v32"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times mscale² when YaRN sets mscale_all_dim."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """The MTP layers past num_hidden_layers are MoE blocks, as DeepSeek ships them."""
        return layer >= len(self.mlp_layer_types) or self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read an HF config.json; a missing field takes transformers' default for the model type
        (DeepseekV3Config / DeepseekV32Config), and values the model does not implement are refused."""
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        raw = {**_HF_DEFAULTS[model_type], **{k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}}
        _check_supported(raw)
        n_layers = int(raw["num_hidden_layers"])
        layer_types = raw.get("mlp_layer_types")
        if not layer_types:
            n_dense = min(int(raw["first_k_dense_replace"]), n_layers)
            layer_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        if len(layer_types) != n_layers or set(layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list 'dense'/'sparse' for each of {n_layers} layers")
        if raw.get("n_routed_experts") in (None, 0):
            layer_types = ["dense"] * n_layers
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        v32 = model_type == "deepseek_v32"
        cfg = cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            q_lora_rank=raw.get("q_lora_rank"),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            n_group=int(raw["n_group"]),
            topk_group=int(raw["topk_group"]),
            routed_scaling_factor=float(raw["routed_scaling_factor"]),
            norm_topk_prob=bool(raw["norm_topk_prob"]),
            mlp_layer_types=tuple(layer_types),
            rms_norm_eps=float(raw["rms_norm_eps"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rope=_parse_rope(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            tie_word_embeddings=bool(raw["tie_word_embeddings"]),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            index_topk=int(raw["index_topk"]) if v32 else 0,
            index_head_dim=int(raw["index_head_dim"]) if v32 else 0,
            index_n_heads=int(raw["index_n_heads"]) if v32 else 0,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            quantization=dict(raw.get("quantization_config") or {}),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Shapes the model can run; a bad value fails here, not as a NaN later."""
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings"]
        if self.has_indexer:
            positive += ["index_topk", "index_head_dim", "index_n_heads"]
        if self.n_routed_experts:
            positive += ["num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size"]
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.json: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"config.json: n_group {self.n_group} does not divide n_routed_experts "
                                 f"{self.n_routed_experts}")
            if self.topk_group > self.n_group:
                raise ValueError(f"config.json: topk_group {self.topk_group} > n_group {self.n_group}")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ValueError("config.json: num_experts_per_tok exceeds the experts in topk_group groups")
        if self.has_indexer and self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("config.json: index_head_dim must be >= qk_rope_head_dim (the indexer ropes its "
                             "first dims)")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))


# transformers' DeepseekV3Config / DeepseekV32Config defaults: a field missing from config.json takes
# these values, exactly as `AutoConfig` would read the same file.
_COMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "rope_theta": 10000.0,
}
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {**_COMMON_DEFAULTS, "max_position_embeddings": 4096},
    "deepseek_v32": {**_COMMON_DEFAULTS, "max_position_embeddings": 163840, "index_topk": 2048,
                     "index_head_dim": 128, "index_n_heads": 64},
}
# Values of routing / activation fields this model implements (DeepSeek-V3/V3.2 use exactly these).
_SUPPORTED_VALUES: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "hidden_act": ("silu",), "moe_layer_freq": (1,),
}


def _check_supported(raw: dict[str, Any]) -> None:
    for key, allowed in _SUPPORTED_VALUES.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"config.json: {key}={raw[key]!r} is not implemented (supported: {list(allowed)})")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope type {rope_type!r} is not supported (default, yarn)")
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096))
    if factor is None:
        factor = raw.get("max_position_embeddings", orig) / orig if rope_type == "yarn" else 1.0
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
