"""How a service's front reaches its engine core (a `CoreLink`): on a thread of the front's process
(`InProcessLink`, --engine-in-process) or in its own process (`CoreProcess`), as vLLM v1's EngineCore:
the gRPC front (handlers, streams, detokenization) and the engine loop (with its KV pushes or KV
receiver) never share one GIL. Either way the front's one client sends the same typed commands and
takes the same notices.

The front holds a `CoreProcess`: `call(command)` hands one of the service's typed command dataclasses
to the core's handler and returns a Future of its result; notices the core sends on its own (the
service's events and load reports, dataclasses of its own) go to `on_message`. If the core dies, every
pending call fails with UNAVAILABLE and `on_fatal` fires (the front goes NOT_SERVING). The core side is
`CoreConnection.serve(handle)`, where `handle` dispatches on the command's type (the same handler an
in-process front calls directly). Everything on the pipe is one of the dataclasses below, a service's
command or its notice: no call goes by name.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from shared.device import process_start_method
from shared.engine.core import CommandError

log = logging.getLogger("pdserve.engine")


@dataclass(frozen=True)
class Call:
    """Front → core: a service's command (a dataclass its core's `handle` takes); answered by a Result
    with the same `fid`."""

    fid: int
    command: object


@dataclass(frozen=True)
class Result:
    """Core → front: a call's value (`ok`) or the exception it raised."""

    fid: int
    ok: bool
    value: Any


@dataclass(frozen=True)
class Stop:
    """Front → core: stop serving calls (the core then stops its engine)."""


@dataclass(frozen=True)
class Ready:
    """Core → front, once: started; `facts` is what the service's front needs to know (its dataclass)."""

    facts: Any


@dataclass(frozen=True)
class StartFailed:
    """Core → front, instead of Ready: the engine could not start."""

    reason: str


@dataclass(frozen=True)
class Fatal:
    """Core → front: the engine loop failed; the core exits after this."""

    reason: str


class CoreConnection:
    """The core's end of the pipe."""

    def __init__(self, conn: Any):  # multiprocessing Connection
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        with self._lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError):  # the front is gone; serve() ends the core
                pass

    def _answer(self, fid: int) -> Callable[[Future], None]:
        def done(fut: Future) -> None:
            exc = fut.exception()
            self.send(Result(fid, exc is None, fut.result() if exc is None else _portable(exc)))
        return done

    def serve(self, handle: Callable[[object], Any]) -> None:
        """Answer the front's calls with `handle(command)` (a value or a Future) until it stops or goes."""
        try:
            while True:
                msg = self.conn.recv()
                if isinstance(msg, Stop):
                    return
                try:
                    result = handle(msg.command)
                except Exception as exc:  # handed to the caller
                    self.send(Result(msg.fid, False, _portable(exc)))
                    continue
                if isinstance(result, Future):
                    result.add_done_callback(self._answer(msg.fid))
                else:
                    self.send(Result(msg.fid, True, result))
        except (EOFError, OSError):
            log.warning("the front went away; stopping the engine core")


def _portable(exc: BaseException) -> BaseException:
    """An exception that survives the pipe (its type when it pickles, else a RuntimeError)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))  # our own object
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class CoreLink(Protocol):
    """A front's way to its engine core, wherever the core runs: typed commands in (answered by a
    Future), the core's notices out to `listen`'s callback, its failure to the fatal handler."""

    def call(self, command: object) -> Future: ...
    def listen(self, on_message: Callable[[object], None], on_lost: Callable[[str], None] | None = None
               ) -> None: ...
    def set_fatal_handler(self, handler: Callable[[str], None]) -> None: ...
    def stop(self) -> None: ...


class ServingCore(Protocol):
    """What an engine core offers an in-process link (the service's EngineCore subclass)."""

    def handle(self, command: Any) -> Any: ...
    def set_fatal_handler(self, handler: Callable[[str], None]) -> None: ...
    def stop(self) -> None: ...


class InProcessLink:
    """A CoreLink to a core on a thread of this process: a command is its `handle` call; the service
    wires the core's hooks to `notify` (the same notices a core process sends over its pipe)."""

    def __init__(self, core: ServingCore):
        self.core = core
        self.notify: Callable[[object], None] = lambda msg: None
        self._on_lost: Callable[[str], None] | None = None
        self._on_fatal: Callable[[str], None] | None = None
        core.set_fatal_handler(self._fatal)

    def call(self, command: object) -> Future:
        fut: Future = Future()
        try:
            result = self.core.handle(command)
        except Exception as exc:  # handed to the caller, as over a pipe
            fut.set_exception(exc)
            return fut
        if isinstance(result, Future):
            return result
        fut.set_result(result)
        return fut

    def listen(self, on_message: Callable[[object], None], on_lost: Callable[[str], None] | None = None) -> None:
        self.notify, self._on_lost = on_message, on_lost

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self._on_fatal = handler

    def stop(self) -> None:
        self.core.stop()

    def _fatal(self, reason: str) -> None:
        if self._on_lost is not None:
            self._on_lost(reason)
        if self._on_fatal is not None:
            self._on_fatal(reason)


def _core_entry(entry: Callable[[Any, Any], None], cfg: Any, conn: Any, front_end: Any) -> None:
    """A core process's start: a forked one first closes its copy of the front's end of the pipe."""
    if front_end is not None:
        front_end.close()
    entry(cfg, conn)


class CoreProcess:
    """A CoreLink to a core process: starts `entry(cfg, conn)` (forked or spawned, as
    shared.device.process_start_method says), waits for its Ready (its `facts`), and reads once the front
    `listen`s (notices sent meanwhile wait in the pipe)."""

    def __init__(self, entry: Callable[[Any, Any], None], cfg: Any, name: str, start_timeout: float = 900.0):
        method = process_start_method()
        ctx = mp.get_context(method)
        self._conn, child = ctx.Pipe()
        # a forked core holds a copy of the front's end too: it closes it, so the front's exit reads as EOF there
        front_end = self._conn if method == "fork" else None
        self.proc = ctx.Process(target=_core_entry, args=(entry, cfg, child, front_end), name=name)
        self.proc.start()
        child.close()
        self.name = name
        if not self._conn.poll(start_timeout):
            self.proc.kill()
            raise RuntimeError(f"the {name} did not start in {start_timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the {name} exited with {self.proc.exitcode} while starting") from None
        if not isinstance(msg, Ready):
            raise RuntimeError(f"the {name} failed to start: {msg.reason}")
        self.facts: Any = msg.facts  # what the core told the front at start (the service's dataclass)
        self.on_message: Callable[[object], None] = lambda msg: None
        self.on_fatal: Callable[[str], None] | None = None  # the server's, once it serves (set_fatal_handler)
        self.on_lost: Callable[[str], None] | None = None  # before on_fatal: the front fails what it holds
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)

    def listen(self, on_message: Callable[[object], None], on_lost: Callable[[str], None] | None = None) -> None:
        """Start reading: the core's notices go to `on_message`; if it dies, `on_lost`, then the fatal handler."""
        self.on_message, self.on_lost = on_message, on_lost
        self._reader.start()

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self.on_fatal = handler

    def call(self, command: object) -> Future:
        """Hand a command to the core's handler; the Future holds its answer (or what it raised)."""
        fut: Future = Future()
        fid = next(self._ids)
        self._futures[fid] = fut
        try:
            with self._send_lock:
                self._conn.send(Call(fid, command))
        except OSError as exc:
            self._futures.pop(fid, None)
            fut.set_exception(CommandError("UNAVAILABLE", f"{self.name} unreachable: {exc}"))
        return fut

    def stop(self) -> None:
        self._stopping = True
        try:
            with self._send_lock:
                self._conn.send(Stop())
        except OSError:
            pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()

    def _read(self) -> None:
        reason = f"the {self.name} exited"
        try:
            while True:
                msg = self._conn.recv()
                if isinstance(msg, Result):
                    fut = self._futures.pop(msg.fid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.value) if msg.ok else fut.set_exception(msg.value)
                elif isinstance(msg, Fatal):
                    reason = msg.reason
                else:
                    self.on_message(msg)
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        log.error("%s failed: %s", self.name, reason)
        if self.on_lost is not None:
            self.on_lost(reason)
        for fut in list(self._futures.values()):
            if not fut.done():
                fut.set_exception(CommandError("UNAVAILABLE", f"engine failed: {reason}"))
        if self.on_fatal is not None:
            self.on_fatal(reason)
