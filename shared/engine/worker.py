"""An engine thread: one thread owns the LLMEngine and steps it; other threads (gRPC handlers)
hand it work through `call`, which runs between steps, so the engine is never touched concurrently."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shared.engine.llm import LLMEngine


class EngineWorker:
    def __init__(self, engine: LLMEngine, name: str = "engine"):
        self.engine = engine
        self._calls: queue.Queue[tuple[Callable[[LLMEngine], Any], Future]] = queue.Queue()
        self._wake = threading.Event()
        self._stopped = False
        self.failed: str | None = None
        self.on_fatal: Callable[[str], None] | None = None  # set by the service: NOT_SERVING, then exit
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the engine thread between steps; the Future holds its result."""
        fut: Future = Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(5)

    def step(self) -> None:
        """One engine step; subclasses with special steps (prefill pushes) override this."""
        self.engine.step()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._run_calls()
                if self.engine.has_work:
                    self.step()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
            self._run_calls()  # what was handed over before stop() still runs (e.g. freeing blocks)
        except Exception as exc:  # noqa: BLE001 - steps contain their own failures; this is the loop itself
            self.failed = f"{type(exc).__name__}: {exc}"
            self.on_failure(exc)
            if self.on_fatal is not None:
                self.on_fatal(self.failed)

    def on_failure(self, exc: BaseException) -> None:
        """The loop died: fail whatever waits on it (subclasses know their waiters)."""
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(exc)
