"""DeepSeek MoE: sigmoid + bias group-limited routing, grouped experts, unweighted shared expert.

Routing (spec §7.2): s = sigmoid(x·Wg) in fp32; selection uses s + e_score_correction_bias, limited
to the topk_group groups with the best top-2 sums; the weights are the *unbiased* s of the picked
experts, normalized, × routed_scaling_factor. Experts run grouped: token slots sorted by expert, one
grouped matmul over the stacked weights with device-side offsets (no host read-back).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

import shared.model.int8_kernels as int8_kernels
import shared.model.moe_kernels as moe_kernels
import shared.model.ops as ops
from shared.config import ModelConfig
from shared.device import BUCKETED_GEMM_DTYPES, grouped_mm, host_gemm_rows, host_gemm_sizes, on_host
from shared.model.layers import MLP, LinearFormats, WeightFormat
from shared.model.ops import matmul_input
from shared.parallel.comm import all_to_all_equal, all_to_all_v, exchange_counts, gather_equal
from shared.quant.fp8 import grouped_fp8
from shared.quant.int8 import Int8Linear, grouped_w8a8


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)

    def forward(self, x: torch.Tensor, generated: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [N, k], weights [N, k] fp32). The leading `generated` rows (a step's decodes)
        take the kernel router where it runs (moe_kernels.route: one call instead of a dozen ops, each row's
        scores its own dot products, as the fused one-rank MoE routes them); the other rows are routed here, unless
        ops.every_row() holds for the gate's weight (then every row takes the kernel)."""
        if ops.every_row(self.weight):
            generated = x.shape[0]

        def kernel(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
            return moe_kernels.route(rows, self.weight, self.e_score_correction_bias, self.n_group, self.topk_group,
                                     self.top_k, self.norm_topk_prob, self.scaling)

        return ops.generated_first(x, generated, kernel, lambda rows, _: self._route(rows))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = ops.matmul_rows(x.float(), self.weight.float()).sigmoid()
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
    down_proj [E_local, D, I]; global ids first_expert .. first_expert + E_local - 1.

    Rows run grouped: sorted by expert, then one grouped matmul over the stacked weights with the
    group offsets kept on the device (`shared.device.grouped_mm`). Nothing is read back to the host (no
    `.tolist()` / `.item()`, so an accelerator never stalls on the router) and no expert's weights are
    copied; experts with no rows cost nothing."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype, first_expert: int = 0,
                 num_local: int | None = None, fmt: WeightFormat | None = None):
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.first_expert = first_expert
        self.num_local = num_experts if num_local is None else num_local
        self.fmt = fmt
        kind = fmt.kind if fmt is not None else None
        wdt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(kind, dtype)
        e = self.num_local
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden, dtype=wdt), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inter, dtype=wdt), requires_grad=False)
        if kind == "int8":  # W8A8: per-expert, per-output-channel scales (shared.quant.int8)
            self.gate_up_proj_scale = nn.Parameter(torch.ones(e, 2 * inter), requires_grad=False)
            self.down_proj_scale = nn.Parameter(torch.ones(e, hidden), requires_grad=False)
        elif kind == "fp8":  # block scales; gate and up stack by whole row-blocks
            br, bc = fmt.block
            if inter % br:
                raise ValueError(f"FP8 experts need moe_intermediate_size ({inter}) to be a multiple of the "
                                 f"weight block ({br})")
            self.gate_up_proj_scale_inv = nn.Parameter(torch.ones(e, 2 * inter // br, -(-hidden // bc)),
                                                       requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(torch.ones(e, -(-hidden // br), -(-inter // bc)),
                                                    requires_grad=False)

    def warm_host_gemms(self) -> None:
        """Run this rank's grouped expert matmuls once at each of host_gemm_sizes() (one group), so oneDNN has
        built their primitives before the first prompt (see shared.device.host_gemm_rows). Unquantized only, and
        not for widened bf16 experts (moe_kernels.widened_experts: the kernel takes all their rows)."""
        if (self.fmt is not None or self.gate_up_proj.dtype not in BUCKETED_GEMM_DTYPES
                or moe_kernels.widened_experts(self.gate_up_proj)):
            return
        offsets = torch.zeros(self.num_local, dtype=torch.int32)
        for size in host_gemm_sizes():
            offsets.fill_(size)  # group 0 holds every row
            rows = torch.zeros(size, self.gate_up_proj.shape[-1], dtype=self.gate_up_proj.dtype)
            grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offsets)
            grouped_mm(rows.new_zeros(size, self.inter), self.down_proj.transpose(1, 2), offsets)

    def run(self, rows: torch.Tensor, local_ids: torch.Tensor, padded: bool = False, static: bool = False
            ) -> torch.Tensor:
        """Unweighted expert outputs for rows [M, D] routed to local experts `local_ids` [M]. With
        `padded`, ids outside 0..E_local-1 mark padding slots (EP: picks held by other ranks): their
        output is zero; without, every id must be local (one rank holds every expert). On the host a row alone
        in its expert's group goes in twice (see below): a row's result does not depend on the other rows.
        `static` (a decode step's rows): no count is read back, so a recorded step can take it (see below)."""
        valid = (local_ids >= 0) & (local_ids < self.num_local) if padded else None
        key = local_ids if valid is None else torch.where(valid, local_ids, self.num_local)  # padding sorts last
        counts = torch.zeros(self.num_local + 1, dtype=torch.long, device=rows.device)
        counts.index_add_(0, key, torch.ones_like(key))  # bincount would read the max back on accelerators
        kind = self.fmt.kind if self.fmt is not None else None
        wanted = rows.shape[0]
        if kind is None and on_host(rows) and static and self.gate_up_proj.dtype in BUCKETED_GEMM_DTYPES:
            # every picked expert's group one row more, a zero row (its output dropped; an unpicked expert's
            # extra row sorts past the last group, as padding does, so it computes nothing): no group runs as one
            # row, so every row has the bits the bucketed groups below give it (oneDNN's GEMM rows do not depend
            # on the row count from 2), and the shapes are the step's alone: nothing read back (a decode step is
            # recorded whatever its experts' sizes: shared.model.tape). Its group sizes are not bucketed: oneDNN
            # builds a primitive per new size once (a decode batch's sizes are few)
            picked = counts[: self.num_local] > 0
            extra = torch.where(picked, torch.arange(self.num_local, device=rows.device), self.num_local)
            rows, key = torch.cat([rows, rows.new_zeros(self.num_local, rows.shape[1])]), torch.cat([key, extra])
            valid = None if valid is None else torch.cat([valid, picked])
            counts[: self.num_local] += picked
        elif kind is None and on_host(rows):
            # each group at host_gemm_rows' row count, its first row repeated: oneDNN builds no new primitive
            # per group size, and a group of one row goes in twice (oneDNN's one-row GEMV rounds otherwise than
            # its GEMM at some shapes, DeepSeek's experts), so a token's expert output does not depend on how
            # many others picked the same expert
            dtype = self.gate_up_proj.dtype
            pads = torch.tensor([host_gemm_rows(c, dtype) - c if c else 0 for c in counts[: self.num_local].tolist()])
            if bool(pads.any()):
                starts = (counts[: self.num_local].cumsum(0) - counts[: self.num_local]).clamp(max=key.numel() - 1)
                firsts = key.argsort(stable=True)[starts]  # each group's first row (empty groups: unused)
                extra = firsts.repeat_interleave(pads)
                rows, key = torch.cat([rows, rows[extra]]), torch.cat([key, key[extra]])
                valid = None if valid is None else torch.cat([valid, valid[extra]])
                counts[: self.num_local] += pads
        order = key.argsort(stable=True)
        offsets = counts[: self.num_local].cumsum(0).to(torch.int32)
        if kind == "int8":
            gate_up = grouped_w8a8(rows[order], self.gate_up_proj, self.gate_up_proj_scale, offsets)
            gate, up = gate_up.split(self.inter, -1)
            out = grouped_w8a8(F.silu(gate) * up, self.down_proj, self.down_proj_scale, offsets)
        elif kind == "fp8":
            block, cdt = self.fmt.block, self.fmt.compute
            gate_up = grouped_fp8(rows[order], self.gate_up_proj, self.gate_up_proj_scale_inv, offsets, block, cdt)
            gate, up = gate_up.split(self.inter, -1)
            out = grouped_fp8(F.silu(gate) * up, self.down_proj, self.down_proj_scale_inv, offsets, block, cdt)
        else:
            xs = matmul_input(rows[order], self.gate_up_proj)
            gate, up = grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offsets).split(self.inter, -1)
            out = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offsets)
        if valid is not None:
            out = out.masked_fill(~valid[order, None], 0)  # rows past the last group are undefined
        result = torch.empty_like(out, dtype=rows.dtype)
        result[order] = out.to(rows.dtype)
        return result[:wanted]

    def fused_w8a8(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, padded: bool = False,
                   shared: nn.Module | None = None) -> torch.Tensor | None:
        """W8A8 experts on the host in one kernel call (shared.model.int8_kernels.moe): every expert's rows, no
        per-expert loop, and with `shared` (an MLP of W8A8 linears) the shared expert added; the same sums as
        forward (+ shared) computes, fp32 [N, D]. None where it does not apply (not int8, off the host, a
        TP-sharded shared expert)."""
        if self.fmt is None or self.fmt.kind != "int8":
            return None
        shared_w = None
        if shared is not None:
            linears = (shared.gate_proj, shared.up_proj, shared.down_proj)
            if not all(isinstance(lin, Int8Linear) for lin in linears):
                return None
            shared_w = tuple(t for lin in linears for t in (lin.weight, lin.weight_scale))
        local = ids - self.first_expert if self.first_expert else ids
        return int8_kernels.moe(x, local, weights, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                self.down_proj_scale, x.dtype, padded, shared_w)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, padded: bool = False,
                generated: torch.Tensor | int | None = None) -> torch.Tensor:
        """Weighted sum over each row's k picks [N, k] (global ids; with `padded`, foreign ids and their
        weight-0 picks contribute nothing): fp32 [N, D]. `generated` ([N] bool, or an int: the leading rows) marks
        the rows that are a step's generated tokens: unquantized experts compute them with the CPU kernel's
        arithmetic where it runs (ops.routed_experts), on one rank and on EP ranks alike."""
        fused = self.fused_w8a8(x, ids, weights, padded)
        if fused is not None:
            return fused
        local = ids - self.first_expert if self.first_expert else ids
        static = isinstance(generated, int) and generated == x.shape[0]  # a decode step's rows (may be recorded)
        return ops.routed_experts(x, local, weights, generated if self.fmt is None else None, self.gate_up_proj,
                                  self.down_proj, functools.partial(self._weighted, padded=padded, static=static))

    def _weighted(self, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor, padded: bool,
                  static: bool = False) -> torch.Tensor:
        """The portable weighted sum: every pick through run() (grouped matmuls), then summed in pick order."""
        n, k = local_ids.shape
        out = self.run(x.repeat_interleave(k, 0), local_ids.flatten(), padded, static)  # [N·k, D]
        return (out.view(n, k, x.shape[1]).float() * weights[..., None]).sum(1)


class MoE(nn.Module):
    """Routed + shared experts. With expert parallelism (ep > 1) each rank holds E/ep experts and the
    token slots travel: send counts are exchanged first (all-to-all), then the rows (all-to-all-v,
    uneven splits); the shared expert computes while the dispatch is in flight."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ep: int = 1, ep_rank: int = 0, ep_group=None,
                 fmts: LinearFormats | None = None):
        super().__init__()
        if cfg.n_routed_experts % ep:
            raise ValueError(f"{cfg.n_routed_experts} experts do not split over ep={ep}")
        per_rank = cfg.n_routed_experts // ep
        fmt = (fmts or LinearFormats()).target
        self.ep, self.ep_group, self.per_rank, self.ep_rank = ep, ep_group, per_rank, ep_rank
        # set (fixed_exchange) while a decode step padded to the same size on every EP rank runs: its exchange
        # then has fixed shapes (a recorded step can replay it), not the all-to-all-v's host-read sizes
        self.fixed_exchange = False
        # called with the EP path's step events in order (dispatch_start/issued, shared_start/end,
        # dispatch_wait/done): the overlap of the shared expert with the dispatch is proven by their order
        self.trace: Callable[[str], None] | None = None
        self.gate = Gate(cfg, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype,
                               first_expert=ep_rank * per_rank, num_local=per_rank, fmt=fmt)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, fmt)
            if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        """`generated`: leading rows of x that are the step's generated tokens (shared.model.ops.moe)."""
        return ops.moe(x, generated, self.fused_weights(), self._routed)

    def fused_weights(self) -> ops.MoEWeights | None:
        """The weights as the fused MoE takes them; None where it cannot: experts split over EP ranks, or
        quantized."""
        if self.ep != 1 or self.experts.fmt is not None:
            return None
        g, shared = self.gate, self.shared_experts
        return ops.MoEWeights(g.weight, g.e_score_correction_bias, g.n_group, g.topk_group, g.top_k, g.norm_topk_prob,
                              g.scaling, self.experts.gate_up_proj, self.experts.down_proj,
                              (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
                              if shared is not None else None)

    def _routed(self, x: torch.Tensor, generated: int) -> torch.Tensor:
        """The portable MoE: router, grouped experts (over EP ranks with ep > 1), shared expert."""
        ids, weights = self.gate(x, generated)
        if self.ep == 1:
            fused = self.experts.fused_w8a8(x, ids, weights, shared=self.shared_experts)
            if fused is not None:
                return fused.to(x.dtype)
            y = self.experts(x, ids, weights, generated=generated or None)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x, generated).float()
            return y.to(x.dtype)
        if self.fixed_exchange:
            return self._forward_ep_fixed(x, ids, weights, generated)
        return self._forward_ep(x, ids, weights, generated)

    def _forward_ep_fixed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, generated: int
                          ) -> torch.Tensor:
        """EP for a decode step of N generated rows on every rank: every rank gathers all ranks' rows with their
        picks, computes its experts' weighted partial sum of each (foreign picks masked), and sends each rank
        its rows' partials back; each row adds them in rank order, as the all-to-all-v path's index_add does
        (a rank holding none of a row's picks returns zeros, which add nothing): the same bits, fixed shapes."""
        n, k = ids.shape
        if generated != n:
            raise ValueError(f"the fixed EP exchange takes generated rows only ({generated} of {n})")
        rows = gather_equal(x, self.ep_group)  # [ep·N, D]
        picks = gather_equal(torch.cat([ids.float(), weights], 1), self.ep_group)  # ids: exact in fp32
        got_ids = picks[:, :k].long()
        mine = got_ids // self.per_rank == self.ep_rank
        shared = self.shared_experts(x, generated).float() if self.shared_experts is not None else None
        partial = self.experts(rows, torch.where(mine, got_ids, -1), torch.where(mine, picks[:, k:], 0.0),
                               padded=True, generated=rows.shape[0])
        back = all_to_all_equal(partial, self.ep_group).view(self.ep, n, x.shape[1])
        y = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        for part in back:
            y += part
        if shared is not None:
            y = y + shared
        return y.to(x.dtype)

    def _forward_ep(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, generated: int) -> torch.Tensor:
        """Each token travels once to every EP rank holding at least one of its experts, with its k
        ids and weights (picks on other ranks masked); that rank returns one weighted partial sum per
        token, so dispatch and combine move rows per (token, rank), not per (token, expert)."""
        n, k = ids.shape
        dest_of_pick = ids // self.per_rank  # [N, k]
        ranks = torch.arange(self.ep, device=x.device)
        needs = (dest_of_pick[:, None, :] == ranks[None, :, None]).any(-1)  # [N, ep]
        pair_rank, pair_token = needs.t().nonzero(as_tuple=True)  # (rank, token) pairs, rank-major
        mine = dest_of_pick[pair_token] == pair_rank[:, None]  # [P, k] picks that live on that rank
        pair_ids = torch.where(mine, ids[pair_token], -1)
        pair_w = torch.where(mine, weights[pair_token], 0.0)
        send = needs.sum(0)
        recv = exchange_counts(send, self.ep_group)
        # all_to_all_v takes split sizes on the host: the one read-back of the EP path
        send_l, recv_l = send.tolist(), recv.tolist()
        trace = self.trace or _untraced
        trace("dispatch_start")
        rows, work_rows = all_to_all_v(x[pair_token], send_l, recv_l, self.ep_group, async_op=True)
        # ids are small integers, exact in fp32; the last column says whether the row is a generated token
        meta = torch.cat([pair_ids.float(), pair_w, (pair_token < generated).float()[:, None]], 1)
        got_meta, work_meta = all_to_all_v(meta, send_l, recv_l, self.ep_group, async_op=True)
        trace("dispatch_issued")
        trace("shared_start")
        # the shared expert computes while the dispatch is in flight
        shared = self.shared_experts(x, generated).float() if self.shared_experts is not None else None
        trace("shared_end")
        trace("dispatch_wait")
        work_rows.wait()
        work_meta.wait()
        trace("dispatch_done")
        got_ids, got_w, got_generated = got_meta[:, :k].long(), got_meta[:, k:2 * k], got_meta[:, 2 * k] > 0.5
        # [received, D] fp32, foreign picks masked
        partial = self.experts(rows, got_ids, got_w, padded=True, generated=got_generated)
        back, _ = all_to_all_v(partial, recv_l, send_l, self.ep_group)  # combine: partial sums return
        y = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        y.index_add_(0, pair_token, back)
        if shared is not None:
            y = y + shared
        return y.to(x.dtype)


def _untraced(event: str) -> None:
    """MoE.trace when nobody listens."""


def ep_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers whose experts are split over EP ranks (the ones with an exchange)."""
    return [m for m in model.modules() if isinstance(m, MoE) and m.ep > 1]


@contextmanager
def fixed_exchange(layers: list[MoE]) -> Iterator[None]:
    """Inside: these EP layers (ep_layers) take the fixed-shape exchange (MoE._forward_ep_fixed); every EP rank
    must run the step padded to the same rows."""
    for m in layers:
        m.fixed_exchange = True
    try:
        yield
    finally:
        for m in layers:
            m.fixed_exchange = False
