"""Lightning indexer (DSA): picks, per query, the top-k cached tokens MLA attends to.

Score I[s, t] = Σ_h w[s, h] · ReLU(q[s, h] · k[t] · d^-0.5), w = weights_proj(x) · H^-0.5 (fp32).
The new tokens' keys are written to the cache before scoring; the causal mask is applied before
top-k; top-k = min(index_topk, context). While every request's context fits in index_topk the
scoring is skipped (all causal keys are selected) but the keys are still cached for later steps.

`numerics="deepseek"` (the default) reproduces DeepSeek's own kernels: Hadamard rotation, then
FP8 e4m3 quantization of q and k with power-of-two (ue8m0) scales, scores accumulated in fp32 —
the numerics the released checkpoints were trained and evaluated with. `"transformers"` skips the
rotation and quantization as transformers' port does (used to compare with it). Scoring is tiled
(shared.model.attention.indexer_topk): memory stays bounded at any context length. On a CPU, shared.model.ops
scores with a kernel that reads the cached keys (bf16, or C8's FP8 bytes) in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import shared.model.ops as ops
from shared.config import EngineConfig, ModelConfig, knob_choices, knob_default
from shared.device import compute_dtype
from shared.kvcache.layout import RowCodec
from shared.model.batch import ForwardBatch
from shared.model.layers import LinearFormats, linear
from shared.model.rope import RopeAngles

NUMERICS = knob_choices(EngineConfig, "indexer_numerics")  # declared on EngineConfig
DEFAULT_NUMERICS = knob_default(EngineConfig, "indexer_numerics")


@dataclass
class Selection:
    """The context positions each new token (flat, [N, k]) may attend to; `valid` marks real picks."""

    picks: torch.Tensor
    valid: torch.Tensor


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, numerics: str = DEFAULT_NUMERICS,
                 fmts: LinearFormats | None = None):
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"indexer_numerics must be one of {NUMERICS}, got {numerics!r}")
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.numerics = numerics
        fmts = fmts or LinearFormats()
        self.wq_b = linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, fmts.target)
        self.wk = linear(cfg.hidden_size, self.head_dim, dtype, fmts.other)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = linear(cfg.hidden_size, self.n_heads, torch.float32)  # fp32 (spec [UPD] 2)
        self.scale = self.head_dim**-0.5

    def _rows(self, x: torch.Tensor, rope: RopeAngles) -> torch.Tensor:
        """Queries or keys rotated (NeoX rope on the first rope_dim values); with DeepSeek's numerics then
        Hadamard-rotated and FP8 e4m3-rounded with one power-of-two scale per 128 dims."""
        block = min(128, self.head_dim) if self.numerics == "deepseek" else None
        return ops.index_rows(x, rope.neox_cos, rope.neox_sin, block)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rope: RopeAngles, fb: ForwardBatch,
                index_pool: torch.Tensor, codec: RowCodec | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Write the new tokens' keys; return the step's indexer queries and head weights ([N, H, D],
        [N, H] fp32) for select(), or None when no request's context exceeds index_topk."""
        n, g = x.shape[0], fb.generated  # g: the leading rows that are generated tokens (shared.model.ops)
        k = self._rows(self.k_norm(self.wk(x, g)), rope)
        ops.write_index_keys(k, index_pool, fb, codec)
        if fb.max_context <= self.topk:
            return None  # every causal key is selected: dense MLA
        q = self._rows(self.wq_b(qr, g).view(n, self.n_heads, self.head_dim), rope)
        w = self.weights_proj(x.float(), g) * self.n_heads**-0.5  # [N, H]
        return q, w

    def select(self, q: torch.Tensor, w: torch.Tensor, fb: ForwardBatch, index_pool: torch.Tensor,
               codec: RowCodec | None = None) -> Selection | None:
        """Top-k positions for the queries of one attention part (None: its contexts fit index_topk)."""
        if fb.max_context <= self.topk:
            return None
        # DeepSeek scores FP8 q·k with fp32 accumulation and fp32 per-head logits: exact here in fp32
        # (the fake-quantized values are exact in the cache dtype). "transformers" scores in the cache dtype.
        stored = index_pool.dtype if codec is None else q.dtype
        compute = torch.float32 if self.numerics == "deepseek" else compute_dtype(stored, q.device)
        picks, valid = ops.indexer_topk(q, w, fb, index_pool, min(self.topk, fb.max_context), self.scale, compute,
                                        codec)
        return Selection(*_whole_contexts_in_order(picks, valid, fb.positions))


def _whole_contexts_in_order(picks: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks [n, k] with each query whose whole context is picked (position < k: context ≤ index_topk, in a step
    part that goes sparse because another request's context is longer) taking positions 0..k-1 in context order,
    the first position + 1 valid: the rows the top-k picked, in the order dense attention reads them, so its
    output does not depend on which requests share its step (generated rows bit for bit, through the fused
    kernel). Longer contexts keep the top-k's order. No value is read on the host (a recorded step can take it)."""
    order = torch.arange(picks.shape[1], device=picks.device)
    whole = (positions < picks.shape[1])[:, None]
    return torch.where(whole, order, picks), torch.where(whole, order <= positions[:, None], valid)
