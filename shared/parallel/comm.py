"""Collectives the model uses: EP all-to-all-v with send-count pre-exchange (or, for padded decode steps, the
fixed-shape gather and all-to-all), CP gather, TP reduce."""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """all-to-all of per-rank send counts: afterwards each rank knows how many rows it receives."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


def all_to_all_v(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group,
                 async_op: bool = False):
    """Rows of x split by send_counts go to each rank; returns (received rows, work handle or None)."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group, async_op=async_op)
    return out, work


def gather_varlen(rows: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather rows of unequal counts per rank (padded to the largest), concatenated in rank order."""
    width = max(sizes)
    padded = rows.new_zeros((width, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], 0)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def gather_equal(rows: torch.Tensor, group) -> torch.Tensor:
    """All-gather of equally many rows from every rank, concatenated in rank order: shapes known without an
    exchange (a recorded step can replay it)."""
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, rows.contiguous(), group=group)
    return torch.cat(parts, 0)


def all_to_all_equal(rows: torch.Tensor, group) -> torch.Tensor:
    """The i-th of the world's equal row blocks goes to rank i; block i of the result came from rank i."""
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows.contiguous(), group=group)
    return out
