"""The decode engine core in its own process (shared.engine.process): rank 0's DecodeRank, its
Coordinator loop and KV receiver run there; the gRPC front keeps the handlers, the streams and
detokenization. `CoreClient` offers the handlers what they use of a Coordinator (submit, reserve,
streams, loads, lease routing, the engine's facts); the core sends back, per loop turn, one message
with the step's events and one with the loads.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from decode_service.dp import Coordinator, DecodeRank, Streams
from shared import metrics
from shared.engine.process import CoreClient as EngineCoreClient
from shared.engine.process import CoreConnection
from shared.engine.tokenizer import OutputProcessor, Tokenizer
from shared.parallel.launch import die_with_parent, service_state

log = logging.getLogger("pdserve.decode")


def core_main(cfg: Any, conn: Any) -> None:  # noqa: ANN401 - DecodeConfig, multiprocessing Connection
    """Entry point of the engine-core process: rank 0's engine, its coordinator loop, its KV receiver."""
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode-core %(levelname)s %(message)s")
    front = CoreConnection(conn)
    try:
        me = DecodeRank(cfg, 0, service_state(cfg.parallel(), 0))
    except Exception as exc:  # noqa: BLE001 - reported to the front, which fails its start
        front.send("failed", f"{type(exc).__name__}: {exc}")
        return
    coord = Coordinator(me, cfg.world)
    coord.sink = lambda events: front.send("events", events) if events else None
    coord.on_report = lambda loads, expired, seconds: front.send("report", loads, expired, seconds)
    coord.on_fatal = lambda reason: front.send("fatal", reason)
    front.send("ready", {"max_model_len": coord.max_model_len, "block_size": coord.block_size,
                         "usable_blocks": coord.usable_blocks, "transport": me.receiver.transport,
                         "loads": coord.loads})
    try:
        front.serve({"submit": lambda kind, rank, args: coord.submit(kind, rank, **args),
                     "reserve": coord.reserve})
    finally:
        coord.stop()


class CoreClient(EngineCoreClient):
    """The front's handle on the engine-core process: what the gRPC handlers use of a Coordinator."""

    def __init__(self, cfg: Any, start_timeout: float = 900.0):  # noqa: ANN401 - DecodeConfig
        self.streams = Streams()
        self.lease_rank: dict[str, int] = {}
        super().__init__(core_main, cfg, "decode engine core", start_timeout)
        self.core.on_lost = lambda reason: self.streams.fail_all()
        facts = self.core.facts
        self.loads = facts["loads"]
        self.max_model_len, self.block_size = facts["max_model_len"], facts["block_size"]
        self.usable_blocks, self.transport = facts["usable_blocks"], facts["transport"]
        tokenizer = Tokenizer.from_model_dir(cfg.model, None)
        self.output_processor = lambda params: OutputProcessor(tokenizer, params.stop, params.skip_special_tokens)

    def submit(self, kind: str, rank: int, **args: Any) -> Future:
        return self.core.call("submit", kind, rank, args)

    def reserve(self, request_id: str, tokens: int, prompt_tokens: int | None = None) -> Future:
        """Placed on the least loaded rank by the core; the Future yields (rank, destination)."""
        return self.core.call("reserve", request_id, tokens, prompt_tokens)

    def open_stream(self, request_id: str, q: Any = None) -> Any:
        return self.streams.open(request_id, q)

    def close_stream(self, request_id: str, q: Any = None) -> None:
        self.streams.close(request_id, q)

    def on_message(self, msg: tuple) -> None:
        if msg[0] == "events":
            self.streams.dispatch(msg[1])
        elif msg[0] == "report":
            _, self.loads, expired, seconds = msg
            for lease_id in expired:
                self.lease_rank.pop(lease_id, None)
            metrics.EXPIRED_LEASES.inc(len(expired))
            if seconds is not None:
                metrics.STEP_SECONDS.observe(seconds)
