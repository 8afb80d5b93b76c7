"""An engine core in its own process, as vLLM v1's EngineCore: the gRPC front (handlers, streams,
detokenization) and the engine loop (with its KV pushes or KV receiver) never share one GIL.

The front holds a `CoreProcess`: `call(name, *args)` runs a handler in the core and returns a Future
of its result; messages the core sends on its own (events, load reports) go to `on_message`. If the
core dies, every pending call fails with UNAVAILABLE and `on_fatal` fires (the front goes
NOT_SERVING). The core side is `CoreConnection.serve(handlers)`.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shared.engine.core import CommandError

log = logging.getLogger("pdserve.engine")


class CoreConnection:
    """The core's end of the pipe."""

    def __init__(self, conn: Any):  # multiprocessing Connection
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, *msg: Any) -> None:
        with self._lock:
            try:
                self.conn.send(msg)
            except (OSError, EOFError):  # the front is gone; serve() ends the core
                pass

    def _answer(self, fid: int) -> Callable[[Future], None]:
        def done(fut: Future) -> None:
            exc = fut.exception()
            self.send("result", fid, exc is None, fut.result() if exc is None else _portable(exc))
        return done

    def serve(self, handlers: dict[str, Callable[..., Any]]) -> None:
        """Answer the front's calls (a handler returns a value or a Future) until it stops or goes."""
        try:
            while True:
                msg = self.conn.recv()
                if msg[0] == "stop":
                    return
                _, fid, name, args = msg
                try:
                    result = handlers[name](*args)
                except Exception as exc:  # handed to the caller
                    self.send("result", fid, False, _portable(exc))
                    continue
                if isinstance(result, Future):
                    result.add_done_callback(self._answer(fid))
                else:
                    self.send("result", fid, True, result)
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


class CoreProcess:
    """The front's end: spawns `entry(cfg, conn)`, waits for its ("ready", facts), then reads."""

    def __init__(self, entry: Callable[[Any, Any], None], cfg: Any, name: str,
                 on_message: Callable[[tuple], None], start_timeout: float = 900.0,
                 on_lost: Callable[[str], None] | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=entry, args=(cfg, child), name=name)
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
        if msg[0] != "ready":
            raise RuntimeError(f"the {name} failed to start: {msg[1]}")
        self.facts: Any = msg[1]  # what the core told the front at start (the service's dataclass)
        self.on_message = on_message
        self.on_fatal: Callable[[str], None] | None = None  # the server's, once it serves (set_fatal_handler)
        self.on_lost = on_lost  # before on_fatal: the front fails what it holds
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def call(self, name: str, *args: Any) -> Future:
        fut: Future = Future()
        fid = next(self._ids)
        self._futures[fid] = fut
        try:
            with self._send_lock:
                self._conn.send(("call", fid, name, args))
        except OSError as exc:
            self._futures.pop(fid, None)
            fut.set_exception(CommandError("UNAVAILABLE", f"{self.name} unreachable: {exc}"))
        return fut

    def stop(self) -> None:
        self._stopping = True
        try:
            with self._send_lock:
                self._conn.send(("stop",))
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
                if msg[0] == "result":
                    _, fid, ok, value = msg
                    fut = self._futures.pop(fid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(value) if ok else fut.set_exception(value)
                elif msg[0] == "fatal":
                    reason = msg[1]
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


class EngineProcessClient:
    """Base of a service front's handle on its engine-core process (an EngineHandle): the fatal handler
    and `stop` reach the process; subclasses add the service's calls and handle its messages."""

    def __init__(self, entry: Callable[[Any, Any], None], cfg: Any, name: str,
                 start_timeout: float = 900.0, on_lost: Callable[[str], None] | None = None):
        self.core = CoreProcess(entry, cfg, name, self.on_message, start_timeout, on_lost)

    def on_message(self, msg: tuple) -> None:
        """A message the core sent on its own (events, load reports)."""

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self.core.on_fatal = handler

    def stop(self) -> None:
        self.core.stop()
