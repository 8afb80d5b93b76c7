"""Randomly initialised models at any config, in memory (no checkpoint, nothing downloaded).

For memory and speed checks at the real per-layer dimensions of DeepSeek-V3.2 (`real_layer_config`):
one decoder layer with hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128,
the indexer's 64 heads × 128 and index_topk 2048, and a few real-sized experts (7168 × 2048).
"""

from __future__ import annotations

from typing import Any

import torch

from shared.config import ModelConfig
from shared.model import DeepseekForCausalLM
from shared.model.indexer import DEFAULT_NUMERICS
from shared.quant.int8 import INT8_MAX, SCALE_SUFFIX

REAL_671B: dict[str, Any] = {
    "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def real_layer_config(num_experts: int = 4, vocab_size: int = 1024, **overrides: Any) -> ModelConfig:
    """One MoE layer of the 671B model at its real dimensions, with `num_experts` real-sized routed
    experts (top-2, one group) and a small vocabulary (the vocabulary is not a per-layer dimension)."""
    return ModelConfig.from_dict({**REAL_671B, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                                  "n_routed_experts": num_experts, "num_experts_per_tok": 2, "n_group": 1,
                                  "topk_group": 1, "vocab_size": vocab_size, **overrides})


@torch.inference_mode()
def random_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 indexer_numerics: str = DEFAULT_NUMERICS, quantization: str | None = None) -> DeepseekForCausalLM:
    """Weights ~ N(0, 0.02) (norms 1), filled parameter by parameter in place (no fp32 copy of the model).
    With quantization "w8a8" the W8A8 linears hold uniform int8 values in ±127 with per-channel scales
    0.02 · √3 / 127 (the same spread as the float weights)."""
    model = DeepseekForCausalLM(cfg, dtype, indexer_numerics=indexer_numerics, quantization=quantization)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight")):
            p.fill_(1.0)
        elif name.endswith(("k_norm.bias", "e_score_correction_bias")):
            p.zero_()
        elif p.dtype == torch.int8:
            for row in p.view(-1, p.shape[-1]).split(1024):
                row.copy_(torch.randint(-int(INT8_MAX), int(INT8_MAX) + 1, row.shape, generator=gen, dtype=torch.int8))
        elif name.endswith(SCALE_SUFFIX):
            p.fill_(0.02 * 3**0.5 / INT8_MAX)
        else:
            for row in p.view(-1, p.shape[-1]).split(1024):  # bounded fp32 temporaries
                row.copy_(torch.randn(row.shape, generator=gen) * 0.02)
    model.apply_parallel()
    return model
