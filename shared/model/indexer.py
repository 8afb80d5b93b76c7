"""Lightning indexer (DSA): picks, per query, the top-k cached tokens MLA attends to.

Score I[s, t] = Σ_h w[s, h] · ReLU(q[s, h] · k[t] · d^-0.5), w = weights_proj(x) · H^-0.5 (fp32).
The new tokens' keys are written to the cache before scoring; the causal mask is applied before
top-k; top-k = min(index_topk, context). While every request's context fits in index_topk the
scoring is skipped (all causal keys are selected) but the keys are still cached for later steps.

`numerics="deepseek"` reproduces DeepSeek's own kernels (Hadamard rotation, then FP8 e4m3 fake
quantization with power-of-two scales of q and k); the default matches transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.config import ModelConfig
from shared.model.batch import ForwardBatch, gather_context, write_rows
from shared.model.layers import linear
from shared.model.rope import RopeAngles, rope_neox
from shared.quant.fp8 import fake_quant_ue8m0, hadamard_transform

QUERY_TILE = 256  # prefill scores are computed this many queries at a time to bound memory


@dataclass
class Selection:
    """Keys a query may attend to. Decode: `indices`/`valid` [R, k]. Prefill: `mask` [R, S, T]."""

    indices: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, numerics: str = "transformers"):
        super().__init__()
        if numerics not in ("transformers", "deepseek"):
            raise ValueError(f"indexer numerics must be 'transformers' or 'deepseek', got {numerics!r}")
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.numerics = numerics
        self.wq_b = linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.wk = linear(cfg.hidden_size, self.head_dim, dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = linear(cfg.hidden_size, self.n_heads, torch.float32)  # fp32 (spec [UPD] 2)
        self.scale = self.head_dim**-0.5

    def _rope(self, x: torch.Tensor, rope: RopeAngles) -> torch.Tensor:
        return torch.cat([rope_neox(x[..., : self.rope_dim], rope), x[..., self.rope_dim :]], -1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rope: RopeAngles, fb: ForwardBatch,
                index_pool: torch.Tensor) -> Selection | None:
        n = x.shape[0]
        k = self._rope(self.k_norm(self.wk(x)), rope)
        if self.numerics == "deepseek":
            k = fake_quant_ue8m0(hadamard_transform(k), min(128, self.head_dim))
        write_rows(index_pool, fb, k)
        if fb.max_context <= self.topk:
            return None  # every causal key is selected: dense MLA

        q = self._rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), rope)
        if self.numerics == "deepseek":
            q = fake_quant_ue8m0(hadamard_transform(q), min(128, self.head_dim))
        w = self.weights_proj(x.float()) * self.n_heads**-0.5  # [N, H]
        # q·k runs in the cache dtype with fp32 accumulation (exact in an fp32 model; in bf16 finer
        # than DeepSeek's own FP8 scoring) and only the small [.., H, T] scores are widened.
        keys = gather_context(index_pool, fb)  # [R, T, D]
        q = q.to(keys.dtype)
        k_sel = min(self.topk, fb.max_context)

        if fb.is_decode:
            scores = torch.relu(torch.bmm(q, keys.transpose(1, 2)).float() * self.scale)  # [R, H, T]
            index = torch.bmm(w.unsqueeze(1), scores).squeeze(1)  # [R, T]
            index = index.masked_fill(~fb.key_valid, float("-inf"))
            picks = index.topk(k_sel, dim=-1).indices
            return Selection(indices=picks, valid=fb.key_valid.gather(1, picks))

        qp, wp = fb.padded(q), fb.padded(w)  # [R, S, H, D], [R, S, H]
        mask = torch.zeros_like(fb.causal)
        for s0 in range(0, qp.shape[1], QUERY_TILE):
            s1 = s0 + QUERY_TILE
            scores = torch.relu(torch.einsum("rshd,rtd->rsht", qp[:, s0:s1], keys).float() * self.scale)
            index = torch.einsum("rsh,rsht->rst", wp[:, s0:s1], scores)
            index = index.masked_fill(~fb.causal[:, s0:s1], float("-inf"))
            picks = index.topk(k_sel, dim=-1).indices
            mask[:, s0:s1].scatter_(-1, picks, True)
        return Selection(mask=mask & fb.causal)
