"""Local tensor parallelism for o_proj, lm_head and the embedding (ranks see the same tokens).

* AllToShardedLinear: input replicated, weight split on outputs → each rank holds an output shard.
* ShardedToAllLinear: input split on features (sliced locally when it arrives replicated), weight
  split on inputs, partial products all-reduced → every rank holds the full output.
  all-to-sharded followed by sharded-to-all needs no gather in between (the shard is the input).
* VocabParallelEmbedding: each rank holds a vocab slice; lookups outside it are zero; all-reduce.
`shard_linear()` converts a loaded nn.Linear in place of the module. The sharded linears are called like
the model's others, `layer(x, generated)` (shared.model.layers), and multiply their shards as they do (ops.linear:
the CPU kernels for the step's generated rows, every row where ops.every_row holds), so a row's bits do not
depend on its batch here either (torch's fp32 GEMM rounded a TP rank's rows by the batch's size: a request's
logprobs moved by an ulp beside others).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shared.device import int8_matmul
from shared.model.ops import linear
from shared.parallel.comm import all_reduce_sum
from shared.quant.int8 import Int8Linear, quantize_activation


def _span(total: int, parts: int, index: int) -> tuple[int, int]:
    if total % parts:
        raise ValueError(f"{total} does not split into {parts} equal shards")
    size = total // parts
    return index * size, (index + 1) * size


class AllToShardedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, tp: int, rank: int, group, gather_output: bool = False):
        super().__init__()
        lo, hi = _span(weight.shape[0], tp, rank)
        self.weight = nn.Parameter(weight[lo:hi].clone(), requires_grad=False)
        self.tp, self.group, self.gather_output = tp, group, gather_output

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        y = linear(x, self.weight, generated)
        if not self.gather_output:
            return y
        parts = [torch.empty_like(y) for _ in range(self.tp)]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, -1)


class ShardedToAllLinear(nn.Module):
    """With `weight_scale` (W8A8 int8 weight, per-output-channel scales) each rank quantizes its own input
    slice per token and the dequantized partial products are summed."""

    def __init__(self, weight: torch.Tensor, tp: int, rank: int, group,
                 weight_scale: torch.Tensor | None = None):
        super().__init__()
        self.lo, self.hi = _span(weight.shape[1], tp, rank)
        self.in_features = weight.shape[1]
        self.weight = nn.Parameter(weight[:, self.lo : self.hi].clone(), requires_grad=False)
        self.weight_scale = None if weight_scale is None else nn.Parameter(weight_scale.clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        if self.weight_scale is not None:
            return all_reduce_sum(self._w8a8(x), self.group)
        if x.shape[-1] == self.in_features:  # replicated input: take our slice, no communication
            x = x[..., self.lo : self.hi]
        return all_reduce_sum(linear(x, self.weight, generated), self.group)


    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated input is quantized whole (the token scales one rank would use), then sliced: the
        shards' integer products add up to one rank's."""
        shape = x.shape
        xq, sx = quantize_activation(x.reshape(-1, shape[-1]))
        if shape[-1] == self.in_features:
            xq = xq[:, self.lo : self.hi].contiguous()
        y = int8_matmul(xq, sx, self.weight, self.weight_scale)
        return y.to(x.dtype).view(*shape[:-1], self.weight.shape[0])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, tp: int, rank: int, group):
        super().__init__()
        self.lo, self.hi = _span(weight.shape[0], tp, rank)
        self.weight = nn.Parameter(weight[self.lo : self.hi].clone(), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = (ids >= self.lo) & (ids < self.hi)
        out = F.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        return all_reduce_sum(out * local.unsqueeze(-1).to(out.dtype), self.group)


def shard_linear(linear: nn.Module, style: str, tp: int, rank: int, group,
                 gather_output: bool = False) -> nn.Module:
    """A loaded linear → its TP shard. style: 'all_to_sharded' | 'sharded_to_all'."""
    if style == "all_to_sharded":
        if isinstance(linear, Int8Linear):
            raise ValueError("all_to_sharded shards lm_head / embeddings, which W8A8 never quantizes")
        return AllToShardedLinear(linear.weight.data, tp, rank, group, gather_output)
    if style == "sharded_to_all":
        scale = linear.weight_scale.data if isinstance(linear, Int8Linear) else None
        return ShardedToAllLinear(linear.weight.data, tp, rank, group, scale)
    raise ValueError(f"unknown shard style {style!r}")
