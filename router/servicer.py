"""The router's request path: `pdserve.v1.Generation/Generate` for the gRPC API and the HTTP API alike. A
request is validated once (router.request), placed on a (prefill, decode) pair by the policy, relayed through
decode.Reserve → prefill.Prefill (KV pushed to the reservation) → decode.Decode (the token stream), and moved
to another pair when an instance fails under it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from router.config import RouterConfig
from router.drain import DRAINING_MESSAGE, RETRY_AFTER_S
from router.fetch import FetchAdvisor
from router.hint import PairHint
from router.kv_index import KvIndex
from router.perf import PerfModel
from router.policy import POLICIES, Choice, PrefillView, RankView, Rejected, Request
from router.pools import Instance, Pool, in_flight
from router.reply import ReplyParser, api_finish_reason
from router.request import GenerationRequest, Invalid, RequestParser
from router.token_bus import TokenBuses
from shared import metrics
from shared.config import ModelConfig
from shared.protocol.finish import FinishReason, wire
from shared.protocol.limits import RequestLimits
from shared.protocol.prefix import prompt_block_hashes
from shared.protocol.structured import ConstraintCompiler
from shared.protocol.tokenizer import Tokenizer
from shared.rpc.convert import sampling_to_proto
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.rpc.service import Credentials

log = logging.getLogger("pdserve.router")
# Fail fast on a dead peer instead of waiting for reconnect back-off.
PEER_TIMEOUT = 10.0
# A peer's failure a request survives by going on elsewhere (the others are the request's own fault).
MIGRATABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED)
# A Reserve that fails with these tries the next decode instance.
FULL_OR_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
T = TypeVar("T")


@dataclass
class PromptEcho:
    """What a request's first message carries when it asked for prompt logprobs: its prompt and their
    logprobs (from the prefill instance, or from decode's first message after a local prefill)."""

    ids: list[int]
    logprobs: list[generation_pb2.TokenLogprob]


@dataclass
class Progress:
    """What a request's client has been sent so far, carried across migrations."""

    request: GenerationRequest
    reply: ReplyParser  # the reply text's parser (its state spans the tries)
    t0: float
    t_end: float  # the request's deadline or --request-timeout, whichever is first
    streamed: list[int] = field(default_factory=list)  # tokens sent to the client
    migrations: int = 0
    failed_at: float | None = None  # when the last try failed, until the next token (the pause a client sees)
    t_first: float | None = None
    t_last: float | None = None
    cached: int = 0  # prompt tokens the first prefill found in its prefix cache
    echo: PromptEcho | None = None  # for the first message, with prompt logprobs


@dataclass
class Placement:
    """One try's choice: the pools as the policy saw them, its pairs best first (the rest are the fail-over
    order), and the views the request is counted on until their next load reports."""

    prefills: list[Instance]
    decodes: list[Instance]
    pairs: list[Choice]
    counted_prefill: PrefillView | None  # None: a local prefill
    counted_at: int  # counted_prefill's load reports when the prompt was counted on it
    counted_rank: RankView
    context_tokens: int  # the prompt plus max_tokens left, as counted on a decode rank
    local_prompt: int  # prompt tokens the decode rank prefills itself (a local prefill)
    cached_by_prefill: list[int]  # prompt tokens each prefill instance caches (the KV index's)

    @property
    def best(self) -> Choice:
        return self.pairs[0]


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The public front: every handler is a coroutine, so open streams cost no threads; prompts are
    tokenized on a small pool (the tokenizer releases the GIL) so a long one delays no one."""

    def __init__(self, cfg: RouterConfig):
        if not cfg.prefill or not cfg.decode:
            raise ValueError("the router needs at least one --prefill and one --decode address")
        self.cfg = cfg
        self.model_config = ModelConfig.from_pretrained(cfg.model)
        self.tokenizer = Tokenizer.from_model_dir(cfg.model, self.model_config.bos_token_id)
        self.limits = RequestLimits(self.model_config.max_position_embeddings, self.model_config.vocab_size)
        constraints = ConstraintCompiler(self.tokenizer.path if self.tokenizer else None,
                                         self.model_config.vocab_size, list(self.model_config.eos_token_ids))
        self.requests = RequestParser(self.tokenizer, self.limits, constraints, self.max_prompt_bytes,
                                      cfg.chat_max_tokens, ThreadPoolExecutor(2, thread_name_prefix="tokenize"))
        self.credentials = Credentials.of(cfg)
        self.metadata = self.credentials.metadata
        self.prefill = Pool("prefill", cfg.prefill, internal_pb2_grpc.PrefillStub, self.credentials)
        self.decode = Pool("decode", cfg.decode, internal_pb2_grpc.DecodeStub, self.credentials)
        self.buses = TokenBuses(self.metadata, not cfg.no_token_bus)
        self.perf = PerfModel.load(cfg.profile) if cfg.profile else PerfModel()
        self.policy = POLICIES[cfg.policy](self.perf)
        self.fetch = FetchAdvisor(self.perf, not cfg.no_kv_fetch)
        metrics.IN_FLIGHT.set_function(lambda: self.in_flight)
        self.background: set[asyncio.Task] = set()  # tasks referenced for as long as they run
        self.in_flight = 0  # Generate calls being served (changed only on the event loop)
        self.draining = False  # SIGTERM: new calls are refused (router.drain), the ones in flight run to their end

    @property
    def max_prompt_bytes(self) -> int:
        return self.cfg.max_prompt_bytes or min(8 << 20, 32 * self.model_config.max_position_embeddings)

    async def Generate(self, request, context):
        """The gRPC API's Generate."""
        async for out in self.generate(request, context):
            yield out

    async def generate(self, request, context, open_ended: bool = False):
        """Generate's path, for the gRPC API and the HTTP API alike (router.http passes an HttpCall as
        `context`). Admission first: beyond --max-concurrent-requests a call is refused at once, before
        any work (health checks are never refused: an overloaded router is not a dead one)."""
        if self.draining:
            metrics.request_done("router", "UNAVAILABLE", "draining")
            context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_S * 1000)),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        if self.in_flight >= self.cfg.max_concurrent_requests:
            metrics.request_done("router", "RESOURCE_EXHAUSTED", "overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the router is at its limit of {self.cfg.max_concurrent_requests} requests in flight")
        self.in_flight += 1
        try:
            async for out in self._generate(request, context, open_ended):
                yield out
        finally:
            self.in_flight -= 1

    async def _generate(self, request, context, open_ended: bool):
        """Validate, then run the request, migrating it when an instance fails under it: the stream goes on
        from another pair with the tokens already sent as the end of its prompt (no token repeated or
        missed; see LLMEngine.make_sequence), up to --migration-limit times."""
        t0 = time.perf_counter()
        try:
            req = await self.requests.parse(request, open_ended)
        except Invalid as exc:
            metrics.request_done("router", "INVALID_ARGUMENT", "invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        metrics.ARRIVALS.inc()
        metrics.TOKENS.labels("router", "prompt").inc(len(req.prompt_token_ids))
        deadline = context.time_remaining()  # None without a deadline
        if deadline is not None and deadline <= 0:
            metrics.request_done("router", "DEADLINE_EXCEEDED", "deadline")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed before it started")
        timeout = min(self.cfg.request_timeout, deadline) if deadline is not None else self.cfg.request_timeout
        progress = Progress(req, req.reply.parser(), t0, t0 + timeout)
        while True:
            try:
                async for out in self._attempt(context, progress):
                    yield out
                return
            except PeerFrameError as exc:  # a decode instance answered what no decode instance says
                metrics.request_done("router", "INTERNAL", "peer_frame")
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            except grpc.RpcError as exc:  # an instance failed after admission
                code, cause = exc.code(), _cause(exc)
                migratable = code in MIGRATABLE and cause != "request_fault"  # it alone failed a step: not moved
                if not migratable or progress.migrations >= self.cfg.migration_limit \
                        or time.perf_counter() >= progress.t_end:
                    spent = migratable and progress.migrations >= self.cfg.migration_limit
                    metrics.request_done("router", _map_code(code, cause).name, "migration_limit" if spent else cause)
                    await context.abort(_map_code(code, cause), f"{exc.details()}" + (
                        f" (after {progress.migrations} migrations)" if progress.migrations else ""))
                progress.migrations += 1
                progress.failed_at = time.perf_counter()
                metrics.MIGRATIONS.labels(cause).inc()
                log.warning("request %s: %s (%s); migrating with %d tokens streamed (%d/%d)", req.request_id,
                            cause, exc.details(), len(progress.streamed), progress.migrations,
                            self.cfg.migration_limit)

    async def _attempt(self, context, progress: Progress):
        """One try: admit on a pair, reserve, prefill (the prompt plus what was streamed before a
        migration), stream from decode. A failure after admission raises the peer's RpcError."""
        req, md = progress.request, self.metadata
        ids, resumed = [*req.prompt_token_ids, *progress.streamed], len(progress.streamed)
        rid = uuid.uuid4().hex  # internal ids are the router's (a new one per try); the client's is only a label
        place = await self._place(context, progress, ids, req.sampling.max_tokens - resumed)
        timeout = max(0.0, progress.t_end - time.perf_counter())
        reserve_req = internal_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=len(ids),
                                                  max_tokens=req.sampling.max_tokens - resumed)
        if not (place.best.local and req.sampling.prompt_logprobs is not None):  # that one computes every block
            reserve_req.prompt_token_ids.extend(ids)  # decode starts the lease on the prefix it caches
            reserve_req.cache_salt = req.cache_salt
        dec, reserve = await self._first_ok(self.decode, Pool.ordered(place.decodes, [c.decode for c in place.pairs]),
                                            lambda inst: inst.stub.Reserve(reserve_req, timeout=PEER_TIMEOUT,
                                                                           metadata=md), retry_on=FULL_OR_DOWN)
        rank = dec.view.ranks[min(reserve.dp_rank, len(dec.view.ranks) - 1)]
        if rank is not place.counted_rank:  # another instance or DP rank took it
            rank.count(place.context_tokens, place.local_prompt)
        sampling = sampling_to_proto(req.sampling)  # what prefill and decode are sent: the validated parameters
        with in_flight(dec):
            lease_id = reserve.destination.lease_id
            claimed = False
            try:
                if progress.migrations == 0:
                    metrics.QUEUE.observe(time.perf_counter() - progress.t0)
                decode_req = internal_pb2.DecodeRequest(request_id=rid, lease_id=lease_id, prompt_token_ids=ids,
                                                        sampling_params=sampling, local_prefill=place.best.local,
                                                        num_resumed=resumed, cache_salt=req.cache_salt)
                first = None
                if not place.best.local:  # the prompt goes to a prefill instance, which pushes its KV into the lease
                    prefill_req = internal_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=ids, sampling_params=sampling,
                        destination=reserve.destination, priority=req.priority, num_resumed=resumed,
                        cache_salt=req.cache_salt)
                    first = await self._prefill(place, dec, prefill_req, timeout)
                    decode_req.first_token_id, decode_req.rng_state = first.first_token_id, first.rng_state
                    if first.HasField("first_token_logprob"):
                        decode_req.first_token_logprob.CopyFrom(first.first_token_logprob)
                metrics.PREFILL_PATHS.labels("local" if place.best.local else "disaggregated").inc()
                stream = self.buses.decode(dec, decode_req, timeout)  # on the instance's token bus if it can
                claimed = True
                if not progress.streamed:  # this try's first message is the client's first
                    _first_message(progress, first)
                try:
                    async for out in self._relay(stream, dec, progress, place.best):
                        yield out
                finally:
                    stream.cancel()  # a no-op when it ended; otherwise the client left: decode lets go
            finally:
                if not claimed:  # off the handler: it may be cancelled already
                    task = asyncio.ensure_future(self._release(dec, lease_id))
                    self.background.add(task)
                    task.add_done_callback(self.background.discard)

    async def _place(self, context, progress: Progress, ids: list[int], remaining: int) -> Placement:
        """The policy's pairs for this try (a refusal aborts the call before any work anywhere); an endpoint
        picker's pair (the HTTP call's `hint`) first where the policy admits it."""
        prefills, decodes = await self._reachable(context, progress.t_end)
        try:
            return await self.plan(progress.request, ids, remaining, prefills, decodes, progress.t0,
                                   progress.migrations == 0, getattr(context, "hint", None))
        except Rejected as exc:  # before any work anywhere
            metrics.request_done("router", "RESOURCE_EXHAUSTED", "sla")
            context.set_trailing_metadata((("retry-after-ms", str(round(exc.retry_after_s * 1e3))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry after {exc.retry_after_s:.1f} s")

    async def plan(self, req: GenerationRequest, ids: list[int], remaining: int, prefills: list[Instance],
                   decodes: list[Instance], t0: float, first_try: bool = True, hint: PairHint | None = None
                   ) -> Placement:
        """The policy's pairs for a request (Rejected when none meets its targets), `hint`'s pair first where
        admitted, the request counted at once on the chosen pair until their next reports: admissions made while
        its Reserve is in flight must see it, or a burst lands on views that all still say idle. The endpoint
        picker (router.epp) asks this too."""
        ttft_s = (req.ttft_ms or self.cfg.ttft_slo_ms) / 1e3 if first_try else 0.0  # a started stream goes on
        tpot_s = (req.tpot_ms or self.cfg.tpot_slo_ms) / 1e3
        cached = self._cached_prefix(ids, prefills, decodes, req.cache_salt)
        pairs = await self._admit(ids, remaining, ttft_s, tpot_s, req, cached, prefills, decodes, t0, hint is None)
        if hint is not None:  # (the picker's pair: a burst's overflow is not offered, see _admit)
            pairs = hint.first(pairs, prefills, decodes)
        best = pairs[0]
        counted_prefill = None if best.local else prefills[best.prefill].view
        decode_view = decodes[best.decode].view
        counted_rank = decode_view.ranks[decode_view.least_loaded()]
        counted_at = counted_prefill.count(len(ids)) if counted_prefill is not None else 0
        local_prompt = len(ids) if best.local else 0  # prompt tokens the decode rank will prefill itself
        counted_rank.count(len(ids) + remaining, local_prompt)
        return Placement(prefills, decodes, pairs, counted_prefill, counted_at, counted_rank, len(ids) + remaining,
                         local_prompt, cached[0])

    async def _prefill(self, place: Placement, dec: Instance, prefill_req: internal_pb2.PrefillRequest,
                       timeout: float) -> internal_pb2.PrefillResponse:
        """The prompt prefilled on the pairs' prefill instances for `dec` in turn (then the others), failing
        over on UNAVAILABLE; its KV is pushed into `dec`'s lease."""
        preferred = [c.prefill for c in place.pairs if place.decodes[c.decode] is dec]
        order = Pool.ordered(place.prefills, preferred or [c.prefill for c in place.pairs])
        counted, at, n = place.counted_prefill, place.counted_at, len(prefill_req.prompt_token_ids)
        if order[0].view is not counted:
            counted, at = order[0].view, order[0].view.count(n)
        try:
            pre, first = await self._first_ok(self.prefill, order, lambda inst: inst.stub.Prefill(
                self.fetch.request_for(prefill_req, inst, place.prefills, place.cached_by_prefill), timeout=timeout,
                metadata=self.metadata), retry_on=(grpc.StatusCode.UNAVAILABLE,))
        finally:
            counted.done(n, at)
        metrics.PAIRS.labels(pre.address, dec.address).inc()
        return first

    async def _reachable(self, context, t_end: float) -> tuple[list[Instance], list[Instance]]:
        """The pools' instances once at least one of each is up: a request that arrives while they start
        or reconnect waits for them (up to --instance-wait, within its deadline) instead of failing, and a
        request to a dead pool fails that soon, not when its deadline ends (600 s for a client without one)."""
        t_end = min(t_end, time.perf_counter() + self.cfg.instance_wait)
        while True:
            prefills, decodes = list(self.prefill.instances), list(self.decode.instances)  # discovery may change
            if any(i.view.up for i in prefills) and any(i.view.up for i in decodes):
                return prefills, decodes
            if time.perf_counter() + self.cfg.load_interval >= t_end:
                metrics.request_done("router", "UNAVAILABLE", "no_instances")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill or no decode instance is reachable "
                                    f"(prefill up: {sum(i.view.up for i in prefills)} of {len(prefills)}, decode "
                                    f"up: {sum(i.view.up for i in decodes)} of {len(decodes)})")
            await asyncio.sleep(self.cfg.load_interval / 2)

    def _cached_prefix(self, ids: list[int], prefills: list[Instance], decodes: list[Instance],
                       cache_salt: str = "") -> tuple[list[int], list[int]]:
        """Per prefill and per decode instance, the prompt tokens its prefix cache holds (the router's index
        of their KvEvents; keys under the request's cache_salt): a device block whole, a host-tier block at
        HOST_HIT_WEIGHT (its read back costs). At least one token is always computed, as the scheduler does.
        A decode instance counts its DP rank that holds the most."""
        hashes: dict[int, list[bytes]] = {}

        def keys(bs: int) -> list[bytes]:
            if bs not in hashes:
                hashes[bs] = prompt_block_hashes(ids, bs, (len(ids) - 1) // bs, cache_salt)
            return hashes[bs]

        def tokens(index: KvIndex, inst: Instance, ranks: int) -> int:
            if not index.entries(inst.address):
                return 0
            bs = index.block_size.get(inst.address) or inst.view.block_size
            return index.best_rank(inst.address, keys(bs), ranks).tokens(bs)

        return ([tokens(self.prefill.kv_index, x, 1) for x in prefills],
                [tokens(self.decode.kv_index, x, len(getattr(x.view, "ranks", ())) or 1) for x in decodes])

    async def _release(self, dec: Instance, lease_id: str) -> None:
        with contextlib.suppress(grpc.RpcError):  # the lease expires on its own
            await dec.stub.Release(internal_pb2.ReleaseRequest(lease_id=lease_id), timeout=PEER_TIMEOUT,
                                   metadata=self.metadata)

    async def _relay(self, stream: AsyncIterator[internal_pb2.DecodeResponse], dec: Instance, progress: Progress,
                     predicted: Choice) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Decode's stream as the client's: its text through the reply parser (reasoning, answer, tool
        calls), the prompt echo (prompt logprobs asked) on the first message. Observed latencies calibrate the
        performance model (first tries only). A failing stream marks its instance down and raises."""
        try:
            async for msg in stream:
                if msg.token_ids:
                    self._observe_tokens(progress, predicted, list(msg.token_ids))
                reason = finish_of(msg, dec.address)
                out = _response(msg, progress, reason)
                if reason is not None:
                    n = len(progress.streamed)
                    if n > 1 and progress.migrations == 0 and progress.t_first is not None:
                        self.perf.observe_tpot(predicted.batch, predicted.tpot_raw_s,
                                               (progress.t_last - progress.t_first) / (n - 1))
                    out.usage.prompt_tokens, out.usage.completion_tokens = len(progress.request.prompt_token_ids), n
                    out.usage.cached_prompt_tokens = progress.cached
                    metrics.request_done("router", "OK", wire(reason))
                    metrics.E2E.observe(time.perf_counter() - progress.t0)
                    metrics.TOKENS.labels("router", "output").inc(n)
                yield out
        except grpc.RpcError as exc:
            if exc.code() in MIGRATABLE and _cause(exc) != "request_fault":
                dec.view.up = False  # out of the choice until its load poll succeeds again
            raise

    def _observe_tokens(self, progress: Progress, predicted: Choice, token_ids: list[int]) -> None:
        """New tokens: TTFT (calibrating the performance model), a migration's pause, or TPOT."""
        now = time.perf_counter()
        if progress.t_first is None:
            progress.t_first = now
            metrics.TTFT.observe(now - progress.t0)
            if predicted.local:
                self.perf.observe_local_ttft(predicted.batch, predicted.ttft_raw_s, now - progress.t0)
            else:
                self.perf.observe_ttft(predicted.queued_tokens, predicted.ttft_raw_s, now - progress.t0,
                                       predicted.busy_beside)
        elif progress.failed_at is not None:  # the first token after a migration
            metrics.MIGRATION_PAUSE.observe(now - progress.failed_at)
            progress.failed_at = None
        elif progress.t_last is not None:
            metrics.TPOT.observe((now - progress.t_last) / len(token_ids))
        progress.t_last = now
        progress.streamed += token_ids

    async def _admit(self, ids: list[int], max_tokens: int, ttft_s: float, tpot_s: float, req: GenerationRequest,
                     hits: tuple[list[int], list[int]], prefills: list[Instance], decodes: list[Instance],
                     t0: float, overflow: bool = True) -> list[Choice]:
        """The policy's pairs for this request. With --admission-wait-ms a request no pair can serve yet is
        held and chosen again after each load poll, its TTFT target shrinking by the time it has waited,
        until a pair fits or waiting longer could not make the target (then Rejected, as at once)."""
        (cached, reused), priority, cfg = hits, req.priority, self.cfg
        wait_until = t0 + cfg.admission_wait_ms / 1e3
        while True:
            waited = time.perf_counter() - t0
            ttft_left = max(ttft_s - waited, 1e-6) if ttft_s else 0.0
            request = Request(len(ids), max_tokens, ttft_left, tpot_s, cached_by_prefill=cached,
                              cached_by_decode=reused, priority=priority, local_prefill_tokens=cfg.local_prefill_tokens,
                              overflow_prefill_tokens=cfg.overflow_prefill_tokens if overflow else 0)  # see plan
            try:
                return self.policy.choose(request, [x.view for x in prefills], [x.view for x in decodes])
            except Rejected:
                pause = self.cfg.load_interval
                if time.perf_counter() + pause > wait_until or (ttft_s and waited + pause >= ttft_s):
                    raise
                await asyncio.sleep(pause)

    @staticmethod
    async def _first_ok(pool: Pool, candidates: list[Instance], call: Callable[[Instance], Awaitable[T]],
                        retry_on: tuple[grpc.StatusCode, ...]) -> tuple[Instance, T]:
        """await call(instance) on each candidate in turn, failing over on `retry_on` codes (an
        instance that is down leaves the choice until its load poll succeeds again); raises the last
        error when none succeeds."""
        for i, inst in enumerate(candidates):
            try:
                with in_flight(inst):
                    return inst, await call(inst)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    inst.view.up = False
                if exc.code() in retry_on and i + 1 < len(candidates):
                    log.warning("%s: %s; trying the next instance", inst.address, exc.code().name)
                    metrics.FAILOVERS.labels(pool.kind).inc()
                    continue
                raise
        raise AssertionError("unreachable: a pool has at least one instance")


def _first_message(progress: Progress, first: internal_pb2.PrefillResponse | None) -> None:
    """What the client's first message carries: the prompt tokens the prefix cache held, and with prompt
    logprobs the prompt echoed (a local prefill's logprobs come on decode's first message instead)."""
    progress.cached = 0 if first is None else first.cached_prompt_tokens
    metrics.TOKENS.labels("router", "cached_prompt").inc(progress.cached)
    if progress.request.sampling.prompt_logprobs is not None:
        progress.echo = PromptEcho(list(progress.request.prompt_token_ids),
                                   [] if first is None else list(first.prompt_logprobs))
    else:
        progress.echo = None


class PeerFrameError(RuntimeError):
    """An instance's answer that no instance of this version sends (a frame is hostile, even a peer's)."""


def finish_of(msg: internal_pb2.DecodeResponse, address: str) -> FinishReason | None:
    """The hop's finish reason; an unknown word fails the request (INTERNAL, naming the field), never reaches
    the client."""
    try:
        return FinishReason.from_wire(msg.finish_reason)
    except ValueError:
        raise PeerFrameError(f"decode instance {address}: finish_reason {msg.finish_reason[:40]!r} is not a "
                             f"finish reason") from None


def _response(msg: internal_pb2.DecodeResponse, progress: Progress,
              reason: FinishReason | None) -> generation_pb2.GenerateResponse:
    """Decode's message as the client's: the text through the reply parser, the API's finish reason, and on
    the first message the echoed prompt (with prompt logprobs)."""
    piece = progress.reply.feed(msg.text, final=reason is not None)
    out = generation_pb2.GenerateResponse(token_ids=msg.token_ids, text=piece.content, reasoning_text=piece.reasoning,
                                          finish_reason=api_finish_reason(reason, progress.reply.called),
                                          request_id=progress.request.request_id, logprobs=msg.logprobs)
    for delta, call_id in zip(piece.tool_calls, piece.ids, strict=True):
        out.tool_calls.add(index=delta.index, id=call_id, name=delta.name, arguments_delta=delta.arguments_delta)
    if progress.echo is not None:
        out.prompt_token_ids.extend(progress.echo.ids)
        out.prompt_logprobs.extend(msg.prompt_logprobs or progress.echo.logprobs)
        progress.echo = None
    return out


def _cause(exc: grpc.RpcError) -> str:
    """Why a try failed, as the migrations metric counts it."""
    details = (exc.details() or "").lower()
    if details.startswith("request fault"):  # shared.engine.isolation.REQUEST_FAULT: it alone failed an engine step
        return "request_fault"
    if "draining" in details:
        return "drain"
    if "kv push" in details or "kv receiver" in details:
        return "kv_transfer"
    return {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.INTERNAL: "engine_error"}.get(
        exc.code(), exc.code().name.lower())


def _map_code(code: grpc.StatusCode, cause: str = "") -> grpc.StatusCode:
    """Peer failures surface as UNAVAILABLE; the peer's own verdicts pass through (a request fault: INTERNAL)."""
    passthrough = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
    return code if code in passthrough or cause == "request_fault" else grpc.StatusCode.UNAVAILABLE


__all__ = ["GenerationServicer", "MIGRATABLE", "PEER_TIMEOUT"]
