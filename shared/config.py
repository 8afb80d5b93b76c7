"""Typed model configuration read from a Hugging Face `config.json`.

Supports `model_type` `deepseek_v32` (MLA + lightning indexer) and `deepseek_v3` (dense MLA), in
both the legacy (`rope_scaling` + `rope_theta`) and the transformers-5 (`rope_parameters`) spelling.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "deepseek_v3")


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
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        n_layers = int(raw["num_hidden_layers"])
        layer_types = raw.get("mlp_layer_types")
        if not layer_types:
            n_dense = min(int(raw.get("first_k_dense_replace", 0)), n_layers)
            layer_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        if raw.get("n_routed_experts") in (None, 0):
            layer_types = ["dense"] * n_layers
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", raw["intermediate_size"])),
            num_hidden_layers=n_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            q_lora_rank=raw.get("q_lora_rank"),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            mlp_layer_types=tuple(layer_types),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_parse_rope(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            index_topk=int(raw.get("index_topk", 0)) if model_type == "deepseek_v32" else 0,
            index_head_dim=int(raw.get("index_head_dim", 0)) if model_type == "deepseek_v32" else 0,
            index_n_heads=int(raw.get("index_n_heads", 0)) if model_type == "deepseek_v32" else 0,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            quantization=dict(raw.get("quantization_config") or {}),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))


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


@dataclass
class ServiceConfig:
    """The flags every engine-backed service takes (the deployment renders exactly these)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    kv_transport: str = "tcp"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_tokens: int = 65536
    ep: int = 1
    tp: int = 1
    cp: int = 1  # prefill instances
    dp: int = 1  # decode instances
    layer_sharding: tuple[str, ...] = ()

    @property
    def world(self) -> int:
        """Ranks in the instance (cp, dp and tp exclude each other beyond 1)."""
        return self.cp * self.dp * self.tp

    def parallel(self):  # noqa: ANN201 - shared.parallel.ParallelConfig (imported lazily: no cycle)
        from shared.parallel.state import ParallelConfig

        return ParallelConfig(world=self.world, cp=self.cp, dp=self.dp, tp=self.tp, ep=self.ep,
                              layer_sharding=self.layer_sharding)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0, help="gRPC port (0 = pick a free one)")
        p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)")
        p.add_argument("--kv-transport", choices=["tcp", "mooncake"], default="tcp")
        p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
        p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
        p.add_argument("--kv-cache-tokens", type=int, default=65536, help="KV pool size (per rank)")
        p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (divides the instance's ranks)")
        p.add_argument("--tp", type=int, default=1, help="local TP ranks for o_proj / lm_head / embedding")
        p.add_argument("--layer-sharding", default="", help="o_proj,q_b_proj: layer i's weight lives on rank i %% K")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServiceConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["layer_sharding"] = tuple(x for x in (args.layer_sharding or "").split(",") if x)
        return cls(**values)
