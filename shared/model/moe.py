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
    """The routed experts this rank holds, stacked: gate_up_proj [E_local, 2I, D] (gate first),
    down_proj [E_local, D, I]; global ids first_expert .. first_expert + E_local - 1."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, first_expert: int = 0,
                 num_local: int | None = None):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.first_expert = first_expert
        self.num_local = num_experts if num_local is None else num_local
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=dtype), requires_grad=False)

    def run(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs for rows [M, D] routed to local experts `local_ids` [M]:
        rows sorted by expert, zero-token experts skipped. When the active experts get similar row
        counts (decode batches) they run as one padded batched matmul; otherwise one matmul each."""
        order = local_ids.argsort(stable=True)
        counts_t = torch.bincount(local_ids, minlength=self.num_local)
        counts = counts_t.tolist()
        active = [e for e, c in enumerate(counts) if c]
        xs = rows[order]
        if active and max(counts) * len(active) <= 2 * rows.shape[0]:
            out = self._run_padded(xs, local_ids[order], counts_t, active, max(counts))
        else:
            out = torch.empty_like(xs)
            start = 0
            for expert in active:
                seg = xs[start : start + counts[expert]]
                gate, up = F.linear(seg, self.gate_up_proj[expert]).split(self.inter, -1)
                out[start : start + counts[expert]] = F.linear(F.silu(gate) * up, self.down_proj[expert])
                start += counts[expert]
        result = torch.empty_like(out)
        result[order] = out
        return result

    def _run_padded(self, xs: torch.Tensor, sorted_ids: torch.Tensor, counts: torch.Tensor, active: list[int],
                    width: int) -> torch.Tensor:
        """Sorted rows → [active experts, width, D] (zero padded) → two bmm's → back to sorted rows."""
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.full((self.num_local,), -1, dtype=torch.long, device=xs.device)
        slot[active] = torch.arange(len(active), device=xs.device)
        row_slot = slot[sorted_ids]
        row_pos = torch.arange(xs.shape[0], device=xs.device) - starts[sorted_ids]
        buf = xs.new_zeros(len(active), width, xs.shape[1])
        buf[row_slot, row_pos] = xs
        every = len(active) == self.num_local  # no weight copy when every expert has rows
        w_gu = self.gate_up_proj if every else self.gate_up_proj[active]
        w_down = self.down_proj if every else self.down_proj[active]
        gate, up = torch.bmm(buf, w_gu.transpose(1, 2)).split(self.inter, -1)
        out = torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2))
        return out[row_slot, row_pos]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """All experts local: fp32 weighted sum [N, D]."""
        k = ids.shape[1]
        token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
        out = self.run(x[token_of], ids.flatten() - self.first_expert)
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        y.index_add_(0, token_of, out.float() * weights.flatten()[:, None])
        return y


class MoE(nn.Module):
    """Routed + shared experts. With expert parallelism (ep > 1) each rank holds E/ep experts and the
    token slots travel: send counts are exchanged first (all-to-all), then the rows (all-to-all-v,
    uneven splits); the shared expert computes while the dispatch is in flight."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ep: int = 1, ep_rank: int = 0, ep_group=None):  # noqa: ANN001
        super().__init__()
        if cfg.n_routed_experts % ep:
            raise ValueError(f"{cfg.n_routed_experts} experts do not split over ep={ep}")
        per_rank = cfg.n_routed_experts // ep
        self.ep, self.ep_group, self.per_rank = ep, ep_group, per_rank
        self.gate = Gate(cfg, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype,
                               first_expert=ep_rank * per_rank, num_local=per_rank)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
            if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        if self.ep == 1:
            y = self.experts(x, ids, weights)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x).float()
            return y.to(x.dtype)
        return self._forward_ep(x, ids, weights)

    def _forward_ep(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from shared.parallel.comm import all_to_all_v, exchange_counts

        k = ids.shape[1]
        flat = ids.flatten()
        dest = flat // self.per_rank
        order = dest.argsort(stable=True)
        token_of = order // k
        send = torch.bincount(dest, minlength=self.ep)
        recv = exchange_counts(send, self.ep_group)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows, work_rows = all_to_all_v(x[token_of], send_l, recv_l, self.ep_group, async_op=True)
        local_ids, work_ids = all_to_all_v((flat[order] % self.per_rank), send_l, recv_l, self.ep_group,
                                           async_op=True)
        shared = self.shared_experts(x).float() if self.shared_experts is not None else None  # overlaps dispatch
        work_rows.wait()
        work_ids.wait()
        out = self.experts.run(rows, local_ids)
        back, _ = all_to_all_v(out, recv_l, send_l, self.ep_group)  # combine: rows return to their owners
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        y.index_add_(0, token_of, back.float() * weights.flatten()[order, None])
        if shared is not None:
            y = y + shared
        return y.to(x.dtype)
