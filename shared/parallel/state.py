"""Typed parallel configuration and the process groups built from it.

One instance (a prefill CP group or a decode DP group) is `world` ranks. Groups are contiguous rank
blocks: cp and dp span the instance; tp and ep split it into blocks of their size. TP ranks see the
same tokens (local TP of o_proj / lm_head / embedding); CP and DP ranks see different tokens, so
they combine with EP (all-to-all-v) but not with TP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.config import ParallelConfig
from shared.device import dist_backend


@dataclass
class ParallelState:
    """This rank's view: its rank and the groups it belongs to (None = size 1, no collective)."""

    config: ParallelConfig = field(default_factory=ParallelConfig)
    rank: int = 0
    world_group: object | None = None
    tp_group: object | None = None
    ep_group: object | None = None

    @property
    def world(self) -> int:
        return self.config.world

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.config.ep

    @property
    def is_parallel(self) -> bool:
        return self.config.world > 1

    @classmethod
    def single(cls) -> ParallelState:
        return cls()

    @classmethod
    def initialize(cls, config: ParallelConfig, rank: int, device: torch.device, init_method: str | None = None,
                   timeout_s: float = 300.0) -> ParallelState:
        """Join the instance's process group (env:// by default: MASTER_ADDR/PORT) and build subgroups."""
        if config.world == 1:
            return cls(config)
        if not dist.is_initialized():
            dist.init_process_group(dist_backend(device), init_method=init_method or "env://", rank=rank,
                                    world_size=config.world, timeout=timedelta(seconds=timeout_s))
        state = cls(config, rank, dist.group.WORLD)
        state.tp_group = _block_group(config.world, config.tp, rank)
        state.ep_group = _block_group(config.world, config.ep, rank)
        return state


def _block_group(world: int, size: int, rank: int):
    """Every rank must create every block group (torch.distributed rule); returns this rank's."""
    if size == 1:
        return None
    if size == world:
        return dist.group.WORLD
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


def env_rank_world() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when launched torchrun-style, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None
