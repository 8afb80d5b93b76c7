"""The engine thread both services run: one thread owns the LLMEngine and steps it; gRPC handler
threads hand it work through `call` and read results from per-request queues."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shared.engine.llm import LLMEngine, StepEvent

FINISHED = object()  # sentinel after a request's last event


class EngineWorker:
    def __init__(self, engine: LLMEngine, name: str = "engine"):
        self.engine = engine
        self._calls: queue.Queue[tuple[Callable[[LLMEngine], Any], Future]] = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run fn(engine) on the engine thread between steps; the Future holds its result."""
        fut: Future = Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return fut

    def open_stream(self, request_id: str) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        self._streams[request_id] = q
        return q

    def abort(self, request_id: str, reason: str = "abort") -> None:
        def do(engine: LLMEngine) -> None:
            engine.abort(request_id, reason)
            self._close_stream(request_id)

        self.call(do)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(5)

    def deliver(self, events: list[StepEvent]) -> None:
        for ev in events:
            q = self._streams.get(ev.seq.request_id)
            if q is not None:
                q.put(ev)
                if ev.finished:
                    self._close_stream(ev.seq.request_id)

    def _close_stream(self, request_id: str) -> None:
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put(FINISHED)

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

    def step(self) -> list[StepEvent]:
        """One engine step; services with special steps (prefill pushes) override this."""
        return self.engine.step()

    def _loop(self) -> None:
        while not self._stopped:
            self._run_calls()
            if self.engine.has_work:
                self.deliver(self.step())
            else:
                self._wake.wait(0.05)
                self._wake.clear()
