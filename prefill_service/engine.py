"""Rank 0's side of a prefill instance: its engine core (`PrefillEngineCore`: prompts in, results out,
for every shape), run on a thread of the gRPC process (--engine-in-process) or in its own process
(shared.engine.process). The gRPC server holds one `PrefillEngineClient` either way (`start_engine`):
the same typed commands (AddPrompt, DropPrompt) and load notices cross an in-process or a process link.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

from prefill_service.fetch import FETCH_COMMANDS, FetchEndpoint, PushCachedBlocks, fetch_endpoint
from prefill_service.worker import AddPrompt, DropPrompt, PrefillOutcome, PrefillWorker, sender_factory
from shared import metrics
from shared.config import PrefillConfig
from shared.engine import LLMEngine, SamplingParams
from shared.engine.core import ALL, EngineCommand, EngineCore, RankReport
from shared.engine.process import CoreConnection, CoreLink, CoreProcess, Fatal, InProcessLink, Ready, StartFailed
from shared.kvcache.event_log import CacheEventLog, KvEventsNotice, listen_to
from shared.parallel.launch import service_state
from shared.protocol.limits import RequestLimits
from shared.protocol.load import LoadReport, RankLoad
from shared.rpc.service import freeze_startup_heap, leave_stop_signals_to_front
from shared.transfer import Destination, KVSender

log = logging.getLogger("pdserve.prefill")
ReportHook = Callable[[LoadReport, int], None]  # after every turn: the instance's load, tokens the step computed
KvEventsHook = Callable[[KvEventsNotice], None]  # after a turn with prefix-cache events: rank 0's new ones


@dataclass(frozen=True)
class PrefillFacts:
    """What the engine-core process tells its front at start."""

    limits: RequestLimits
    load: LoadReport


@dataclass(frozen=True)
class LoadNotice:
    """Core process → front, per turn: the instance's load and the step's prompt tokens."""

    load: LoadReport
    batch_tokens: int


def record_report(load: LoadReport, batch_tokens: int) -> LoadReport:
    """A turn's report taken in: the batch size metric; the load is what the front keeps."""
    if batch_tokens:
        metrics.BATCH_TOKENS.observe(batch_tokens)
    return load


class PrefillEngineCore(EngineCore):
    """Rank 0: prompts in, PrefillResults out, for every shape; builds its own PrefillWorker, whose
    answers and later commands it routes. `on_report` (default: keep it here, for `load()`) gets every
    turn's load; `on_kv_events` (default: into `kv_events` here) every turn's new prefix-cache events of
    rank 0's pool (the instance's cache: a CP or TP group's ranks cache the same blocks)."""

    def __init__(self, engine: LLMEngine, make_sender: Callable[[str], KVSender],
                 on_report: ReportHook | None = None, on_fatal: Callable[[str], None] | None = None,
                 on_kv_events: KvEventsHook | None = None, fetch: FetchEndpoint | None = None):
        self._to = ALL if engine.policy.mirror else 0  # mirrored ranks all apply every command
        self.worker = PrefillWorker(engine, make_sender, on_done=self._done, later=self._later, fetch=fetch)
        super().__init__(self.worker, engine.parallel, "prefill-engine", on_fatal)
        self._results: dict[str, Future] = {}
        self.limits = engine.limits
        self.latest_load = self._report(self.worker.load())
        self.on_report: ReportHook = on_report or self._record
        self.rank_events = listen_to(engine.kv)  # rank 0's pool and second tier, drained every turn
        self.kv_events = CacheEventLog(published=True)  # the instance's log (in process: the front's too)
        self.on_kv_events: KvEventsHook = on_kv_events or self.kv_events.apply
        self.start()

    def load(self) -> LoadReport:
        return self.latest_load

    def after_turn(self, reports: list[RankReport], step_seconds: float) -> None:
        super().after_turn(reports, step_seconds)
        self.on_report(self._report(reports[0].load), self.worker.batch_tokens)  # rank 0's turn report
        self._send_kv_events()

    def idle(self) -> None:
        self._send_kv_events()  # a cache change off a turn (a second tier's) reaches the routers too

    def _send_kv_events(self) -> None:
        new = self.rank_events.drain()
        if new is not None:
            self.on_kv_events(KvEventsNotice([new]))

    def _report(self, load: RankLoad) -> LoadReport:
        """Rank 0's load as the instance's (its ranks share one schedule)."""
        return LoadReport((load,), self.worker.engine.layout.block_size)

    def _record(self, load: LoadReport, batch_tokens: int) -> None:
        self.latest_load = record_report(load, batch_tokens)

    def _later(self, command: EngineCommand) -> None:
        self.submit(command, self._to)

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination,
                priority: int = 0, num_resumed: int = 0, cache_salt: str = "") -> Future:
        """Queue a prompt its front validated (`limits`), whose KV goes to `dest` (ahead of less urgent ones:
        lower `priority` first); the Future yields a PrefillResult, or fails with ValueError (a constraint
        that does not compile) or TransferError (bad destination, failed push). Raises ValueError at once
        for a request id already in flight."""
        if request_id in self._results:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        done: Future = Future()
        self._results[request_id] = done
        self.submit(AddPrompt(request_id, prompt, params, dest, priority, num_resumed, cache_salt), self._to)
        return done

    def cancel(self, request_id: str, reason: BaseException) -> None:
        """Drop a prompt (the caller went away); its blocks and push are released on every rank."""
        self.submit(DropPrompt(request_id, reason), self._to)

    def fetch_step(self, command: EngineCommand) -> Future:
        """A step of a cross-instance fetch (prefill_service.fetch), on rank 0's pool: OpenFetch → its FetchPlan,
        AdoptFetch → the blocks adopted, PushCachedBlocks → CachedPushed once its push ended."""
        if isinstance(command, PushCachedBlocks):
            done: Future = Future()
            self._results[command.fetch_id] = done
            self.submit(command, 0)
            return done
        return self.submit(command, 0)

    def handle(self, command: EngineCommand) -> Future | None:
        """A front's command from its process (shared.engine.process): AddPrompt (a Future of its
        outcome), DropPrompt, or a fetch's step."""
        if isinstance(command, FETCH_COMMANDS):
            return self.fetch_step(command)
        if isinstance(command, AddPrompt):
            return self.prefill(command.request_id, command.prompt, command.params, command.dest,
                                command.priority, command.num_resumed, command.cache_salt)
        if isinstance(command, DropPrompt):
            self.cancel(command.request_id, command.error or RuntimeError("cancelled"))
            return None
        raise TypeError(f"a prefill engine core takes AddPrompt or DropPrompt, not {type(command).__name__}")

    def _done(self, request_id: str, outcome: PrefillOutcome) -> None:
        fut = self._results.pop(request_id, None)
        if fut is None or fut.done():
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def on_failure(self, exc: BaseException) -> None:
        for rid in list(self._results):
            self._done(rid, RuntimeError(f"prefill engine failed: {exc}"))


def build_engine_core(cfg: PrefillConfig, on_report: ReportHook | None = None,
                      on_fatal: Callable[[str], None] | None = None,
                      on_kv_events: KvEventsHook | None = None) -> PrefillEngineCore:
    """Rank 0's engine and loop."""
    engine = LLMEngine(cfg.engine_config(), service_state(cfg.parallel(), 0, cfg.cpu_threads))
    return PrefillEngineCore(engine, sender_factory(cfg, engine), on_report, on_fatal, on_kv_events,
                             fetch_endpoint(cfg))


# -- the core in its own process ------------------------------------------------------------------------
def core_main(cfg: PrefillConfig, conn: Connection) -> None:
    """Entry point of the engine-core process: rank 0's engine, its loop and its KV pushes."""
    leave_stop_signals_to_front()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill-core %(levelname)s %(message)s", force=True)
    front = CoreConnection(conn)
    try:
        core = build_engine_core(cfg, on_report=lambda load, batch_tokens: front.send(LoadNotice(load, batch_tokens)),
                                 on_fatal=lambda reason: front.send(Fatal(reason)), on_kv_events=front.send)
    except Exception as exc:  # reported to the front, which fails its start
        front.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_heap()  # this process lives as long as its engine
    front.send(Ready(PrefillFacts(core.limits, core.load())))
    try:
        front.serve(core.handle)
    finally:
        core.stop()


class PrefillEngineClient:
    """The prefill front's one handle on its engine core, wherever the core runs (`link`: in this
    process or its own, see `start_engine`): typed commands in, the load the core reports after every
    turn kept here, and the instance's prefix-cache event log the KvEvents stream serves (`kv_events`)."""

    def __init__(self, link: CoreLink, facts: PrefillFacts, kv_events: CacheEventLog | None = None):
        self.link = link
        self.limits, self.latest_load = facts.limits, facts.load
        self.kv_events = kv_events or CacheEventLog(published=True)

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination,
                priority: int = 0, num_resumed: int = 0, cache_salt: str = "") -> Future:
        """A validated prompt whose KV goes to `dest`: a Future of its PrefillResult (PrefillEngineCore.prefill)."""
        return self.link.call(AddPrompt(request_id, prompt, params, dest, priority, num_resumed, cache_salt))

    def cancel(self, request_id: str, reason: BaseException) -> None:
        self.link.call(DropPrompt(request_id, reason))

    def fetch_step(self, command: EngineCommand) -> Future:
        """A step of a cross-instance fetch (PrefillEngineCore.fetch_step)."""
        return self.link.call(command)

    def load(self) -> LoadReport:
        return self.latest_load

    def on_message(self, msg: object) -> None:
        if isinstance(msg, LoadNotice):
            self.latest_load = record_report(msg.load, msg.batch_tokens)
        elif isinstance(msg, KvEventsNotice):
            self.kv_events.apply(msg)

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self.link.set_fatal_handler(handler)

    def stop(self) -> None:
        self.link.stop()


def start_engine(cfg: PrefillConfig, start_timeout: float = 900.0) -> PrefillEngineClient:
    """The front's client of a new engine core: on a thread here (--engine-in-process) or in its own process."""
    if not cfg.engine_in_process:
        proc = CoreProcess(core_main, cfg, "prefill engine core", start_timeout)
        client = PrefillEngineClient(proc, proc.facts)
        proc.listen(client.on_message)
        return client
    core = build_engine_core(cfg)
    link = InProcessLink(core)
    client = PrefillEngineClient(link, PrefillFacts(core.limits, core.load()), core.kv_events)  # the same log
    link.listen(client.on_message)
    core.on_report = lambda load, batch_tokens: link.notify(LoadNotice(load, batch_tokens))  # as a process sends
    return client
