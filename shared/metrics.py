"""Prometheus metrics of every service (one registry per process, served on --metrics-port).

Names are `pdserve_` + base units (`_seconds`, `_bytes`, `_total`); labels are low-cardinality
(service, pool, instance address, DP rank — never request ids). Histogram buckets span 1 ms to
5 min, so CPU tests and accelerator latencies both land inside them. Multi-rank decode instances
export one consistent view from rank 0 (which gathers every rank's load each step) with a `rank`
label, read at scrape time (never a stale copy). The README's "Metrics" table lists them all.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKENS_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

# --- every service ---------------------------------------------------------------------------------
REQUESTS = Counter("pdserve_requests_total", "Requests by final gRPC status and reason",
                   ["service", "status", "reason"])
TOKENS = Counter("pdserve_tokens_total", "Tokens processed (prompt: prefilled, cached_prompt: of those, served "
                 "from the prefix cache, output: generated)",
                 ["service", "kind"])

FROZEN_OBJECTS = Gauge("pdserve_process_frozen_objects", "Objects this process moved into the garbage collector's "
                       "permanent generation when it began serving (gc.freeze): a full collection skips them")
FROZEN_OBJECTS.set_function(gc.get_freeze_count)  # read at scrape time

# --- router ------------------------------------------------------------------------------------------
TTFT = Histogram("pdserve_router_ttft_seconds", "Arrival to first token, seen by the router", buckets=LATENCY)
TPOT = Histogram("pdserve_router_tpot_seconds", "Time per output token after the first", buckets=LATENCY)
QUEUE = Histogram("pdserve_router_queue_seconds",
                  "Arrival until the prefill call starts (validation, tokenizing, KV reservation)", buckets=LATENCY)
E2E = Histogram("pdserve_router_e2e_seconds", "Arrival to the last token", buckets=LATENCY)
DESIRED = Gauge("pdserve_router_desired_instances", "Instances each pool should have for the observed load "
                "(--autoscale: the planner's model under the SLA targets, with hysteresis); `pdserve up` and the "
                "chart's KEDA ScaledObjects size the pools to it", ["pool"])
ARRIVALS = Counter("pdserve_router_arrivals_total", "Generate calls that passed validation (the load the "
                   "autoscaler sizes the pools for)")
IN_FLIGHT = Gauge("pdserve_router_in_flight_requests", "Generate calls being served")
FAILOVERS = Counter("pdserve_router_failovers_total", "Calls retried on another instance", ["pool"])
MIGRATIONS = Counter("pdserve_router_migrations_total", "Requests moved to another instance mid-flight, by cause "
                     "(unavailable, kv_transfer, drain, engine_error, ...)", ["cause"])
MIGRATION_PAUSE = Histogram("pdserve_router_migration_pause_seconds", "From an instance's failure to the migrated "
                            "request's next token (the pause its client sees)", buckets=LATENCY)
INSTANCE_UP = Gauge("pdserve_router_instance_up", "1 when the instance's health check says SERVING",
                    ["pool", "instance"])
INSTANCE_PLACEABLE = Gauge("pdserve_router_instance_placeable", "1 while the instance answers the router's load "
                           "polls (and no request to it just failed): requests are placed on it", ["pool", "instance"])
PAIRS = Counter("pdserve_router_pairs_total", "Requests per chosen (prefill, decode) pair", ["prefill", "decode"])
HTTP_REQUESTS = Counter("pdserve_router_http_requests_total", "OpenAI-compatible HTTP API calls by route and "
                        "HTTP status (generation requests are counted in the gRPC path's metrics too)",
                        ["route", "status"])
KV_FETCH_DECISIONS = Counter("pdserve_router_kv_fetch_decisions_total", "Per prefill try: whether the prefill "
                             "instance was told to fetch the prompt's cached prefix from another instance, and why",
                             ["decision", "reason"])
EPP_HINTS = Counter("pdserve_router_epp_hints_total", "HTTP requests that came with an endpoint picker's (prefill, "
                    "decode) pair: followed (admitted, placed first) or not admitted (the router's own choice)",
                    ["outcome"])
EPP_PICKS = Counter("pdserve_epp_picks_total", "Endpoint picker (ext_proc) answers: picked (with a pair), "
                    "unplaced (an endpoint, no pair: a body it does not place), refused_503 / _429 / _413",
                    ["outcome"])
PREFILL_PATHS = Counter("pdserve_router_prefill_path_total", "Requests by where their prompt was prefilled: "
                        "disaggregated (a prefill instance, KV pushed) or local (on the decode instance, "
                        "--local-prefill-tokens)", ["path"])

# --- prefill -----------------------------------------------------------------------------------------
PREFILL_SECONDS = Histogram("pdserve_prefill_seconds", "Prefill compute + KV push per request", buckets=LATENCY)
BATCH_TOKENS = Histogram("pdserve_prefill_batch_tokens", "Prompt tokens computed per engine step",
                         buckets=TOKENS_BUCKETS)
KV_PUSH_BYTES = Counter("pdserve_kv_push_bytes_total", "KV bytes pushed to decode", ["transport"])
KV_PUSH_SECONDS = Histogram("pdserve_kv_push_seconds", "Prompt scheduled until its KV push committed",
                            ["transport"], buckets=LATENCY)
KV_PUSH_FAILURES = Counter("pdserve_kv_push_failures_total", "KV pushes that failed", ["transport"])

# --- decode ------------------------------------------------------------------------------------------
STEP_SECONDS = Histogram("pdserve_decode_step_seconds", "One lock-step decode iteration (all ranks)",
                         buckets=LATENCY)
EXPIRED_LEASES = Counter("pdserve_decode_expired_leases_total", "Reservations that expired unused")
TOKEN_BUSES = Gauge("pdserve_decode_token_buses", "Routers' token buses open here (one Tokens stream per router)")
TOKEN_BUS_BATCHES = Counter("pdserve_decode_token_bus_batches_total", "Batches sent on token buses (a step's "
                            "messages for one router in each)")
TOKEN_BUS_MESSAGES = Counter("pdserve_decode_token_bus_messages_total", "Request messages sent on token buses")
KV_FOLLOW_UP_BLOCKS = Counter("pdserve_decode_follow_up_kv_blocks_total", "Prompt KV blocks of the reservations "
                              "that reused an earlier prompt's blocks whole (follow-up turns whose context this "
                              "instance kept): pushed, or reused", ["source"])
KV_BLOCKS = Counter("pdserve_decode_kv_blocks_total", "Prompt KV blocks of reservations: pushed by prefill, or "
                    "reused from this instance's prefix cache (only the rest travels)", ["source"])

# --- the fleet's prefix cache (every engine-backed service) ------------------------------------------------
PREFIX_HIT_TOKENS = Counter("pdserve_prefix_cache_hit_tokens_total", "Prompt tokens served from a prefix cache "
                            "instead of computed (prefill) or pushed (decode), by the tier that held them",
                            ["service", "tier"])
# the second KV tier's bytes and drops: per rank, from the engine's reports (LoadCollector), not counted here
KV_FETCHES = Counter("pdserve_kv_fetches_total", "Cross-instance fetches a prefill instance was asked to make, by "
                     "outcome (fetched, failed, not_needed: it had the blocks, no_room)", ["outcome"])
KV_FETCH_BYTES = Counter("pdserve_kv_fetch_bytes_total", "KV bytes another prefill instance pushed here for a fetch")
KV_EVENTS = Counter("pdserve_kv_events_total", "Prefix-cache events published to subscribers (routers), by kind "
                    "and tier", ["kind", "tier"])
KV_INDEX_BLOCKS = Gauge("pdserve_router_kv_index_blocks", "Entries (instance, rank, tier, block) in the router's "
                        "index of the fleet's prefix caches, by pool", ["pool"])
KV_INDEX_RESYNCS = Counter("pdserve_router_kv_index_resyncs_total", "Snapshots the router's KV index took from an "
                           "instance (a first subscription, a restart, a subscriber too far behind)", ["pool"])


class LoadCollector(Collector):
    """Scrape-time gauges of an engine's (or every DP rank's) load: `loads()` returns one dict per
    rank with running, waiting, tokens, free_blocks, total_blocks, active_leases, kv_bytes_received, and
    the counters an engine process keeps and reports every turn (its second KV tier's, MTP's): exported
    from the front at scrape time, so they reach /metrics whichever process runs the engine."""

    GAUGES = (("running", "pdserve_running_requests", "Requests in the running batch"),
              ("waiting", "pdserve_waiting_requests", "Requests queued for the engine"),
              ("tokens", "pdserve_context_tokens", "Tokens held by running requests and reservations"),
              ("free_blocks", "pdserve_kv_blocks_free", "Free KV blocks"),
              ("used_blocks", "pdserve_kv_blocks_used", "KV blocks in use (requests + reservations)"),
              ("total_blocks", "pdserve_kv_blocks_total", "KV blocks in the pool"),
              ("active_leases", "pdserve_active_leases", "KV reservations not yet claimed"))

    # counters of the second KV tier: (name, doc, label, ((label value, load key), ...))
    TIER = (("pdserve_kv_tier_bytes", "Bytes the second KV tier wrote (spilled blocks) or read back (hits)",
             "direction", (("written", "tier_written_bytes"), ("read", "tier_read_bytes"))),
            ("pdserve_kv_tier_dropped_blocks", "Second-tier blocks dropped instead of served, by why (corrupt: the "
             "checksum or length failed; full: evicted for room)", "reason",
             (("corrupt", "tier_dropped_corrupt"), ("full", "tier_dropped_full"))))

    def __init__(self, service: str, loads: Callable[[], Iterable[dict[str, Any]]]):
        self.service, self.loads = service, loads

    def describe(self):  # registration without collecting (the loads may not exist yet)
        return []

    def collect(self):
        loads = list(self.loads())
        for key, name, doc in self.GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["service", "rank"])
            for load in loads:
                value = load["total_blocks"] - load["free_blocks"] if key == "used_blocks" else load.get(key)
                if value is not None:
                    family.add_metric([self.service, str(load["rank"])], value)
            yield family
        received = CounterMetricFamily("pdserve_kv_received_bytes", "KV bytes received from prefill",
                                       labels=["service", "rank"])
        for load in loads:
            if "kv_bytes_received" in load:
                received.add_metric([self.service, str(load["rank"])], load["kv_bytes_received"])
        yield received
        yield from self._tier(loads)
        steps = CounterMetricFamily("pdserve_decode_steps", "Engine steps by how they ran: replayed (a plain decode "
                                    "step from a recorded one), recorded (run eagerly while recorded), eager (the "
                                    "rest); none without decode graphs (--enforce-eager, parallel ranks)",
                                    labels=["service", "rank", "mode"])
        for load in loads:
            for mode in ("replayed", "recorded", "eager"):
                if load.get(f"graph_{mode}"):
                    steps.add_metric([self.service, str(load["rank"]), mode], load[f"graph_{mode}"])
        yield steps
        for kind, doc in (("drafted", "MTP draft tokens proposed"), ("accepted", "MTP draft tokens accepted")):
            family = CounterMetricFamily(f"pdserve_spec_{kind}_tokens", f"{doc}, by draft position (acceptance "
                                         "rate per position: accepted / drafted)",
                                         labels=["service", "rank", "position"])
            for load in loads:
                for key, value in load.items():
                    if key.startswith(f"spec_{kind}_"):
                        family.add_metric([self.service, str(load["rank"]), key.rsplit("_", 1)[1]], value)
            yield family

    def _tier(self, loads: list[dict[str, Any]]) -> Iterator[CounterMetricFamily]:
        """Each rank's second KV tier since its engine started (shared.protocol.load.RankLoad's tier_*)."""
        for name, doc, label, keys in self.TIER:
            family = CounterMetricFamily(name, doc, labels=["service", "rank", label])
            for load in loads:
                for value, key in keys:
                    if key in load:
                        family.add_metric([self.service, str(load["rank"]), value], load[key])
            yield family


__all__ = ["REGISTRY", "Collector", "GaugeMetricFamily", "LoadCollector", "request_done", "start_metrics_server"]


def request_done(service: str, status: str, reason: str = "") -> None:
    REQUESTS.labels(service, status, reason).inc()


def start_metrics_server(port: int | None, host: str = "127.0.0.1", port_file: str | None = None) -> int | None:
    """Serve /metrics on the service's own host (not every interface); None: no metrics server. Port 0
    binds a free port, written to `{port_file}.metrics` so launchers and tests never race for one."""
    if port is None:
        return None
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    bound = server.server_port
    if port_file:
        tmp = Path(f"{port_file}.metrics.tmp")
        tmp.write_text(str(bound))
        tmp.replace(f"{port_file}.metrics")
    return bound
