"""Start an instance's ranks: spawned on this host (rank 0 = this process), or torchrun-style from
the environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) so one instance can span nodes."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from shared.parallel.state import env_rank_world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(world: int, follower: Callable[[int, Any], None], cfg: Any) -> tuple[int, list]:
    """Returns (this process's rank, spawned follower processes). `follower(rank, cfg)` must be a
    module-level function (spawn pickles it by name)."""
    from_env = env_rank_world()
    if from_env is not None:
        rank, env_world = from_env
        if env_world != world:
            raise ValueError(f"WORLD_SIZE={env_world} but the instance needs {world} ranks")
        return rank, []
    if world == 1:
        return 0, []
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=follower, args=(r, cfg), name=f"rank{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    return 0, procs
