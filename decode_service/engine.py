"""Rank 0's side of a decode instance: its engine core (`DecodeEngineCore`: places reservations on the
least loaded rank, keeps every rank's load, streams the events), run on a thread of the gRPC process
(--engine-in-process) or in its own process (shared.engine.process). The gRPC server holds one
`DecodeEngineClient` either way (`start_engine`): the same typed commands (ToRank, Reserve) and notices
(EventsNotice, LoadsNotice) cross an in-process or a process link. With one rank there are no
collectives and the core is a plain engine loop.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from decode_service.worker import Abort, Admit, DecodeRankReport, DecodeWorker, Event, Release, Reserve
from shared import metrics
from shared.config import DecodeConfig
from shared.engine import SamplingParams
from shared.engine.core import (
    ALL,
    CommandError,
    EngineCommand,
    EngineCore,
    RankCommand,
    RankReport,
    Reply,
)
from shared.engine.process import CoreConnection, CoreLink, CoreProcess, Fatal, InProcessLink, Ready, StartFailed
from shared.kvcache.event_log import CacheEventLog, KvEventsNotice, RankKvEvents
from shared.parallel.launch import service_state
from shared.protocol.finish import FinishReason
from shared.protocol.limits import RequestLimits
from shared.protocol.load import LoadReport, RankLoad
from shared.protocol.placement import least_loaded_rank
from shared.protocol.tokenizer import OutputProcessor, Tokenizer
from shared.rpc.service import LoopQueue, freeze_startup_heap, leave_stop_signals_to_front
from shared.transfer import Destination

log = logging.getLogger("pdserve.decode")
FATAL = object()  # put in every stream when the engine loop dies: the handlers end with UNAVAILABLE
DRAINING = object()  # put in every stream on SIGTERM: the handlers end with UNAVAILABLE, the router moves them
# after every loop turn: every rank's load, the lease ids that expired, the step's seconds (None: idle)
ReportHook = Callable[[list[DecodeRankReport], list[str], float | None], None]
KvEventsHook = Callable[[KvEventsNotice], None]  # after a turn with prefix-cache events: each rank's new ones


@dataclass(frozen=True)
class Placement:
    """Where a reservation landed: the rank that holds its lease, and where the prefill pushes."""

    rank: int
    destination: Destination

    @property
    def restored_blocks(self) -> int:
        """Of the lease's reused blocks, those its rank read back from its second KV tier (host hits)."""
        return self.destination.restored_blocks


@dataclass(frozen=True)
class ToRank:
    """Front → core process: queue `command` for rank `rank` (DecodeEngineCore.submit)."""

    command: EngineCommand
    rank: int = 0


@dataclass(frozen=True)
class EventsNotice:
    """Core process → front, per step with events: the token events the front's streams take."""

    events: list[Event]

    def __reduce__(self) -> tuple:
        """Pickled as columns, not as an object per event (~1.5 µs each way per event: 0.2 ms a 64-request step,
        the core's part of it on the step's path); the rare logprobs and errors ride by position."""
        evs = self.events
        rare = {i: (e.error, e.logprob, e.prompt_logprobs) for i, e in enumerate(evs)
                if e.error or e.logprob is not None or e.prompt_logprobs is not None}
        return (_events_notice, ([e.request_id for e in evs], [e.token_id for e in evs], [e.finished for e in evs],
                                 [e.finish_reason for e in evs], rare))


def _events_notice(ids: list[str], tokens: list[int], finished: list[bool], reasons: list[FinishReason | None],
                   rare: dict[int, tuple]) -> EventsNotice:
    return EventsNotice([Event(rid, tok, fin, reason, *rare.get(i, ()))
                         for i, (rid, tok, fin, reason) in enumerate(zip(ids, tokens, finished, reasons))])


@dataclass(frozen=True)
class LoadsNotice:
    """Core process → front, per turn: every rank's load, the leases that expired, the step's length."""

    loads: list[DecodeRankReport]
    expired: list[str]
    step_seconds: float | None


@dataclass(frozen=True)
class DecodeFacts:
    """What the engine-core process tells its front at start."""

    limits: RequestLimits
    transport: str
    loads: list[DecodeRankReport]


class Streams:
    """Request id → event sink (anything with a thread-safe `put`) of the streams being served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, Any] = {}

    def open(self, request_id: str, q: Any = None) -> Any:
        """Register the sink of a new stream (a queue.Queue by default) and return it; a request id
        already streaming is refused (KeyError), and the stream that has it is not touched."""
        q = queue.Queue() if q is None else q
        with self._lock:
            if request_id in self._sinks:
                raise KeyError(request_id)
            self._sinks[request_id] = q
        return q

    def close(self, request_id: str, q: Any = None) -> None:
        """End a stream (only `q` when given: a refused duplicate never closes the stream it collided with)."""
        with self._lock:
            if q is not None and self._sinks.get(request_id) is not q:
                return
            q = self._sinks.pop(request_id, None)
        if q is not None:
            q.put(None)

    def dispatch(self, events: list[Event]) -> None:
        """A step's events to their streams, in one hand-over to the serving event loop."""
        out = []
        with self._lock:
            for ev in events:
                q = self._sinks.get(ev.request_id)
                if q is not None:
                    out.append((q, ev))
                    if ev.finished:
                        del self._sinks[ev.request_id]
                        out.append((q, None))
        LoopQueue.put_all(out)

    def fail_all(self) -> None:
        """The engine died: every stream ends with UNAVAILABLE."""
        self.end_all(FATAL)

    def end_all(self, reason: object) -> int:
        """Every open stream gets `reason` (FATAL, DRAINING) and is forgotten; how many there were."""
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for q in sinks:
            q.put(reason)
        return len(sinks)


class DecodeEngineCore(EngineCore):
    """Rank 0's engine core: places reservations, keeps every rank's load, streams the events. `sink`
    (default: the streams served here) gets every step's events; `on_report` every turn's loads;
    `on_kv_events` (a core process's front) every turn's prefix-cache events of every rank, which
    `kv_events` (the instance's log, per rank) records here too (`prefix_blocks_by_rank`)."""

    def __init__(self, me: DecodeWorker, sink: Callable[[list[Event]], None] | None = None,
                 on_report: ReportHook | None = None, on_fatal: Callable[[str], None] | None = None,
                 on_kv_events: KvEventsHook | None = None):
        super().__init__(me, me.state, "dp-coordinator", on_fatal)
        self.me, self.mirror = me, me.mirror
        self.kv_events = CacheEventLog(published=True)
        self.on_kv_events = on_kv_events
        blocks = me.engine.kv.num_blocks
        first = me.load()
        self._publish([RankKvEvents(0, first.kv_events)] if first.kv_events else [])
        self.loads: list[DecodeRankReport] = [replace(first, kv_events=[])] + [
            DecodeRankReport(RankLoad(r, free_blocks=blocks, total_blocks=blocks)) for r in range(1, self.world)]
        self.lease_rank: dict[str, int] = {}
        self._unreported: list[list[tuple[int, int]]] = [[] for _ in range(self.world)]  # (cid, tokens)
        self._place_lock = threading.Lock()
        self._admitted = me.names  # admit command id → request id (events travel as ints)
        self._admit_cid: dict[str, int] = {}
        self.streams = Streams()
        self.sink = sink or self.streams.dispatch
        self.on_report = on_report
        engine = me.engine
        self.limits = engine.limits
        self.output_processor = engine.output_processor
        self.start()

    # -- API for gRPC handlers ---------------------------------------------------------------------
    def submit(self, command: EngineCommand, rank: int = 0) -> Future:
        refused = self._refusal(command)
        if refused is not None:
            return refused
        command, rank = self._addressed(command, rank)
        return super().submit(command, rank)

    def _refusal(self, command: EngineCommand) -> Future | None:
        """TP mirror: an admit whose lease rank 0 does not hold complete is refused before every rank
        applies it (the other ranks get their KV from rank 0)."""
        if self.mirror and isinstance(command, Admit) and not command.local \
                and not self.me.leases.is_complete(command.lease_id):
            fut: Future = Future()
            fut.set_exception(CommandError("FAILED_PRECONDITION",
                                           f"lease {command.lease_id!r} is unknown, expired or incomplete"))
            return fut
        return None

    def _addressed(self, command: EngineCommand, rank: int) -> tuple[EngineCommand, int]:
        """TP mirror: every command goes to every rank, a reservation with one lease id and token."""
        if not self.mirror:
            return command, rank
        if isinstance(command, Reserve):
            command = replace(command, lease_id=uuid.uuid4().hex, token=secrets.token_bytes(16))
        return command, ALL

    def queued(self, cmd: RankCommand) -> None:
        """Name an admit's events before any rank can step it; forget an aborted one's name."""
        c = cmd.command
        if isinstance(c, Admit):
            self._admitted[cmd.cid], self._admit_cid[c.request_id] = c.request_id, cmd.cid
        elif isinstance(c, Abort):  # events of an aborted request may be dropped from here on
            self._admitted.pop(self._admit_cid.pop(c.request_id, -1), None)

    def reserve(self, request_id: str, tokens: int, prompt_tokens: int | None = None,
                prefix: tuple[bytes, ...] = ()) -> Future:
        """Place a reservation on the least loaded DP rank by tokens (running contexts + leases);
        the Future yields a Placement. Reservations not yet visible in a rank's load report are
        counted too, so a burst of them spreads over the ranks."""
        with self._place_lock:
            rank = 0 if self.mirror else self._place(tokens, prefix)
            command, to = self._addressed(Reserve(request_id, tokens, prompt_tokens, prefix=prefix), rank)
            sent = self.dispatch(command, to)
            self._unreported[rank].append((sent.cid, tokens))
        return _then(sent.future, lambda dest: Placement(rank, dest))

    def _place(self, tokens: int, prefix: tuple[bytes, ...]) -> int:
        """The least loaded DP rank, unless a rank caches more of the prompt's prefix and is loaded by at most
        this request's tokens more (a shared system prompt must not pile every request onto one rank)."""
        pending = [sum(t for _, t in self._unreported[r]) for r in range(self.world)]
        load = [r.load.tokens + p for r, p in zip(self.loads, pending)]
        rank = least_loaded_rank(load, [r.load.running for r in self.loads])
        if prefix and self.world > 1:
            hits = self.prefix_blocks_by_rank(list(prefix))
            near = [r for r in range(self.world) if load[r] <= load[rank] + tokens]
            best = max(near, key=lambda r: (hits[r], -load[r], -r))
            if hits[best] > hits[rank]:
                return best
        return rank

    def open_stream(self, request_id: str, q: Any = None) -> Any:
        return self.streams.open(request_id, q)

    def close_stream(self, request_id: str, q: Any = None) -> None:
        self.streams.close(request_id, q)

    def handle(self, command: ToRank | Reserve) -> Future:
        """A front's command from its process (shared.engine.process): ToRank (a command for a rank) or
        Reserve (placed here on the least loaded rank: a Future of its Placement)."""
        if isinstance(command, ToRank):
            return self.submit(command.command, command.rank)
        if isinstance(command, Reserve):
            return self.reserve(command.request_id, command.num_tokens, command.prompt_tokens, command.prefix)
        raise TypeError(f"a decode engine core takes ToRank or Reserve, not {type(command).__name__}")

    # -- the engine core's hooks -----------------------------------------------------------------------
    def busy(self) -> bool:
        return any(load.has_work for load in self.loads)

    def turn_commands(self, cmds: list[RankCommand]) -> list[RankCommand]:
        """TP mirror: overdue leases become release commands applied by every rank in order."""
        if not self.mirror:
            return cmds
        for lease_id in self.me.leases.overdue():
            self.lease_rank.pop(lease_id, None)
            cmds.append(RankCommand(Release(lease_id), ALL, self.next_cid()))
        return cmds

    def idle(self) -> None:
        self.me.leases.expire()
        load = self.me.load()
        self._publish([RankKvEvents(0, load.kv_events)] if load.kv_events else [])
        self._report([self._absorb(0, load)], None)

    def after_turn(self, reports: list[RankReport], step_seconds: float) -> None:
        expired = []
        self._publish([RankKvEvents(rank, r.load.kv_events) for rank, r in enumerate(reports)
                       if r.load.kv_events and not (self.mirror and rank)])  # a mirror caches what rank 0 does
        for rank, report in enumerate(reports):
            if self.mirror and rank:  # mirrors repeat rank 0: their replies and events are dropped
                self.loads[rank] = replace(report.load, expired=[], kv_events=[])
                continue
            expired.append(self._absorb(rank, report.load))
            for reply in report.replies:
                self.resolve(reply)
            self._forget_finished(report.events)
            self.sink(report.events)
        self._report(expired, step_seconds)

    def _publish(self, ranks: list[RankKvEvents]) -> None:
        """The ranks' new prefix-cache events into the instance's log (and to a core process's front)."""
        if not ranks:
            return
        notice = KvEventsNotice(ranks)
        self.kv_events.apply(notice)
        if self.on_kv_events is not None:
            self.on_kv_events(notice)

    def prefix_blocks_by_rank(self, hashes: list[bytes]) -> list[int]:
        """Per DP rank, how many leading blocks of `hashes` (a prompt's prefix-cache keys) its device pool
        caches, by the events its reports carried (a TP mirror: rank 0's, for every rank)."""
        if self.mirror:
            return self.kv_events.leading_blocks(hashes, 1) * self.world
        return self.kv_events.leading_blocks(hashes, self.world)

    def resolve(self, reply: Reply) -> None:
        if isinstance(reply.value, list):  # admit: deliver the first token before the caller streams
            self._forget_finished(reply.value)
            self.sink(reply.value)
        elif isinstance(reply.value, CommandError):
            self._admit_cid.pop(self._admitted.pop(reply.cid, ""), None)
        super().resolve(reply)

    def on_failure(self, exc: BaseException) -> None:
        log.error("decode coordinator loop failed: %s", exc)
        self.streams.fail_all()

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _forget_finished(self, events: list[Event]) -> None:
        for ev in events:
            if ev.finished:
                self._admitted.pop(self._admit_cid.pop(ev.request_id, -1), None)

    def _absorb(self, rank: int, load: DecodeRankReport) -> list[str]:
        """Take a rank's load report; forget the routing of its expired leases (returned)."""
        expired = load.expired
        for lease_id in expired:
            self.lease_rank.pop(lease_id, None)
        with self._place_lock:
            self._unreported[rank] = [(c, t) for c, t in self._unreported[rank] if c > load.applied_cid]
        self.loads[rank] = replace(load, expired=[], kv_events=[])
        return expired

    def _report(self, expired_per_rank: list[list[str]], step_seconds: float | None) -> None:
        expired = [lease for per_rank in expired_per_rank for lease in per_rank]
        if self.on_report is not None:
            self.on_report(self.loads, expired, step_seconds)
            return
        metrics.EXPIRED_LEASES.inc(len(expired))
        if step_seconds is not None:
            metrics.STEP_SECONDS.observe(step_seconds)


def instance_load(reports: list[DecodeRankReport], block_size: int) -> LoadReport:
    """The instance's load as the router reads it: every rank's numbers."""
    return LoadReport(tuple(r.load for r in reports), block_size)


def _then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A Future of fn(fut's result) (its exception passes through)."""
    out: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(fn(f.result()))

    fut.add_done_callback(done)
    return out


def build_engine_core(cfg: DecodeConfig, sink: Callable[[list[Event]], None] | None = None,
                      on_report: ReportHook | None = None, on_fatal: Callable[[str], None] | None = None,
                      on_kv_events: KvEventsHook | None = None) -> DecodeEngineCore:
    """Rank 0's worker and its engine core."""
    worker = DecodeWorker(cfg, 0, service_state(cfg.parallel(), 0, cfg.cpu_threads))
    return DecodeEngineCore(worker, sink, on_report, on_fatal, on_kv_events)


# -- the core in its own process ------------------------------------------------------------------------
def core_main(cfg: DecodeConfig, conn: Connection) -> None:
    """Entry point of the engine-core process: rank 0's engine, its coordinator loop, its KV receiver;
    per loop turn it sends the front one message with the step's events and one with the loads."""
    leave_stop_signals_to_front()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode-core %(levelname)s %(message)s", force=True)
    front = CoreConnection(conn)
    try:
        core = build_engine_core(
            cfg, sink=lambda events: front.send(EventsNotice(events)) if events else None,
            on_report=lambda loads, expired, seconds: front.send(LoadsNotice(loads, expired, seconds)),
            on_fatal=lambda reason: front.send(Fatal(reason)), on_kv_events=front.send)
    except Exception as exc:  # reported to the front, which fails its start
        front.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()  # this process lives as long as its engine
    front.send(Ready(DecodeFacts(core.limits, core.me.receiver.transport, core.loads)))
    try:
        front.serve(core.handle)
    finally:
        core.stop()


class DecodeEngineClient:
    """The decode front's one handle on its engine core, wherever the core runs (`link`: in this process or
    its own, see `start_engine`): typed commands in; the streams, lease routing, every rank's latest load
    and detokenization stay here, fed by the core's notices; `kv_events`, every rank's prefix-cache events
    (the KvEvents stream's log; in process, the core's own)."""

    def __init__(self, link: CoreLink, facts: DecodeFacts, tokenizer: Tokenizer | None,
                 lease_rank: dict[str, int] | None = None, kv_events: CacheEventLog | None = None):
        self.link = link
        self.kv_events = kv_events or CacheEventLog(published=True)
        self.streams = Streams()
        self.lease_rank: dict[str, int] = {} if lease_rank is None else lease_rank  # lease id → the rank holding it
        self.loads = facts.loads
        self.limits, self.transport = facts.limits, facts.transport  # limits: what one request may ask of a rank
        self._tokenizer = tokenizer

    def output_processor(self, params: SamplingParams) -> OutputProcessor:
        return OutputProcessor(self._tokenizer, params.stop, params.skip_special_tokens)

    def submit(self, command: EngineCommand, rank: int = 0) -> Future:
        return self.link.call(ToRank(command, rank))

    def reserve(self, request_id: str, tokens: int, prompt_tokens: int | None = None,
                prefix: tuple[bytes, ...] = ()) -> Future:
        """Placed on the least loaded rank by the core; the Future yields a Placement."""
        return self.link.call(Reserve(request_id, tokens, prompt_tokens, prefix=prefix))

    def open_stream(self, request_id: str, q: Any = None) -> Any:
        return self.streams.open(request_id, q)

    def close_stream(self, request_id: str, q: Any = None) -> None:
        self.streams.close(request_id, q)

    def on_message(self, msg: object) -> None:
        if isinstance(msg, EventsNotice):
            self.streams.dispatch(msg.events)
        elif isinstance(msg, LoadsNotice):
            self.loads = msg.loads
            for lease_id in msg.expired:
                self.lease_rank.pop(lease_id, None)
            metrics.EXPIRED_LEASES.inc(len(msg.expired))
            if msg.step_seconds is not None:
                metrics.STEP_SECONDS.observe(msg.step_seconds)
        elif isinstance(msg, KvEventsNotice):
            self.kv_events.apply(msg)

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self.link.set_fatal_handler(handler)

    def stop(self) -> None:
        self.link.stop()


def start_engine(cfg: DecodeConfig, start_timeout: float = 900.0) -> DecodeEngineClient:
    """The front's client of a new engine core: on a thread here (--engine-in-process) or in its own process."""
    if not cfg.engine_in_process:
        proc = CoreProcess(core_main, cfg, "decode engine core", start_timeout)
        client = DecodeEngineClient(proc, proc.facts, Tokenizer.from_model_dir(cfg.model, None))
        proc.listen(client.on_message, on_lost=lambda reason: client.streams.fail_all())
        return client
    core = build_engine_core(cfg)
    link = InProcessLink(core)
    # the core's lease routing is the front's (a mirror group's overdue leases are forgotten there)
    client = DecodeEngineClient(link, DecodeFacts(core.limits, core.me.receiver.transport, core.loads),
                                core.me.engine.tokenizer, core.lease_rank, core.kv_events)
    link.listen(client.on_message, on_lost=lambda reason: client.streams.fail_all())
    core.sink = lambda events: link.notify(EventsNotice(events)) if events else None  # as a core process sends
    core.on_report = lambda loads, expired, seconds: link.notify(LoadsNotice(loads, expired, seconds))
    return client
