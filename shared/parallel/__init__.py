"""Parallelism on torch.distributed: process groups, collectives (EP all-to-all-v, CP gather), layer
sharding, rank launch. Backend by device (hccl / nccl / gloo) from shared.device. The layers built on
them (TP linears, CP batches) are model code: shared.model.tensor_parallel, shared.model.cp."""

from shared.parallel.state import ParallelConfig, ParallelState

__all__ = ["ParallelConfig", "ParallelState"]
