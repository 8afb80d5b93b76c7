"""gRPC shell of a prefill instance.

    python -m prefill_service --model DIR [--host 127.0.0.1] [--port 0] [--metrics-port N]
                              [--kv-transport tcp|mooncake] [--max-prefill-tokens 4096]
                              [--cp N] [--ep N] [--layer-sharding o_proj,q_b_proj]

With `--cp N` the instance is a context-parallel group of N ranks (spawned here, or torchrun-style
from RANK / WORLD_SIZE / MASTER_ADDR across nodes); experts split over `--ep` ranks of it.

`Prefill(prompt, sampling, destination)` schedules the prompt on the engine (chunked, batched with
other prompts), pushes every layer's MLA and indexer blocks to the destination lease right after
that layer is computed (the push thread overlaps the next layer), waits for the commit, then
returns the first sampled token.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from prefill_service.rank import PrefillCore, PrefillRank
from shared import metrics
from shared.config import ServiceConfig, flag
from shared.engine import EngineConfig, LLMEngine
from shared.engine.core import follow
from shared.parallel import ParallelState
from shared.parallel.launch import join_ranks, service_state, start_instance
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from shared.rpc.service import Lifecycle, sampling_from_proto, start_server, wait_future
from shared.transfer import Destination, KVSender, TransferError, make_sender
from shared.transfer.tcp import STALL_SECONDS

log = logging.getLogger("pdserve.prefill")
SERVICE = "pdserve.v1.Prefill"


@dataclass(kw_only=True)
class PrefillConfig(ServiceConfig):
    cp: int = flag(1, "context-parallel ranks")
    max_prefill_tokens: int = flag(EngineConfig.max_num_batched_tokens, "prompt tokens computed per engine step "
                                   "(chunked prefill; several prompts batch up to it)")
    no_prefix_cache: bool = flag(False, "recompute every prompt (no prefix cache)")
    kv_stall_seconds: float = flag(STALL_SECONDS, "a KV push that makes no progress this long fails (the request "
                                                  "gets UNAVAILABLE)")

    def engine_config(self, **overrides: object) -> EngineConfig:
        return super().engine_config(max_num_batched_tokens=self.max_prefill_tokens,
                                     enable_prefix_caching=not self.no_prefix_cache, **overrides)


def _sender_factory(cfg: PrefillConfig, engine: LLMEngine) -> Callable[[str], KVSender]:
    tls = cfg.credentials().ssl_context(server=False)
    return lambda transport: make_sender(transport, engine.kv, cfg.public_host, tls=tls,
                                         stall_seconds=cfg.kv_stall_seconds)


def follower_main(rank: int, cfg: PrefillConfig) -> None:
    """Entry point of ranks 1..N-1 of a CP or TP prefill group: the same engine loop as rank 0's."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s prefill[{rank}] %(levelname)s %(message)s")
    state = service_state(cfg.parallel(), rank)
    engine = LLMEngine(cfg.engine_config(), state)
    follow(PrefillRank(engine, _sender_factory(cfg, engine)), state)


class _QueuedPromptTokens(metrics.Collector):
    """pdserve_prefill_queued_prompt_tokens at scrape time: prompt tokens waiting or not yet computed."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def describe(self):  # noqa: ANN201
        return []

    def collect(self):  # noqa: ANN201
        sched = self.engine.scheduler
        queued = sum(s.num_uncached for s in [*list(sched.waiting), *list(sched.running)] if s.is_prefilling)
        family = metrics.GaugeMetricFamily("pdserve_prefill_queued_prompt_tokens",
                                           "Prompt tokens waiting to be computed")
        family.add_metric([], queued)
        yield family


class PrefillServicer(internal_pb2_grpc.PrefillServicer):
    """Thin gRPC shell over the prefill engine core (one loop for every instance shape)."""

    def __init__(self, cfg: PrefillConfig, state: ParallelState | None = None):
        self.cfg = cfg
        self.credentials = cfg.credentials()
        self.engine = LLMEngine(cfg.engine_config(), state)
        self.worker = PrefillCore(PrefillRank(self.engine, _sender_factory(cfg, self.engine)), cfg.kv_transport)
        metrics.REGISTRY.register(metrics.LoadCollector("prefill", self._load))
        metrics.REGISTRY.register(_QueuedPromptTokens(self.engine))

    def _load(self) -> list[dict]:
        sched, kv = self.engine.scheduler, self.engine.kv
        return [{"rank": 0, "running": len(sched.running), "waiting": len(sched.waiting),
                 "free_blocks": kv.allocator.num_free, "total_blocks": kv.num_blocks}]

    async def GetLoad(self, request, context):  # noqa: N802
        sched = self.engine.scheduler
        return internal_pb2.LoadReport(running=len(sched.running), waiting=len(sched.waiting),
                                       free_blocks=self.engine.kv.allocator.num_free,
                                       total_blocks=self.engine.kv.num_blocks)

    async def Prefill(self, request, context):  # noqa: N802
        problem = self.credentials.vouched(request.destination)
        if problem:  # KV goes only where a decode instance of this cluster vouched for it
            metrics.request_done("prefill", "PERMISSION_DENIED", "unsigned_destination")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        params = sampling_from_proto(request.sampling_params)
        dest = Destination.from_proto(request.destination)
        prompt = list(request.prompt_token_ids)
        rid = request.request_id
        remaining = context.time_remaining()  # None: no deadline
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed before prefill")
        try:
            done = self.worker.prefill(rid, prompt, params, dest)
        except ValueError as exc:
            metrics.request_done("prefill", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            token, state, seconds, cached = await wait_future(done)
        except ValueError as exc:
            metrics.request_done("prefill", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferError as exc:
            metrics.request_done("prefill", "UNAVAILABLE", "kv_push")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {exc}")
        except asyncio.CancelledError:  # the caller went away or its deadline passed: drop the prompt
            self.worker.cancel(rid, RuntimeError("cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
        metrics.request_done("prefill", "OK")
        metrics.TOKENS.labels("prefill", "prompt").inc(len(prompt))
        metrics.PREFILL_SECONDS.observe(seconds)
        metrics.TOKENS.labels("prefill", "cached_prompt").inc(cached)
        return internal_pb2.PrefillResponse(first_token_id=token, rng_state=state, prefill_seconds=seconds,
                                            cached_prompt_tokens=cached)

    def close(self) -> None:
        self.worker.stop()  # the loop's end closes the rank's pushes and senders


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    p = argparse.ArgumentParser(prog="python -m prefill_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    PrefillConfig.add_arguments(p)
    return PrefillConfig.from_args(p.parse_args(argv))


async def serve(cfg: PrefillConfig, servicer: PrefillServicer) -> tuple[grpc.aio.Server, int, Lifecycle]:
    server, port, life = await start_server(
        cfg.host, cfg.port, [lambda s: internal_pb2_grpc.add_PrefillServicer_to_server(servicer, s)], [SERVICE],
        credentials=servicer.credentials)
    servicer.worker.on_fatal = life.fail
    return server, port, life


async def _serve_until_stopped(cfg: PrefillConfig, servicer: PrefillServicer, followers: list) -> None:
    _, port, life = await serve(cfg, servicer)
    life.announce(port, cfg.port_file,
                  f"prefill_service listening on {cfg.host}:{port} (cp={cfg.cp} tp={cfg.tp} ep={cfg.ep})")

    def cleanup() -> None:
        servicer.close()
        join_ranks(followers)

    await life.run(cfg.drain_seconds, cleanup)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    cfg = parse_args(argv)
    followers = start_instance(cfg, follower_main)
    if followers is None:  # this process was a torchrun-style follower
        return
    metrics.start_metrics_server(cfg.metrics_port, cfg.host, cfg.port_file)
    servicer = PrefillServicer(cfg, service_state(cfg.parallel(), 0))
    asyncio.run(_serve_until_stopped(cfg, servicer, followers))
