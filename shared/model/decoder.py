"""One decoder block of DeepSeek-V3.2: MLA attention (with its indexer) and a dense MLP or the MoE, each after
an RMSNorm, with residual adds. The main model stacks them; the MTP drafter runs one more."""

from __future__ import annotations

import torch
from torch import nn

from shared.config import ModelConfig
from shared.kvcache import KVCache
from shared.model.batch import ForwardBatch
from shared.model.layers import MLP, LinearFormats, RMSNorm
from shared.model.mla import MLA
from shared.model.moe import MoE
from shared.model.rope import RopeAngles
from shared.parallel.state import ParallelState


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, indexer_numerics: str,
                 parallel: ParallelState, fmts: LinearFormats | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLA(cfg, dtype, indexer_numerics, fmts)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, dtype, parallel.config.ep, parallel.ep_rank, parallel.ep_group, fmts)
        else:  # dense MLPs: bf16 under W8A8 (the practice), FP8 when FP8 is kept
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, fmts.target if fmts else None)

    def forward(self, h: torch.Tensor, rope: RopeAngles, fb: ForwardBatch, kv: KVCache) -> torch.Tensor:
        index_pool = kv.index[self.layer_idx] if kv.index is not None else None
        codecs = (kv.mla_codec, kv.index_codec) if kv.layout.c8 else None
        h = h + self.self_attn(self.input_layernorm(h), rope, fb, kv.mla[self.layer_idx], index_pool, codecs)
        return h + self.mlp(self.post_attention_layernorm(h), fb.generated)
