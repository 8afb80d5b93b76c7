"""The prefill engine core in its own process (shared.engine.process): rank 0's engine, its loop and
its KV pushes run there, the gRPC front keeps the handlers. `PrefillClient` offers the servicer what
it uses of a PrefillCore (prefill, cancel, load); the core reports its load after every turn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prefill_service.rank import PrefillCore, PrefillRank
from shared import metrics
from shared.engine import LLMEngine, SamplingParams
from shared.engine.process import CoreClient, CoreConnection
from shared.parallel.launch import die_with_parent, service_state
from shared.transfer import Destination, make_sender


def sender_factory(cfg: Any, engine: LLMEngine) -> Callable[[str], Any]:  # noqa: ANN401 - PrefillConfig
    """How this instance opens KV pushes (TLS and the advertised host from its flags)."""
    tls = cfg.credentials().ssl_context(server=False)
    return lambda transport: make_sender(transport, engine.kv, cfg.public_host, cfg.mooncake_protocol, tls,
                                         cfg.kv_stall_seconds, cfg.mooncake_devices)


def build_core(cfg: Any) -> PrefillCore:  # noqa: ANN401 - PrefillConfig
    """Rank 0's engine and loop."""
    engine = LLMEngine(cfg.engine_config(), service_state(cfg.parallel(), 0))
    return PrefillCore(PrefillRank(engine, sender_factory(cfg, engine)))


def core_main(cfg: Any, conn: Any) -> None:  # noqa: ANN401 - PrefillConfig, multiprocessing Connection
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill-core %(levelname)s %(message)s")
    front = CoreConnection(conn)
    try:
        core = build_core(cfg)
    except Exception as exc:  # noqa: BLE001 - reported to the front, which fails its start
        front.send("failed", f"{type(exc).__name__}: {exc}")
        return
    core.on_report = lambda load, batch_tokens: front.send("report", load, batch_tokens)
    core.on_fatal = lambda reason: front.send("fatal", reason)
    front.send("ready", {"load": core.load()})
    try:
        front.serve({"prefill": core.prefill, "cancel": core.cancel})
    finally:
        core.stop()


class PrefillClient(CoreClient):
    """The front's handle on the prefill engine-core process."""

    def __init__(self, cfg: Any, start_timeout: float = 900.0):  # noqa: ANN401 - PrefillConfig
        super().__init__(core_main, cfg, "prefill engine core", start_timeout)
        self.latest_load: dict[str, Any] = self.core.facts["load"]

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination,
                priority: int = 0) -> Future:
        return self.core.call("prefill", request_id, prompt, params, dest, priority)

    def cancel(self, request_id: str, reason: BaseException) -> None:
        self.core.call("cancel", request_id, reason)

    def load(self) -> dict[str, Any]:
        return self.latest_load

    def on_message(self, msg: tuple) -> None:
        if msg[0] == "report":
            _, load, batch_tokens = msg
            self.latest_load = {**self.latest_load, **load}  # the prefix filter comes with some reports only
            if batch_tokens:
                metrics.BATCH_TOKENS.observe(batch_tokens)
