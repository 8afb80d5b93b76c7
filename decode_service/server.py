"""gRPC shell of a decode instance: Reserve → (KV pushed by prefill) → Decode stream → blocks freed.

    python -m decode_service --model DIR [--host 127.0.0.1] [--port 0] [--metrics-port N]
                             [--kv-transport tcp|mooncake] [--lease-seconds 30]
                             [--dp N] [--ep N] [--layer-sharding o_proj,q_b_proj]

With `--dp N` the instance is N attention-DP ranks (spawned here, or torchrun-style from RANK /
WORLD_SIZE / MASTER_ADDR across nodes) with experts split over `--ep` ranks; rank 0 serves gRPC,
places each reservation on the least-loaded rank and reports per-rank load.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor

import grpc

from decode_service.engine import DRAINING, FATAL, DecodeEngineClient, Placement, instance_load, start_engine
from decode_service.token_bus import MAX_BUS_NAME, TokenBuses
from decode_service.worker import Abort, Admit, DecodeWorker, Release
from shared import metrics
from shared.config import DecodeConfig, parse_flags
from shared.engine.core import CommandError, follow
from shared.engine.isolation import REQUEST_FAULT
from shared.kvcache.event_stream import serve_kv_events
from shared.parallel.launch import join_ranks, service_state, start_instance
from shared.protocol.finish import FinishReason, wire
from shared.protocol.limits import blocks_for, check_cache_salt
from shared.protocol.prefix import prompt_block_hashes
from shared.protocol.sampling import SamplingParams
from shared.rpc.convert import load_to_proto, logprob_from_proto, logprob_to_proto, sampling_from_proto
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from shared.rpc.service import (
    Credentials,
    Lifecycle,
    LoopQueue,
    die_with_launcher,
    freeze_startup_heap,
    start_server,
    wait_future,
)

log = logging.getLogger("pdserve.decode")
SERVICE = "pdserve.v1.Decode"
RESERVE_POLL_S = 0.05  # a reservation waiting for blocks looks at the ranks' loads this often
RESERVE_DEADLINE_MARGIN_S = 0.5  # it stops waiting this long before its caller's deadline, to answer in time


def follower_main(rank: int, cfg: DecodeConfig) -> None:
    """Entry point of DP ranks 1..N-1."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s decode[{rank}] %(levelname)s %(message)s", force=True)
    state = service_state(cfg.parallel(), rank, cfg.cpu_threads)
    worker = DecodeWorker(cfg, rank, state)
    freeze_startup_heap()
    follow(worker, state)


class DecodeServicer(internal_pb2_grpc.DecodeServicer):
    """Async handlers: a stream is a coroutine fed by the coordinator thread, not a gRPC thread, so
    concurrency is bounded by the KV pool and `max_num_seqs`, and health/GetLoad stay prompt."""

    def __init__(self, cfg: DecodeConfig, coordinator: DecodeEngineClient):
        self.cfg, self.coord = cfg, coordinator
        self.credentials = Credentials.of(cfg)
        self.draining = False
        self.buses = TokenBuses()
        # One thread hashes reservations' prompts off the event loop: a fixed pool, not asyncio's default one
        # that grows with the load (the hashes hold the GIL anyway, so more threads would not go faster).
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="prefix-keys")
        self._export_gauges()

    async def drain(self) -> None:
        """SIGTERM (a rolling upgrade, a scale-down): admit nothing more and end every running stream with
        UNAVAILABLE at once — the router continues each on another instance from the tokens it has sent —
        so the instance exits as soon as its handlers have let go, not when its longest request ends."""
        self.draining = True
        moved = self.coord.streams.end_all(DRAINING)
        log.info("draining: %d running requests handed back to the router", moved)

    async def _valid_request(self, request, rank: int, context) -> SamplingParams:
        """The request's sampling parameters, validated with its prompt once, here (the engine trusts
        what it admits): INVALID_ARGUMENT otherwise. A request refused for its prompt or length lets its
        lease go at once (its blocks were sized for it)."""
        try:
            params = sampling_from_proto(request.sampling_params)
            params.validate()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params.{exc}")
        try:
            self.coord.limits.check_request(request.prompt_token_ids, params, request.num_resumed,
                                            request.cache_salt)
            if len(request.token_bus) > MAX_BUS_NAME:
                raise ValueError(f"token_bus: at most {MAX_BUS_NAME} characters, got {len(request.token_bus)}")
        except ValueError as exc:
            metrics.request_done("decode", "INVALID_ARGUMENT", "admit")
            if self.coord.lease_rank.pop(request.lease_id, None) is not None:
                self.coord.submit(Release(request.lease_id), rank)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return params

    def _stop_string_found(self, rid: str, rank: int) -> FinishReason:
        """The OutputProcessor found a stop string: the engine ends the request as STOP
        (LLMEngine.stop_string_found) on its next turn; the stream ends now with that reason, without waiting
        a turn for the engine to say it (a request that ended meanwhile still ends at the stop string)."""
        self.coord.submit(Abort(rid, stop_string=True), rank)
        return FinishReason.STOP

    async def _result(self, fut, context):
        try:
            return await wait_future(fut, 60)
        except CommandError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    def _export_gauges(self) -> None:
        """Per-rank gauges read the coordinator's latest reports of every rank when scraped."""
        metrics.REGISTRY.register(metrics.LoadCollector("decode", lambda: [x.gauges() for x in self.coord.loads]))

    async def Reserve(self, request, context):  # gRPC method name
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode instance is draining")
        try:  # one that can never fit is INVALID_ARGUMENT, not a retryable RESOURCE_EXHAUSTED
            self.coord.limits.check_length(request.num_prompt_tokens, request.max_tokens)
            prefix = await asyncio.get_running_loop().run_in_executor(  # a 128k-token prompt: ~2k hashes
                self._hasher, self._prefix_keys, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            placement = await self._place(request, context, prefix)
        except CommandError as exc:
            metrics.request_done("decode", exc.code, "reserve")
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        self._count_reuse(request.num_prompt_tokens, placement.destination.reused_blocks, placement.restored_blocks,
                          placement.destination.follow_up)
        self.coord.lease_rank[placement.destination.lease_id] = placement.rank
        msg = placement.destination.to_proto(internal_pb2.KVDestination)
        msg.signature = self.credentials.sign(msg)  # the prefill pushes only where a decode instance vouched
        return internal_pb2.ReserveResponse(destination=msg, dp_rank=placement.rank)

    def _prefix_keys(self, request) -> tuple[bytes, ...]:
        """The prompt's leading block keys, hashed here under its salt (never taken from the caller): the lease
        starts on the blocks of the longest of them this instance caches. ValueError naming a bad field."""
        ids = request.prompt_token_ids
        if not ids or self.cfg.no_prefix_cache:
            return ()
        if len(ids) != request.num_prompt_tokens:
            raise ValueError(f"prompt_token_ids: {len(ids)} tokens, num_prompt_tokens says "
                             f"{request.num_prompt_tokens}")
        check_cache_salt(request.cache_salt)
        bs = self.coord.limits.block_size
        return tuple(prompt_block_hashes(list(ids), bs, (len(ids) - 1) // bs, request.cache_salt))

    def _count_reuse(self, prompt_tokens: int, reused: int, restored: int = 0, follow_up: bool = False) -> None:
        """A reservation's prompt blocks: reused from the prefix cache, or left for the push (metrics.KV_BLOCKS);
        the reused ones' tokens are hits of the tier that held them (`restored`: read back from the host tier)."""
        bs = self.coord.limits.block_size
        pushed = blocks_for(prompt_tokens, bs) - reused
        metrics.KV_BLOCKS.labels("reused").inc(reused)
        metrics.KV_BLOCKS.labels("pushed").inc(pushed)
        if follow_up:
            metrics.KV_FOLLOW_UP_BLOCKS.labels("reused").inc(reused)
            metrics.KV_FOLLOW_UP_BLOCKS.labels("pushed").inc(pushed)
        metrics.PREFIX_HIT_TOKENS.labels("decode", "device").inc((reused - restored) * bs)
        metrics.PREFIX_HIT_TOKENS.labels("decode", "host").inc(restored * bs)

    async def _place(self, request, context, prefix: tuple[bytes, ...] = ()) -> Placement:
        """Reserve the request's blocks. A pool that is full now is asked again once a rank reports enough
        free blocks (requests finish; a stalled push's reservation is reclaimed), for up to
        --reserve-wait-seconds within the caller's deadline; then RESOURCE_EXHAUSTED (the router tries
        another instance)."""
        loop = asyncio.get_running_loop()
        left = context.time_remaining()
        wait = min(self.cfg.reserve_wait_seconds, math.inf if left is None else left - RESERVE_DEADLINE_MARGIN_S)
        until = loop.time() + max(0.0, wait)
        total = request.num_prompt_tokens + request.max_tokens
        need = blocks_for(total, self.coord.limits.block_size)
        while True:
            try:
                return await wait_future(self.coord.reserve(request.request_id, total, request.num_prompt_tokens,
                                                            prefix), 60)
            except CommandError as exc:
                if exc.code != "RESOURCE_EXHAUSTED" or self.draining or loop.time() >= until:
                    raise
            while loop.time() < until and not self.draining:  # the loads are reported every engine turn
                await asyncio.sleep(RESERVE_POLL_S)
                if any(r.load.free_blocks >= need for r in self.coord.loads):
                    break

    async def Tokens(self, request, context):
        """A router's token bus (decode_service.token_bus): every request it names it on streams there."""
        async for batch in self.buses.serve(request, context):
            yield batch

    async def Release(self, request, context):
        rank = self.coord.lease_rank.pop(request.lease_id, None)
        released = rank is not None and bool(await self._result(
            self.coord.submit(Release(request.lease_id), rank), context))
        return internal_pb2.ReleaseResponse(released=released)

    async def GetLoad(self, request, context):
        return load_to_proto(instance_load(self.coord.loads, self.coord.limits.block_size))

    async def KvEvents(self, request, context):
        """Every DP rank's prefix-cache events (each names its rank), resumable (shared.kvcache.event_stream)."""
        async for batch in serve_kv_events(self.coord.kv_events, self.coord.limits.block_size, request, context):
            yield batch

    async def Decode(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode instance is draining")
        rank = self.coord.lease_rank.get(request.lease_id)
        if rank is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"unknown or expired lease {request.lease_id!r}")
        rid = request.request_id or request.lease_id
        params = await self._valid_request(request, rank, context)
        bus = self.buses.get(request.token_bus)  # None: the messages travel on this call
        try:
            stream = self.coord.open_stream(rid, LoopQueue())
        except KeyError:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already streaming here")
        first_logprob = (logprob_from_proto(request.first_token_logprob) if request.HasField("first_token_logprob")
                         else None)
        admit = self.coord.submit(Admit(rid, request.lease_id, list(request.prompt_token_ids), params,
                                        request.first_token_id, bytes(request.rng_state), request.local_prefill,
                                        first_logprob, request.num_resumed, request.cache_salt), rank)
        try:
            await wait_future(admit, 60)
        except CommandError as exc:
            self.coord.close_stream(rid, stream)
            metrics.request_done("decode", exc.code, "admit")
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except asyncio.CancelledError:  # the caller left while admitting: the engine must not run it
            self.coord.close_stream(rid, stream)
            self.coord.submit(Abort(rid), rank)
            raise
        self.coord.lease_rank.pop(request.lease_id, None)  # claimed: the blocks belong to the request now
        if request.local_prefill:  # selective disaggregation: this engine prefills the prompt
            metrics.TOKENS.labels("decode", "local_prompt").inc(len(request.prompt_token_ids))
        reason, ended = None, False
        out = self.coord.output_processor(params)  # text made here, off the engine process
        if request.num_resumed > 0:  # a migrated request's text goes on from its earlier outputs'
            out.process(list(request.prompt_token_ids[-request.num_resumed:]))
        try:
            while (ev := await stream.get()) is not None:
                if ev is FATAL:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "the decode engine failed; this instance is restarting")
                if ev is DRAINING:
                    metrics.request_done("decode", "UNAVAILABLE", "drain")
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode instance is draining: "
                                                                     "continue the request elsewhere")
                if ev.finish_reason is FinishReason.ERROR:  # a request fault (it alone failed the step): not migrated
                    ended = True
                    metrics.request_done("decode", "INTERNAL",
                                         "request_fault" if ev.error.startswith(REQUEST_FAULT) else "step_error")
                    await context.abort(grpc.StatusCode.INTERNAL, ev.error)
                reason = ev.finish_reason if ev.finished else None
                ended = ev.finished
                text = out.process([ev.token_id], final=ev.finished)
                if out.stopped and not ev.finished:  # a stop string: the engine ends this request now, and says why
                    reason, ended = self._stop_string_found(rid, rank), True
                metrics.TOKENS.labels("decode", "output").inc()
                msg = internal_pb2.DecodeResponse(token_ids=[ev.token_id], text=text, finish_reason=wire(reason),
                                                  logprobs=[logprob_to_proto(ev.logprob)] if ev.logprob else [],
                                                  prompt_logprobs=[logprob_to_proto(lp)
                                                                   for lp in ev.prompt_logprobs or ()])
                if bus is None:
                    yield msg
                elif not bus.put(rid, msg):  # its subscriber left: what follows could not reach it in order
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the token bus of this request closed")
                if out.stopped:
                    break
            metrics.request_done("decode", "OK", wire(reason or FinishReason.ABORT))
            if reason is None:  # the stream was closed before the request ended
                msg = internal_pb2.DecodeResponse(finish_reason=wire(FinishReason.ABORT))
                if bus is None or not bus.put(rid, msg):
                    yield msg
        finally:  # finished, stopped, cancelled by the caller, deadline, or an error: the engine lets go
            self.coord.close_stream(rid, stream)
            if not ended:
                self.coord.submit(Abort(rid), rank)


def parse_args(argv: list[str] | None = None) -> DecodeConfig:
    p = argparse.ArgumentParser(prog="python -m decode_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return parse_flags(DecodeConfig, p, argv)


async def serve(cfg: DecodeConfig, coordinator: DecodeEngineClient) -> tuple[grpc.aio.Server, int, Lifecycle]:
    servicer = DecodeServicer(cfg, coordinator)
    server, port, life = await start_server(
        cfg.host, cfg.port, [lambda s: internal_pb2_grpc.add_DecodeServicer_to_server(servicer, s)], [SERVICE],
        credentials=servicer.credentials)
    coordinator.set_fatal_handler(life.fail)
    life.servicer = servicer
    return server, port, life


async def _serve_until_stopped(cfg: DecodeConfig, coordinator: DecodeEngineClient, transport: str,
                               followers: list) -> None:
    _, port, life = await serve(cfg, coordinator)
    where = "in-process engine" if cfg.engine_in_process else "engine core process"
    life.announce(port, cfg.port_file, f"decode_service listening on {cfg.host}:{port} "
                                       f"(dp={cfg.dp} tp={cfg.tp} ep={cfg.ep}, kv {transport}, {where})")

    def cleanup() -> None:
        coordinator.stop()
        join_ranks(followers)

    await life.run(cfg.drain_seconds, cleanup, on_stop=life.servicer.drain)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    die_with_launcher()
    cfg = parse_args(argv)
    followers = start_instance(cfg, follower_main)
    if followers is None:  # this process was a torchrun-style follower
        return
    coordinator = start_engine(cfg)
    metrics.start_metrics_server(cfg.metrics_port, cfg.host, cfg.port_file)
    asyncio.run(_serve_until_stopped(cfg, coordinator, coordinator.transport, followers))


__all__ = ["DecodeConfig", "main"]
