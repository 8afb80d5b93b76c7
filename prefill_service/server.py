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

import grpc

from prefill_service.engine import PrefillEngineClient, start_engine
from prefill_service.fetch import PrefixFetcher
from prefill_service.worker import PrefillWorker, prefill_gauges, sender_factory
from shared import metrics
from shared.config import PrefillConfig, parse_flags
from shared.engine import LLMEngine
from shared.engine.core import CommandError, follow
from shared.engine.isolation import RequestFault
from shared.kvcache.event_stream import serve_kv_events
from shared.parallel.launch import join_ranks, service_state, start_instance
from shared.protocol.limits import blocks_for
from shared.protocol.load import LoadReport
from shared.rpc.convert import load_to_proto, logprob_to_proto, sampling_from_proto
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from shared.rpc.service import (
    Credentials,
    Lifecycle,
    die_with_launcher,
    freeze_startup_heap,
    start_server,
    wait_future,
)
from shared.transfer import Destination, TransferError

log = logging.getLogger("pdserve.prefill")
SERVICE = "pdserve.v1.Prefill"


def follower_main(rank: int, cfg: PrefillConfig) -> None:
    """Entry point of ranks 1..N-1 of a CP or TP prefill group: the same engine loop as rank 0's."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s prefill[{rank}] %(levelname)s %(message)s", force=True)
    state = service_state(cfg.parallel(), rank, cfg.cpu_threads)
    engine = LLMEngine(cfg.engine_config(), state)
    worker = PrefillWorker(engine, sender_factory(cfg, engine))
    freeze_startup_heap()
    follow(worker, state)


class _QueuedPromptTokens(metrics.Collector):
    """pdserve_prefill_queued_prompt_tokens at scrape time: prompt tokens waiting or not yet computed."""

    def __init__(self, load: Callable[[], LoadReport]):
        self.load = load

    def describe(self):
        return []

    def collect(self):
        family = metrics.GaugeMetricFamily("pdserve_prefill_queued_prompt_tokens",
                                           "Prompt tokens waiting to be computed")
        family.add_metric([], self.load().queued_prompt_tokens)
        yield family


class PrefillServicer(internal_pb2_grpc.PrefillServicer):
    """Thin gRPC shell over the prefill engine core (one loop for every instance shape), which runs
    in its own process or, with --engine-in-process, on a thread here (one `PrefillEngineClient` either way)."""

    def __init__(self, cfg: PrefillConfig, engine: PrefillEngineClient):
        self.cfg = cfg
        self.credentials = Credentials.of(cfg)
        self.engine = engine
        self.fetcher = PrefixFetcher(engine, self.credentials, not cfg.no_kv_fetch)
        for family in (metrics.KV_PUSH_BYTES, metrics.KV_PUSH_SECONDS, metrics.KV_PUSH_FAILURES):
            family.labels(cfg.kv_transport)  # exported from the start (at 0), so dashboards and alerts see them
        metrics.REGISTRY.register(metrics.LoadCollector(
            "prefill", lambda: [prefill_gauges(r) for r in self.engine.load().ranks]))
        metrics.REGISTRY.register(_QueuedPromptTokens(self.engine.load))

    async def GetLoad(self, request, context):
        return load_to_proto(self.engine.load())

    async def KvEvents(self, request, context):
        """The instance's prefix-cache events (rank 0's pool), resumable (shared.kvcache.event_stream)."""
        async for batch in serve_kv_events(self.engine.kv_events, self.engine.load().block_size, request, context):
            yield batch

    async def Prefill(self, request, context):
        problem = self.credentials.vouched(request.destination)
        if problem:  # KV goes only where a decode instance of this cluster vouched for it
            metrics.request_done("prefill", "PERMISSION_DENIED", "unsigned_destination")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        try:
            params = sampling_from_proto(request.sampling_params)
        except ValueError as exc:
            metrics.request_done("prefill", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params.{exc}")
        dest = Destination.from_proto(request.destination)
        prompt = list(request.prompt_token_ids)
        rid = request.request_id
        remaining = context.time_remaining()  # None: no deadline
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed before prefill")
        try:  # validated once, here: the engine trusts what it is handed
            params.validate()
            self.engine.limits.check_request(prompt, params, request.num_resumed, request.cache_salt)
            if not 0 <= dest.reused_blocks < max(1, blocks_for(len(prompt), self.engine.limits.block_size)):
                raise ValueError(f"destination.reused_blocks: {dest.reused_blocks} of a {len(prompt)}-token "
                                 "prompt's blocks (its last block is always pushed)")
        except ValueError as exc:
            metrics.request_done("prefill", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        fetched = await self.fetcher.fetch(prompt, request.cache_salt, request.fetch_from, request.fetch_blocks)
        try:
            result = await wait_future(self.engine.prefill(rid, prompt, params, dest, request.priority,
                                                          request.num_resumed, request.cache_salt))
        except ValueError as exc:
            metrics.request_done("prefill", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferError as exc:
            metrics.request_done("prefill", "UNAVAILABLE", "kv_push")
            metrics.KV_PUSH_FAILURES.labels(dest.transport).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {exc}")
        except CommandError as exc:  # the engine core died
            metrics.request_done("prefill", exc.code, "engine")
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except asyncio.CancelledError:  # the caller went away or its deadline passed: drop the prompt
            self.engine.cancel(rid, RuntimeError("cancelled"))
            raise
        except RequestFault as exc:  # it alone failed the step: the router does not carry it elsewhere
            metrics.request_done("prefill", "INTERNAL", "request_fault")
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except Exception as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {exc}")
        metrics.request_done("prefill", "OK")
        metrics.TOKENS.labels("prefill", "prompt").inc(len(prompt))
        metrics.PREFILL_SECONDS.observe(result.seconds)
        metrics.TOKENS.labels("prefill", "cached_prompt").inc(result.cached_prompt_tokens)
        metrics.PREFIX_HIT_TOKENS.labels("prefill", "device").inc(result.cached_prompt_tokens
                                                                  - result.host_cached_prompt_tokens)
        metrics.PREFIX_HIT_TOKENS.labels("prefill", "host").inc(result.host_cached_prompt_tokens)
        metrics.KV_PUSH_BYTES.labels(dest.transport).inc(result.pushed_bytes)
        metrics.KV_PUSH_SECONDS.labels(dest.transport).observe(result.seconds)
        return internal_pb2.PrefillResponse(
            first_token_id=result.first_token, rng_state=result.rng_state, prefill_seconds=result.seconds,
            cached_prompt_tokens=result.cached_prompt_tokens,
            fetched_prompt_tokens=min(fetched, result.cached_prompt_tokens),
            first_token_logprob=logprob_to_proto(result.first_logprob) if result.first_logprob else None,
            prompt_logprobs=[logprob_to_proto(lp) for lp in result.prompt_logprobs])

    async def PushCached(self, request, context):
        """Another prefill instance fetches the blocks of a prefix this one caches (prefill_service.fetch)."""
        try:
            return await self.fetcher.push_cached(request)
        except PermissionError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (TransferError, CommandError, TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"push of cached blocks failed: {exc}")

    def close(self) -> None:
        self.engine.stop()  # the loop's end closes the rank's pushes and senders (in the core process too)


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    p = argparse.ArgumentParser(prog="python -m prefill_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return parse_flags(PrefillConfig, p, argv)


async def serve(cfg: PrefillConfig, servicer: PrefillServicer) -> tuple[grpc.aio.Server, int, Lifecycle]:
    server, port, life = await start_server(
        cfg.host, cfg.port, [lambda s: internal_pb2_grpc.add_PrefillServicer_to_server(servicer, s)], [SERVICE],
        credentials=servicer.credentials)
    servicer.engine.set_fatal_handler(life.fail)
    return server, port, life


async def _serve_until_stopped(cfg: PrefillConfig, servicer: PrefillServicer, followers: list) -> None:
    _, port, life = await serve(cfg, servicer)
    life.announce(port, cfg.port_file,
                  f"prefill_service listening on {cfg.host}:{port} (cp={cfg.cp} tp={cfg.tp} ep={cfg.ep}, "
                  f"{'in-process engine' if cfg.engine_in_process else 'engine core process'})")

    def cleanup() -> None:
        servicer.close()
        join_ranks(followers)

    await life.run(cfg.drain_seconds, cleanup)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    die_with_launcher()
    cfg = parse_args(argv)
    followers = start_instance(cfg, follower_main)
    if followers is None:  # this process was a torchrun-style follower
        return
    engine = start_engine(cfg)
    metrics.start_metrics_server(cfg.metrics_port, cfg.host, cfg.port_file)
    servicer = PrefillServicer(cfg, engine)
    asyncio.run(_serve_until_stopped(cfg, servicer, followers))
