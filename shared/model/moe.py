"""DeepSeek MoE: sigmoid + bias group-limited routing, grouped experts, unweighted shared expert.

Routing (spec §7.2): s = sigmoid(x·Wg) in fp32; selection uses s + e_score_correction_bias, limited
to the topk_group groups with the best top-2 sums; the weights are the *unbiased* s of the picked
experts, normalized, × routed_scaling_factor. Experts run grouped: token slots sorted by expert, one
matmul per active expert, experts with no tokens skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.config import ModelConfig
from shared.model.layers import MLP


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [N, k], weights [N, k] fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        n, e = biased.shape
        if self.n_group > 1:
            groups = biased.view(n, self.n_group, e // self.n_group)
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            biased = biased.masked_fill(~group_mask.repeat_interleave(e // self.n_group, 1), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Experts(nn.Module):
    """All routed experts' weights stacked: gate_up_proj [E, 2I, D] (gate first), down_proj [E, D, I]."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        xs = x[token_of]
        out = torch.empty(xs.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            seg = xs[start : start + count]
            gate, up = F.linear(seg, self.gate_up_proj[expert]).split(self.inter, -1)
            out[start : start + count] = F.linear(F.silu(gate) * up, self.down_proj[expert])
            start += count
        y = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        y.index_add_(0, token_of, out.float() * weights.flatten()[order, None])
        return y


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(cfg, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
            if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        y = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)
