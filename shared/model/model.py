"""DeepSeek-V3.2 / V3 causal LM over a paged KV cache: one implementation for every caller.

Module names mirror the Hugging Face checkpoint (`model.layers.N.self_attn.q_a_proj`, ...), so the
loader maps tensors by name; the routed experts are stacked per layer (see moe.Experts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shared.config import ModelConfig
from shared.kvcache import KVCache
from shared.model.batch import ForwardBatch
from shared.model.layers import MLP, RMSNorm, linear
from shared.model.mla import MLA
from shared.model.moe import MoE
from shared.model.rope import RotaryTable


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, indexer_numerics: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLA(cfg, dtype, indexer_numerics)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        dense = cfg.is_moe_layer(layer_idx) is False
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype) if dense else MoE(cfg, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                kv: KVCache) -> torch.Tensor:
        index_pool = kv.index[self.layer_idx] if kv.index is not None else None
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, fb, kv.mla[self.layer_idx], index_pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, indexer_numerics: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device="meta")
        self.embed_tokens.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                                requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, indexer_numerics) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, indexer_numerics: str = "transformers"):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.model = Backbone(cfg, dtype, indexer_numerics)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.rotary = RotaryTable(cfg.rope, cfg.qk_rope_head_dim, device or torch.device("cpu"))
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, kv: KVCache,
                layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run one step; writes every layer's KV for the new tokens; returns fp32 logits
        [len(fb.logits_index), vocab]. `layer_done(i)` fires after layer i's KV is in the pool
        (the prefill service pushes that layer to decode while the next one computes)."""
        h = self.model.embed_tokens(fb.input_ids)
        cos, sin = self.rotary.lookup(fb.positions, self.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, fb, kv)
            if layer_done is not None:
                layer_done(layer.layer_idx)
        h = self.model.norm(h[fb.logits_index])
        return self.lm_head(h).float()
