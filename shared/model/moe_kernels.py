"""The MoE's CPU kernels (built with cpu_kernels, one library): DeepSeek's router, the routed experts and the
shared expert in one call (moe_routed), the routed experts alone for picks made elsewhere (moe_experts: a bf16
model's, an EP rank's), the router alone (route). Each says None / False where it does not apply, and the
caller keeps its portable torch path."""

from __future__ import annotations

import torch

from shared.device import compute_dtype
from shared.model.cpu_kernels import BF16_FLAG, library, runnable

MOE_SCRATCH_BYTES = 256 << 20  # the fused MoE's scratch per call: rows past it run in further calls
# Largest bf16 expert (hidden × moe_intermediate) moe_experts takes: its fp32 arithmetic (~50 GFLOP/s a core)
# beats oneDNN's bf16 grouped GEMMs (~200 with AVX512-BF16) only while per-call costs dominate. Measured one
# thread, 8 experts top-2, kernel / portable time: 256 × 128 0.14 / 0.29 / 0.91 at 1 / 16 / 64 rows; 512 × 256
# 0.34 / 0.76 / 1.45; 1024 × 512 0.43 / 1.04 / 2.05; DeepSeek's 7168 × 2048 0.79 / 1.84 / 2.44 (4 experts).
BF16_EXPERT_MAX = 512 * 128


def chunk_rows(dim: int, inter: int, top_k: int) -> int:
    """Rows per kernel call: as many as MOE_SCRATCH_BYTES holds (each pick's input, gate / up, activation and
    output rows in fp32), at least one. Rows are independent, so a chunk bounds only the scratch; but every call
    reads each picked expert's weights once, so a batch cut in more calls reads them again (at DeepSeek's shapes
    the experts' reads, not their arithmetic, bound a decode step: 64-row chunks made a 256-row step 3x slower on
    a 20 GB/s machine; a 2,048-token prefill of the hidden-2048 proxy took 1.06 s in 64 MiB calls, 0.76 s in one)."""
    return max(1, MOE_SCRATCH_BYTES // (4 * top_k * (2 * dim + 3 * inter)))


def moe_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the fused MoE can take these rows: host rows in bf16/fp32 and contiguous fp32 weights. A bf16
    model's bf16 weights (kept so on CPUs with bf16 arithmetic) take moe_experts instead, with the router and
    the shared expert portable, as every EP rank does: a decode then has the same arithmetic in every instance
    shape (a one-rank kernel that fused the router and the shared expert rounded them otherwise)."""
    return (x.dtype in (torch.bfloat16, torch.float32)
            and all(w.dtype == torch.float32 and w.is_contiguous() for w in weights) and runnable(x, *weights))


def _router_fits(gate_weight: torch.Tensor, bias: torch.Tensor, dim: int, top_k: int, n_group: int,
                 topk_group: int) -> bool:
    """Whether a router's weights and settings are ones the kernel's `route` takes (experts in whole groups of
    at least two, top_k within them)."""
    experts = gate_weight.shape[0] if gate_weight.dim() == 2 else 0
    return (gate_weight.shape == (experts, dim) and bias.shape == (experts,) and 0 < top_k <= experts
            and not (n_group > 1 and (experts % n_group or experts // n_group < 2 or not 0 < topk_group <= n_group)))


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
          norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek's router (moe.Gate) for rows x [N, D] in one call, as moe_routed routes: (expert ids [N, top_k],
    weights [N, top_k] fp32). Each row's scores are its own dot products with the gate weight (bf16 or fp32,
    read in place), so a token is routed alike whatever rows share its step and whatever MoE shape follows
    (one rank, EP). None where the kernels do not take these tensors."""
    n, dim = x.shape
    if (x.dtype not in BF16_FLAG or gate_weight.dtype not in BF16_FLAG or not gate_weight.is_contiguous()
            or not runnable(x, gate_weight, bias)):
        return None
    if not _router_fits(gate_weight, bias, dim, top_k, n_group, topk_group):
        raise ValueError(f"route: x {tuple(x.shape)}, gate {tuple(gate_weight.shape)}, bias {tuple(bias.shape)}, "
                         f"top_k {top_k}, groups {n_group}/{topk_group}")
    rows = x.float().contiguous()
    bias = bias.float().contiguous()
    ids = torch.empty(n, top_k, dtype=torch.int64)
    weights = torch.empty(n, top_k, dtype=torch.float32)
    library().moe_route(rows.data_ptr(), n, dim, gate_weight.data_ptr(), BF16_FLAG[gate_weight.dtype],
                        bias.data_ptr(), gate_weight.shape[0], n_group, topk_group, top_k, int(norm_topk_prob),
                        scaling, ids.data_ptr(), weights.data_ptr(), torch.get_num_threads())
    return ids, weights


def moe_routed(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
               top_k: int, norm_topk_prob: bool, scaling: float, gate_up: torch.Tensor, down: torch.Tensor,
               shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's MoE for rows x [N, D] in one call: the router (sigmoid, bias, group-limited top-k,
    normalized unbiased weights × scaling), the picked experts gate_up [E, 2I, D] / down [E, D, I] (each
    expert's output rounded to x's dtype before the weighted sum, as moe.Experts does) and, given as
    (gate [Is, D], up [Is, D], down [D, Is]), the shared expert with layers.MLP's roundings. Returns
    (fp32 [N, D], picked expert ids [N, top_k]). Call only where moe_usable() holds for x and every weight."""
    n, dim = x.shape
    experts, two_inter, _ = gate_up.shape
    shared_inter = shared[0].shape[0] if shared is not None else 0
    if (not _router_fits(gate_weight, bias, dim, top_k, n_group, topk_group) or gate_weight.shape[0] != experts
            or down.shape != (experts, dim, two_inter // 2)
            or (shared is not None and [tuple(w.shape) for w in shared]
                != [(shared_inter, dim), (shared_inter, dim), (dim, shared_inter)])):
        raise ValueError(f"moe_routed: x {tuple(x.shape)}, gate {tuple(gate_weight.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}, top_k {top_k}, "
                         f"groups {n_group}/{topk_group}, shared {[tuple(w.shape) for w in shared or ()]}")
    rows = x.float().contiguous()
    bias = bias.float().contiguous()
    y = torch.empty(n, dim, dtype=torch.float32)
    ids = torch.empty(n, top_k, dtype=torch.int64)
    sg, su, sd = (w.data_ptr() for w in shared) if shared is not None else (None, None, None)
    chunk = chunk_rows(dim, two_inter // 2, top_k)
    for r0 in range(0, n, chunk):  # rows are independent: chunks only bound the scratch
        m = min(chunk, n - r0)
        library().moe_routed(rows[r0].data_ptr(), m, dim, gate_weight.data_ptr(), bias.data_ptr(), experts, n_group,
                             topk_group, top_k, int(norm_topk_prob), scaling, gate_up.data_ptr(), down.data_ptr(),
                             two_inter // 2, int(x.dtype == torch.bfloat16), sg, su, sd, shared_inter,
                             y[r0].data_ptr(), ids[r0].data_ptr(), torch.get_num_threads())
    return y, ids


def widened_experts(weight: torch.Tensor) -> bool:
    """bf16 experts on a CPU without bf16 arithmetic (shared.device.compute_dtype says fp32): kept bf16 in memory
    (Model.store_for_compute leaves them so where the kernels run) and widened in registers by moe_experts, which
    takes every row of them, prompt rows too: half the bytes of fp32 copies, and a decode step's experts are
    bound by reading them (oneDNN would emulate bf16 products, ~5x slower than its fp32 GEMMs)."""
    return (weight.dtype == torch.bfloat16 and compute_dtype(weight.dtype, weight.device) == torch.float32
            and runnable(weight))


def experts_usable(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether moe_experts takes these rows: host rows in bf16/fp32 and contiguous expert weights, both fp32
    or both bf16 (a bf16 model's own, widened in registers: its fp32 copies' products), bf16 ones no larger
    than BF16_EXPERT_MAX (hidden × moe_intermediate) where the CPU multiplies bf16 (widened_experts: any size
    elsewhere). A property of the model, not of the step: every step's generated rows (and every EP rank's)
    take the same path."""
    return (x.dtype in BF16_FLAG and gate_up.dtype == down.dtype and gate_up.dtype in BF16_FLAG
            and (gate_up.dtype != torch.bfloat16 or down.shape[1] * down.shape[2] <= BF16_EXPERT_MAX
                 or widened_experts(gate_up))
            and gate_up.is_contiguous() and down.is_contiguous() and runnable(x, gate_up, down))


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """The routed experts for picks a router made: y[i] = sum_j weights[i, j] · round(expert_ids[i, j](x[i]))
    in j's order (each expert's output rounded to x's dtype, as moe.Experts does), skipping ids outside
    0..E-1 (an EP rank's picks held by other ranks). x [N, D]; ids [N, k] local to gate_up [E, 2I, D] /
    down [E, D, I]; weights [N, k]. fp32 [N, D]. A row's sum depends on that row and its picks only (not on
    the rows beside it), so a token's experts give the same bits on one rank as over EP ranks' partial sums
    (up to the order those partials are added). Call only where experts_usable() holds."""
    n, dim = x.shape
    experts, two_inter, _ = gate_up.shape
    if (ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != n or gate_up.shape[2] != dim
            or down.shape != (experts, dim, two_inter // 2) or two_inter % 2):
        raise ValueError(f"moe_experts: x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    rows = x.float().contiguous()
    picks = ids.to(torch.int64).contiguous()
    wts = weights.float().contiguous()
    y = torch.empty(n, dim, dtype=torch.float32)
    chunk = chunk_rows(dim, two_inter // 2, ids.shape[1])
    for r0 in range(0, n, chunk):  # rows are independent: chunks only bound the scratch
        m = min(chunk, n - r0)
        library().moe_experts(rows[r0].data_ptr(), m, dim, picks[r0].data_ptr(), wts[r0].data_ptr(), ids.shape[1],
                              experts, gate_up.data_ptr(), down.data_ptr(), two_inter // 2,
                              BF16_FLAG[gate_up.dtype], int(x.dtype == torch.bfloat16), y[r0].data_ptr(),
                              torch.get_num_threads())
    return y
