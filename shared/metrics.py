"""Prometheus metrics shared by every service (one registry per process, served on --metrics-port)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter("pdserve_requests_total", "Requests handled", ["service", "outcome"])
TOKENS = Counter("pdserve_tokens_total", "Tokens processed", ["service", "kind"])
TTFT = Histogram("pdserve_ttft_seconds", "Time to first token seen by the router", buckets=_LATENCY)
TPOT = Histogram("pdserve_tpot_seconds", "Time per output token after the first", buckets=_LATENCY)
PREFILL_SECONDS = Histogram("pdserve_prefill_seconds", "Prefill compute + push per request", buckets=_LATENCY)
KV_BYTES = Counter("pdserve_kv_transfer_bytes_total", "KV bytes pushed to decode", ["transport"])
KV_FREE_BLOCKS = Gauge("pdserve_kv_free_blocks", "Free KV blocks", ["service"])
KV_TOTAL_BLOCKS = Gauge("pdserve_kv_total_blocks", "KV blocks in the pool", ["service"])
ACTIVE_LEASES = Gauge("pdserve_active_leases", "KV reservations not yet claimed")
RUNNING = Gauge("pdserve_running_requests", "Requests in the engine's running batch", ["service"])


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
