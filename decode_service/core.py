"""The decode engine core in its own process, as vLLM v1's EngineCore.

The gRPC front (handlers, streams, detokenization) and the engine loop (DecodeRank + Coordinator,
with its KV receiver) no longer share one GIL: the front talks to the core over a pipe. The front's
`CoreClient` offers what the handlers use of a Coordinator (submit, reserve, streams, loads,
lease routing, the engine's facts); the core sends back, per loop turn, one message with the step's
events and one with the loads. If the core dies, every stream ends with UNAVAILABLE and the front
goes NOT_SERVING (`on_fatal`).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from decode_service.dp import CommandError, Coordinator, DecodeRank, Streams
from shared import metrics
from shared.engine.tokenizer import OutputProcessor, Tokenizer
from shared.parallel.launch import die_with_parent, service_state

log = logging.getLogger("pdserve.decode")


def core_main(cfg: Any, conn: Any) -> None:  # noqa: ANN401 - DecodeConfig, multiprocessing Connection
    """Entry point of the engine-core process: rank 0's engine, its coordinator loop, its KV receiver."""
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode-core %(levelname)s %(message)s")
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except (OSError, EOFError):  # the front is gone; the reader below ends the core
                pass

    try:
        me = DecodeRank(cfg, 0, service_state(cfg.parallel(), 0))
    except Exception as exc:  # noqa: BLE001 - reported to the front, which fails its start
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    coord = Coordinator(me, cfg.world)
    coord.sink = lambda events: send(("events", events)) if events else None
    coord.on_report = lambda loads, expired, seconds: send(("report", loads, expired, seconds))
    coord.on_fatal = lambda reason: send(("fatal", reason))
    send(("ready", {"max_model_len": coord.max_model_len, "block_size": coord.block_size,
                    "usable_blocks": coord.usable_blocks, "transport": me.receiver.transport}, coord.loads))

    def answer(fid: int) -> Callable[[Future], None]:
        def done(fut: Future) -> None:
            exc = fut.exception()
            if exc is None:
                send(("result", fid, True, fut.result()))
            else:
                code = exc.code if isinstance(exc, CommandError) else "INTERNAL"
                send(("result", fid, False, (code, str(exc))))
        return done

    try:
        while True:
            msg = conn.recv()
            if msg[0] == "submit":
                _, fid, kind, rank, args = msg
                coord.submit(kind, rank, **args).add_done_callback(answer(fid))
            elif msg[0] == "reserve":
                _, fid, request_id, tokens, prompt_tokens = msg
                coord.reserve(request_id, tokens, prompt_tokens).add_done_callback(answer(fid))
            elif msg[0] == "stop":
                break
    except (EOFError, OSError):
        log.warning("the decode front went away; stopping the engine core")
    finally:
        coord.stop()


class CoreClient:
    """The front's handle on the engine-core process: what the gRPC handlers use of a Coordinator."""

    def __init__(self, cfg: Any, start_timeout: float = 900.0):  # noqa: ANN401 - DecodeConfig
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=core_main, args=(cfg, child), name="decode-core")
        self.proc.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self.proc.kill()
            raise RuntimeError(f"the decode engine core did not start in {start_timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the decode engine core exited with {self.proc.exitcode} while starting") from None
        if msg[0] != "ready":
            raise RuntimeError(f"the decode engine core failed to start: {msg[1]}")
        facts, self.loads = msg[1], msg[2]
        self.max_model_len, self.block_size = facts["max_model_len"], facts["block_size"]
        self.usable_blocks, self.transport = facts["usable_blocks"], facts["transport"]
        tokenizer = Tokenizer.from_model_dir(cfg.model, None)
        self.output_processor = lambda params: OutputProcessor(tokenizer, params.stop, params.skip_special_tokens)
        self.streams = Streams()
        self.lease_rank: dict[str, int] = {}
        self.on_fatal: Callable[[str], None] | None = None
        self._futures: dict[int, Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="decode-core-reader", daemon=True)
        self._reader.start()

    # -- what the handlers call ----------------------------------------------------------------
    def submit(self, kind: str, rank: int, **args: Any) -> Future:
        return self._call(("submit", kind, rank, args))

    def reserve(self, request_id: str, tokens: int, prompt_tokens: int | None = None) -> Future:
        """Placed on the least loaded rank by the core; the Future yields (rank, destination)."""
        return self._call(("reserve", request_id, tokens, prompt_tokens))

    def open_stream(self, request_id: str, q: Any = None) -> Any:
        return self.streams.open(request_id, q)

    def close_stream(self, request_id: str, q: Any = None) -> None:
        self.streams.close(request_id, q)

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

    # -- plumbing --------------------------------------------------------------------------------
    def _call(self, msg: tuple) -> Future:
        fut: Future = Future()
        fid = next(self._ids)
        self._futures[fid] = fut
        try:
            with self._send_lock:
                self._conn.send((msg[0], fid, *msg[1:]))
        except OSError as exc:
            self._futures.pop(fid, None)
            fut.set_exception(CommandError("UNAVAILABLE", f"decode engine core unreachable: {exc}"))
        return fut

    def _read(self) -> None:
        reason = "the decode engine core exited"
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "events":
                    self.streams.dispatch(msg[1])
                elif kind == "report":
                    _, self.loads, expired, seconds = msg
                    for lease_id in expired:
                        self.lease_rank.pop(lease_id, None)
                    metrics.EXPIRED_LEASES.inc(len(expired))
                    if seconds is not None:
                        metrics.STEP_SECONDS.observe(seconds)
                elif kind == "result":
                    _, fid, ok, value = msg
                    fut = self._futures.pop(fid, None)
                    if fut is not None and not fut.done():
                        fut.set_result(value) if ok else fut.set_exception(CommandError(*value))
                elif kind == "fatal":
                    reason = msg[1]
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        log.error("decode engine core failed: %s", reason)
        self.streams.fail_all()
        for fut in list(self._futures.values()):
            if not fut.done():
                fut.set_exception(CommandError("UNAVAILABLE", f"decode engine failed: {reason}"))
        if self.on_fatal is not None:
            self.on_fatal(reason)
