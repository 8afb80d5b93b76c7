"""DeepSeek's multi-token-prediction (MTP) layer, used as the drafter for speculative decoding.

The checkpoint keeps it at `model.layers.{num_hidden_layers}.*`: enorm, hnorm, eh_proj [H, 2H], a
full decoder block (MLA with its own indexer, MoE) and shared_head.norm (its embed_tokens and
shared_head.head copies are not loaded: MTP shares the main model's embedding and head, as the
V3 report describes). For position j, with h_j the main model's post-final-norm hidden state:

    x_j = eh_proj(cat([enorm(embed(t_{j+1})), hnorm(h_j)]))      # embedding first (vLLM's order)
    g_j = shared_head.norm(block(x_j))                           # block: causal over MTP states ≤ j
    logits_j = lm_head(g_j)                                      # predicts t_{j+2}

The block runs at rotary position j and keeps its own MLA / indexer cache as one more layer of the KV
pool (layer index num_hidden_layers). Chained drafts reuse the layer with g_j in place of h_j.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.config import ModelConfig
from shared.kvcache import KVCache
from shared.model.batch import ForwardBatch
from shared.model.decoder import DecoderLayer
from shared.model.layers import LinearFormats, RMSNorm, linear
from shared.model.rope import RopeAngles
from shared.parallel.state import ParallelState


class MTPLayer(nn.Module):
    # checkpoint names under model.layers.{N}. that belong to the MTP wrapper, not to its decoder block
    WRAPPER = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    SHARED = ("embed_tokens.", "shared_head.head.")  # copies of the main model's: not loaded

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, indexer_numerics: str, parallel: ParallelState,
                 fmts: LinearFormats | None = None):
        super().__init__()
        hidden = cfg.hidden_size
        self.layer_idx = cfg.num_hidden_layers
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype)
        self.eh_proj = linear(2 * hidden, hidden, dtype)
        self.block = DecoderLayer(cfg, self.layer_idx, dtype, indexer_numerics, parallel, fmts)  # as the main layers
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, cfg.rms_norm_eps, torch.float32)

    @classmethod
    def param_name(cls, rest: str) -> str | None:
        """Module path of a checkpoint name's part after `model.layers.{N}.` (None: not loaded)."""
        if rest.startswith(cls.SHARED):
            return None
        return f"mtp.{rest}" if rest.startswith(cls.WRAPPER) else f"mtp.block.{rest}"

    def forward(self, embed: torch.Tensor, hidden_prev: torch.Tensor, rope: RopeAngles, fb: ForwardBatch,
                kv: KVCache, dtype: torch.dtype) -> torch.Tensor:
        """embed: main embedding of t_{j+1} [N, H]; hidden_prev: h_j [N, H] → g_j [N, H] (dtype)."""
        x = self.eh_proj(torch.cat([self.enorm(embed), self.hnorm(hidden_prev.to(embed.dtype))], -1), fb.generated)
        h = self.block(x, rope, fb, kv)
        return self.shared_head.norm.fp32(h).to(dtype)
