"""Start an instance's ranks: forked or spawned on this host (rank 0 = this process), or torchrun-style from
the environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) so one instance can span nodes."""

from __future__ import annotations

import io
import math
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from shared.config import ServiceConfig
from shared.device import check_weight_sharing, get_device, process_start_method, rank_start_method
from shared.parallel.state import ParallelConfig, ParallelState, env_rank_world
from shared.rpc.service import Credentials, leave_stop_signals_to_front, serve_follower_health
from shared.transfer.rdma import mooncake_device_names

# A collective that waits longer than this fails and the instance exits (the orchestrator restarts it):
# ranks that diverged on an error never hang. Idle leaders send heartbeats well inside it.
SERVICE_TIMEOUT_S = 300
# What run_ranks' fork server imports before it forks a rank: torch and the engine, which every rank function uses.
FORK_SERVER_PRELOAD = ["shared.parallel.launch", "shared.engine"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """CPUs this process may run on: its affinity set, capped by a cgroup v2 CPU quota (a container's CPU
    limit, which the affinity set does not show)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def engine_threads(cpu_threads: int, local_ranks: int) -> int:
    """Threads of each engine rank of a service on this host (torch's and the CPU kernels'): `cpu_threads`
    (--cpu-threads) or OMP_NUM_THREADS where given, else this host's cores less one, which the service's
    front ends (its gRPC process, the router, an HTTP server) get: an engine step that runs on every core
    waits for whichever thread a front end has preempted (measured on 2 cores: 16 / 64 served streams 1,056 /
    1,856 → 1,252 / 2,021 tok/s). Shared out among the host's ranks, at least one each."""
    total = cpu_threads
    if total <= 0 and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        total = int(os.environ["OMP_NUM_THREADS"])
    if total <= 0:
        total = min(torch.get_num_threads(), usable_cores()) - 1
    return max(1, total // local_ranks)


def service_state(config: ParallelConfig, rank: int, cpu_threads: int) -> ParallelState:
    """A service rank's process group, its threads set (engine_threads)."""
    torch.set_num_threads(engine_threads(cpu_threads, 1 if env_rank_world() else config.world))
    return ParallelState.initialize(config, rank, get_device(None), timeout_s=SERVICE_TIMEOUT_S)


def _local_follower(follower: Callable[[int, Any], None], rank: int, cfg: Any) -> None:
    """A follower rank this instance's leader started (forked or spawned): a stop signal is the leader's to act on
    (it stops its ranks once it has drained), and the rank dies with it."""
    leave_stop_signals_to_front()
    follower(rank, cfg)


def launch_ranks(world: int, follower: Callable[[int, Any], None], cfg: Any) -> tuple[int, list]:
    """Returns (this process's rank, the follower processes it started: forked where
    shared.device.process_start_method allows, else spawned). `follower(rank, cfg)` must be a module-level
    function (spawn pickles it by name)."""
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
    ctx = mp.get_context(process_start_method())
    procs = [ctx.Process(target=_local_follower, args=(follower, r, cfg), name=f"rank{r}") for r in range(1, world)]
    for p in procs:
        p.start()
    return 0, procs


def start_instance(cfg: ServiceConfig, follower: Callable[[int, Any], None]) -> list | None:
    """A service's start: validate its parallel shape (cfg.parallel()), its KV transport (the RDMA NICs
    Mooncake is to use must be there) and weight sharing (host memory only): exit naming the flag, never
    a silent fallback or no-op. Then start its ranks.
    Returns the spawned followers on rank 0; a torchrun-started follower runs `follower` here and gets None."""
    cfg.parallel()  # raises before anything is spawned
    try:
        cfg.mooncake_devices = mooncake_device_names(cfg.kv_transport, cfg.mooncake_protocol, cfg.mooncake_devices)
        check_weight_sharing(cfg.share_weights_dir, get_device())
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    rank, followers = launch_ranks(cfg.world, follower, cfg)
    if rank != 0:  # a torchrun-style follower (its own pod): probes need a health endpoint here
        down = serve_follower_health(cfg.host, cfg.port, Credentials.of(cfg), cfg.port_file)
        try:
            follower(rank, cfg)
        finally:
            down()
        return None
    return followers


def join_ranks(procs: list, timeout: float = 10.0) -> None:
    """Wait for spawned followers to exit after the leader told them to stop; kill stragglers."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()


def _entry(rank: int, world: int, port: int, threads: int, fn, args, queue, environ: dict[str, str]) -> None:
    if environ != os.environ:  # a fork server's rank: the caller's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_DEVICE_BACKEND_AUTOLOAD="0",
                      PDSERVE_DEVICE="cpu", OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        buf = io.BytesIO()  # plain bytes: shared-memory tensors would vanish when this process exits
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 180.0, threads: int = 1) -> list:
    """Run fn(rank, world, *args) on `world` local gloo ranks (forked here or by a fork server, or spawned;
    MASTER_* set) and return their results in rank order; a rank that fails or hangs past `timeout` raises
    (tests, benches)."""
    method = rank_start_method(threads)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)  # read when the server starts: once a process
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, threads, fn, args, queue, dict(os.environ)), daemon=True)
             for r in range(world)]
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
