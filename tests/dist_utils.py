"""Run a function on N gloo ranks (real processes) with a hard timeout: a hang fails the test."""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
                      PDSERVE_DEVICE="cpu", OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()  # plain bytes: shared-memory tensors would vanish when this process exits
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 180.0) -> list:  # noqa: ANN001
    """fn(rank, world, *args) on `world` processes; returns the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
