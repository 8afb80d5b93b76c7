"""Parallelism on torch.distributed: process groups, EP all-to-all-v, CP gather, local TP linears,
layer sharding. Backend by device (hccl / nccl / gloo) from shared.device."""

from shared.parallel.state import ParallelConfig, ParallelState

__all__ = ["ParallelConfig", "ParallelState"]
