"""The one engine-core loop every instance runs, whatever its shape or service.

Each turn rank 0 drains the commands that serving threads handed over (`submit`), shares them with
the other ranks of its instance, every rank applies those addressed to it (`RankCommand.rank`, or `ALL`)
and takes one step, and rank 0 takes the ranks' reports (replies, token events, load). What differs
between instance shapes is the step policy (shared.engine.policy: Solo, LockStep, Mirror,
ContextSplit); what differs between services is the `RankDriver` (what a command and a step do:
prefill pushes KV, decode streams tokens) and its `EngineCommand` dataclasses. Subclasses on rank 0
add what the service's front needs (futures for prefill results, placement and loads for decode) and
`handle` the front's typed commands; each gRPC server holds one client of its core, in-process or in
the core's own process alike (shared.engine.process).

The per-turn collectives move fixed-size tensors: the commands' byte count (the pickled commands
only follow on turns that carry some), and under lock-step a fixed row per rank (load and token
events); objects are pickled only for turns with replies or rare events.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shared.parallel.state import ParallelState

log = logging.getLogger("pdserve.engine")
ALL = -1  # RankCommand.rank of a command every rank applies (mirrored instances)
_STOP = -1  # the command byte count that ends the followers' loops
IDLE_TICK_SECONDS = 0.05  # an idle rank 0 turns this often (lease expiry; followers' heartbeat)


@dataclass(frozen=True)
class EngineCommand:
    """Base of what serving threads ask an engine's ranks to do; each service declares its commands
    as dataclasses (prefill_service.worker, decode_service.worker) and its driver dispatches on type."""


@dataclass
class RankCommand:
    """A command in flight: the rank that applies it (`ALL`: every rank) and its id (its reply's key)."""

    command: EngineCommand
    rank: int
    cid: int


@dataclass
class Reply:
    """A rank's answer to the command `cid` (a value, or a CommandError the Future raises)."""

    cid: int
    value: Any


@dataclass
class Submitted:
    """A queued command's id (load reports say which commands they include) and its reply's Future."""

    cid: int
    future: Future


class CommandError(Exception):
    """A command failed on its rank; `code` names the gRPC status the front should return."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple:  # crosses process pipes intact
        return CommandError, (self.code, str(self))


@dataclass
class RankReport:
    """One rank's turn: replies to its commands, the step's events, its load (the driver's dataclass)."""

    replies: list[Reply]
    events: list[Any]
    load: Any


@dataclass
class EncodedReport:
    """A report as it travels: a fixed-size int64 row, and rare objects (None: none this turn)."""

    row: torch.Tensor
    extra: Any = None


class RankDriver(Protocol):
    """A service's work on one rank."""

    gathers: bool  # rank 0 wants every rank's report each turn (else its own stands for the instance)

    def apply(self, cmd: RankCommand) -> Any: ...
    def step(self) -> list[Any]: ...
    def load(self) -> Any: ...
    def close(self) -> None: ...


class GatheringDriver(RankDriver, Protocol):
    """A driver whose reports travel to rank 0 every turn (`gathers` true): it says how a report
    becomes a fixed-size row plus rare objects, and back."""

    def encode(self, report: RankReport) -> EncodedReport: ...
    def decode(self, encoded: EncodedReport) -> RankReport: ...


class RankLink:
    """The per-turn collectives of one instance."""

    def __init__(self, state: ParallelState):
        self.state, self.rank, self.world = state, state.rank, state.world

    def share(self, cmds: list[RankCommand] | None) -> list[RankCommand] | None:
        """Rank 0 passes this turn's commands (None: stop); every rank gets them (None: stop)."""
        if self.world == 1:
            return cmds
        payload = b"" if not cmds else pickle.dumps(cmds)
        size = torch.tensor([_STOP if cmds is None else len(payload)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.state.world_group)
        n = int(size.item())
        if n == _STOP:
            return None
        if n == 0:
            return []
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else torch.empty(
            n, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.state.world_group)
        return cmds if self.rank == 0 else pickle.loads(buf.numpy().tobytes())  # rank 0 of this instance

    def collect(self, driver: RankDriver, report: RankReport) -> list[RankReport] | None:
        """Every rank's report on rank 0 (None elsewhere). Fixed rows are all-gathered, so every
        rank knows whether any rank has objects to send, and only then are objects gathered."""
        if self.world == 1:
            return [report]
        if not driver.gathers:
            return [report] if self.rank == 0 else None
        encoded = driver.encode(report)  # type: ignore[attr-defined] - gathers: a GatheringDriver
        extra = encoded.extra
        row = torch.cat([torch.tensor([int(extra is not None)], dtype=torch.int64), encoded.row])
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.state.world_group)
        extras: list[Any] = [None] * self.world
        if any(int(r[0]) for r in rows):
            dist.gather_object(extra, extras if self.rank == 0 else None, dst=0, group=self.state.world_group)
        if self.rank:
            return None
        return [driver.decode(EncodedReport(r[1:], x)) for r, x in zip(rows, extras)]  # type: ignore[attr-defined]


def take_turn(driver: RankDriver, link: RankLink, cmds: list[RankCommand],
              on_reply: Callable[[Reply], None] | None = None) -> list[RankReport] | None:
    """Apply this rank's commands, step, report. `on_reply` (rank 0) answers its own replies before
    the step, so an admitted request's first token goes out before the token the step adds."""
    replies = []
    for cmd in cmds:
        if cmd.rank in (link.rank, ALL):
            reply = Reply(cmd.cid, driver.apply(cmd))
            if on_reply is not None:
                on_reply(reply)
            else:
                replies.append(reply)
    events = driver.step()
    return link.collect(driver, RankReport(replies, events, driver.load()))


def follow(driver: RankDriver, state: ParallelState) -> None:
    """Ranks 1..N-1: take turns with rank 0 until it stops the instance."""
    link = RankLink(state)
    try:
        while (cmds := link.share([])) is not None:
            take_turn(driver, link, cmds)
    finally:
        driver.close()


class EngineCore:
    """Rank 0's loop on its own thread; serving threads `submit` commands and get Futures."""

    def __init__(self, driver: RankDriver, state: ParallelState, name: str = "engine-core",
                 on_fatal: Callable[[str], None] | None = None):
        self.driver, self.link = driver, RankLink(state)
        self.world = state.world
        self._pending: queue.Queue[tuple[RankCommand, Future]] = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()
        self._stop = False
        self.failed: str | None = None
        self._on_fatal = on_fatal  # the loop died: NOT_SERVING, then exit
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self._on_fatal = handler

    def submit(self, command: EngineCommand, rank: int = 0) -> Future:
        """Queue a command for rank `rank`; the Future holds its reply (a CommandError fails it)."""
        return self.dispatch(command, rank).future

    def dispatch(self, command: EngineCommand, rank: int = 0) -> Submitted:
        """`submit`, keeping the command's id (to match the load reports that include it)."""
        fut: Future = Future()
        cmd = RankCommand(command, rank, next(self._ids))
        self.queued(cmd)
        self._pending.put((cmd, fut))
        return Submitted(cmd.cid, fut)

    def next_cid(self) -> int:
        """An id for a command a core adds to a turn itself (`turn_commands`)."""
        return next(self._ids)

    def stop(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(10)

    # -- what a service's core refines ---------------------------------------------------------
    def queued(self, cmd: RankCommand) -> None:
        """On the submitting thread, before the loop can see the command (bookkeeping by its id)."""

    def busy(self) -> bool:
        """Whether any rank has work (an idle rank 0 waits for commands instead of stepping)."""
        return self.driver.engine.has_work  # type: ignore[attr-defined]

    def turn_commands(self, cmds: list[RankCommand]) -> list[RankCommand]:
        """The turn's commands; a core may add its own (e.g. ordered lease expiry under mirroring)."""
        return cmds

    def idle(self) -> None:
        """A turn with no work and no commands on a one-rank instance (no step, no collectives)."""

    def after_turn(self, reports: list[RankReport], step_seconds: float) -> None:
        """Rank 0 with every rank's report: replies, then events."""
        for report in reports:
            for reply in report.replies:
                self.resolve(reply)

    def on_failure(self, exc: BaseException) -> None:
        """The loop died: fail whatever waits on it."""

    # -- loop ----------------------------------------------------------------------------------
    def resolve(self, reply: Reply) -> None:
        fut = self._futures.pop(reply.cid, None)
        if fut is None or fut.done():  # nobody may cancel it, but a dead waiter must not stop the loop
            return
        if isinstance(reply.value, BaseException):
            fut.set_exception(reply.value)
        else:
            fut.set_result(reply.value)

    def _drain(self, block: bool) -> list[RankCommand]:
        """Pending commands; when idle, wait briefly for the first one (this is also the tick)."""
        cmds = []
        while True:
            try:
                if block and not cmds:
                    cmd, fut = self._pending.get(timeout=IDLE_TICK_SECONDS)
                else:
                    cmd, fut = self._pending.get_nowait()
            except queue.Empty:
                return cmds
            if not fut.set_running_or_notify_cancel():
                continue
            self._futures[cmd.cid] = fut
            cmds.append(cmd)

    def _loop(self) -> None:
        stopped_cleanly = False
        try:
            while not self._stop:
                idle = not self.busy()
                cmds = self.turn_commands(self._drain(block=idle))
                if idle and not cmds and self.world == 1:
                    self.idle()
                    continue
                self.link.share(cmds)
                t0 = time.perf_counter()
                reports = take_turn(self.driver, self.link, cmds, self.resolve)
                self.after_turn(reports or [], time.perf_counter() - t0)
            for cmd in self._drain(block=False):  # handed over before stop() (e.g. freeing blocks)
                if cmd.rank in (0, ALL):
                    self.resolve(Reply(cmd.cid, self.driver.apply(cmd)))
            stopped_cleanly = True
        except Exception as exc:  # a collective or the step itself failed: the instance cannot go on
            log.exception("engine core loop failed")
            self.failed = f"{type(exc).__name__}: {exc}"
            self._drain(block=False)  # queued ones fail too
            for fut in list(self._futures.values()):
                if not fut.done():
                    fut.set_exception(CommandError("UNAVAILABLE", f"engine failed: {exc}"))
            self.on_failure(exc)
            if self._on_fatal is not None:
                self._on_fatal(self.failed)
        finally:
            if self.world > 1:
                try:
                    self.link.share(None)
                except Exception:  # the group is already broken
                    if stopped_cleanly:
                        log.warning("could not stop the instance's other ranks")
            self.driver.close()
