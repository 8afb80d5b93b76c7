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
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from prefill_service.cp import CPLeader, CPRank
from prefill_service.cp import follower_loop as cp_follower_loop
from shared import metrics
from shared.config import ServiceConfig, flag
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.scheduler import ScheduledChunk
from shared.engine.worker import EngineWorker
from shared.parallel import ParallelState
from shared.parallel.launch import join_ranks, service_state, start_instance
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from shared.rpc.service import Lifecycle, sampling_from_proto, start_server, wait_future
from shared.transfer import Destination, KVPush, KVSender, TransferError, make_sender
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


def follower_main(rank: int, cfg: PrefillConfig) -> None:
    """Entry point of ranks 1..N-1 of a CP or TP prefill group."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s prefill[{rank}] %(levelname)s %(message)s")
    cp_follower_loop(CPRank(LLMEngine(cfg.engine_config(), service_state(cfg.parallel(), rank))))


@dataclass
class _Job:
    push: KVPush
    done: Future
    started: float
    prefix_sent: bool = False  # the blocks it got from the prefix cache went out with its first chunk


class PrefillWorker(EngineWorker):
    """Engine thread whose step pushes each computed layer of each scheduled chunk."""

    def __init__(self, engine: LLMEngine, transport: str, make: Callable[[str], KVSender] | None = None):
        self.jobs: dict[str, _Job] = {}
        self.senders: dict[str, KVSender] = {}
        self.transport = transport
        for family in (metrics.KV_PUSH_BYTES, metrics.KV_PUSH_SECONDS, metrics.KV_PUSH_FAILURES):
            family.labels(transport)  # exported from the start (at 0), so dashboards and alerts see them
        self._make = make or (lambda t: make_sender(t, engine.kv))
        super().__init__(engine, "prefill-engine")

    def sender(self, transport: str) -> KVSender:
        if transport not in self.senders:
            self.senders[transport] = self._make(transport)
        return self.senders[transport]

    def step(self) -> None:
        engine = self.engine
        chunks = engine.scheduler.schedule()
        if not chunks:
            return
        plan = [(self.jobs[c.seq.request_id].push, *self._blocks(c, self.jobs[c.seq.request_id])) for c in chunks]

        def layer_done(layer: int) -> None:
            for push, src, first in plan:
                push.send_layer(layer, src, first)

        metrics.BATCH_TOKENS.observe(sum(c.num_tokens for c in chunks))
        try:
            logits = engine.run_chunks(chunks, layer_done)
            tokens = engine.sample(chunks, logits)
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            for c in chunks:
                self._fail(c.seq.request_id, exc)
            return
        for seq, tok in zip([c.seq for c in chunks if c.completes], tokens):
            job = self.jobs.pop(seq.request_id)
            blocks, seq.block_table = seq.block_table, []  # held until the push has read them
            state = bytes(seq.generator.get_state().numpy()) if seq.params.seed is not None else b""
            engine.append_token(seq, tok)  # max_tokens=1: the request is done here
            cached = seq.num_cached_prompt_tokens
            job.push.finish_async(functools.partial(self._pushed, job, blocks, tok, state, cached))

    def _pushed(self, job: _Job, blocks: list[int], token: int, state: bytes, cached: int,
                error: BaseException | None) -> None:
        """On the push's thread once it committed (the engine stepped on meanwhile): hand the blocks
        back to the engine thread, answer the caller."""
        self.call(lambda engine: engine.kv.allocator.free(blocks))
        if error is not None:
            metrics.KV_PUSH_FAILURES.labels(self.transport).inc()
            job.done.set_exception(error if isinstance(error, TransferError) else TransferError(str(error)))
            return
        metrics.KV_PUSH_BYTES.labels(self.transport).inc(job.push.bytes_sent)
        metrics.KV_PUSH_SECONDS.labels(self.transport).observe(time.perf_counter() - job.started)
        job.done.set_result((token, state, time.perf_counter() - job.started, cached))

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination) -> Future:
        """Queue a prompt whose KV goes to `dest`; the Future yields (first token, rng state, seconds,
        prompt tokens served from the prefix cache), or fails with ValueError (bad request) or TransferError
        (bad destination, failed push)."""
        done: Future = Future()

        def add(engine: LLMEngine) -> None:
            if done.done():  # cancelled before the engine got to it
                return
            try:
                seq = engine.make_sequence(prompt, params, request_id)  # validates against the real params
            except ValueError as exc:
                done.set_exception(exc)
                return
            seq.params = dataclasses.replace(params, max_tokens=1)  # prefill ends at the first token
            try:
                push = self.sender(dest.transport).open(dest)
            except Exception as exc:  # noqa: BLE001
                engine.abort(request_id)
                done.set_exception(exc if isinstance(exc, TransferError) else TransferError(str(exc)))
                return
            self.jobs[request_id] = _Job(push, done, time.perf_counter())
            engine.scheduler.add(seq)

        self.call(add)
        return done

    def on_failure(self, exc: BaseException) -> None:
        super().on_failure(exc)
        for rid in list(self.jobs):
            job = self.jobs.pop(rid)
            job.push.abort()
            if not job.done.done():
                job.done.set_exception(RuntimeError(f"prefill engine failed: {exc}"))

    def cancel(self, request_id: str, reason: BaseException) -> None:
        self.call(lambda engine: self._fail(request_id, reason))

    def _blocks(self, c: ScheduledChunk, job: _Job) -> tuple[list[int], int]:
        """Source blocks touched by this chunk and the lease index of the first one; a request's first
        chunk also carries the blocks it found in the prefix cache (computed earlier, every layer)."""
        bs = self.engine.layout.block_size
        start, end = c.seq.num_cached, c.seq.num_cached + c.num_tokens
        first, last = start // bs, -(-end // bs)
        if not job.prefix_sent:
            first, job.prefix_sent = 0, True
        return c.seq.block_table[first:last], first

    def _fail(self, request_id: str, exc: BaseException) -> None:
        job = self.jobs.pop(request_id, None)
        self.engine.abort(request_id)
        if job is not None:
            job.push.abort()  # does not wait: the push thread lets go by itself
            if not job.done.done():
                job.done.set_exception(exc)


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
    """One rank: a PrefillWorker batches and chunks prompts; a CP or TP group: a CPLeader drives it."""

    def __init__(self, cfg: PrefillConfig, state: ParallelState | None = None):
        self.cfg = cfg
        self.credentials = cfg.credentials()
        self.engine = LLMEngine(cfg.engine_config(), state)
        tls = self.credentials.ssl_context(server=False)

        def make(transport: str) -> KVSender:
            return make_sender(transport, self.engine.kv, cfg.public_host, tls=tls, stall_seconds=cfg.kv_stall_seconds)

        if cfg.world > 1:
            self.worker = CPLeader(CPRank(self.engine, make))
        else:
            self.worker = PrefillWorker(self.engine, cfg.kv_transport, make)
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
            done = self.worker.submit(rid, prompt, params, dest)
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
        self.worker.stop()
        senders = self.worker.me.senders if isinstance(self.worker, CPLeader) else self.worker.senders
        for sender in senders.values():
            sender.close()


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
