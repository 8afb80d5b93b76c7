"""`pdserve up` as a supervisor, as Kubernetes is for the chart: a service that exits (killed, crashed, drained
after its own SIGTERM) is started again on the same ports, with a back-off when it keeps failing; the rest of the
cluster goes on serving meanwhile (the router migrates what ran on a lost decode instance, fails a prefill over,
and takes a restarted instance back by reconnecting). Only `pdserve up`'s own SIGINT / SIGTERM stops everything.

Restarts are logged and counted (`pdserve_up_restarts_total{service,pool}` on the launcher's /metrics)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from shared.config import check_bounds, flag, flag_name


class Supervised(Protocol):
    """What the supervisor needs of a cluster (router.cli.Cluster)."""

    host: str
    address: str  # the router's
    prefill_addrs: list[str]
    decode_addrs: list[str]
    metrics_ports: dict[str, int]

    def process(self, address: str) -> subprocess.Popen: ...
    def service_name(self, address: str) -> str: ...
    def respawn(self, address: str) -> subprocess.Popen: ...
    def listening_again(self, address: str, port_file: Path) -> None: ...


@dataclass
class SupervisorConfig:
    """`pdserve up`'s restart policy."""

    restart_backoff_max: float = flag(30.0, "longest wait before restarting a service that keeps exiting (the wait "
                                            "doubles from 1 s with each exit soon after a start)", bounds=(0.0, None))
    restart_stable_after: float = flag(60.0, "a service up this long is healthy again: its next exit restarts it at "
                                             "once", bounds=(0.0, None))
    supervisor_metrics_port: int = flag(0, "serve pdserve up's own /metrics (restarts per service) on this port "
                                           "(0: a free one, printed at start)", bounds=(0, 65535))

    def __post_init__(self) -> None:
        check_bounds(self, flag_name)


@dataclass
class Watched:
    """One supervised service: its process, when it started, and the restarts it needed."""

    name: str
    pool: str  # router, prefill or decode
    started: float = field(default_factory=time.monotonic)
    quick_exits: int = 0  # exits soon after a start, in a row: the back-off's exponent
    restart_at: float | None = None  # set while it waits to be started again
    port_file: Path | None = None  # a restarted service reports here once it listens


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Polled from `pdserve up`'s main thread (a service dies with the thread that started it, so restarts are
    spawned from the one that lives as long as the launcher)."""

    def __init__(self, cluster: Supervised, cfg: SupervisorConfig | None = None):
        self.cluster, self.cfg = cluster, cfg or SupervisorConfig()
        self.registry = CollectorRegistry()
        self.restarts = Counter("pdserve_up_restarts", "Services pdserve up started again after they exited",
                                ["service", "pool"], registry=self.registry)
        self.up = Gauge("pdserve_up_service_running", "1 while the service's process runs", ["service", "pool"],
                        registry=self.registry)
        self.watched: dict[str, Watched] = {}
        self.metrics_port: int | None = None

    def serve_metrics(self) -> int:
        server, _ = start_http_server(self.cfg.supervisor_metrics_port, addr=self.cluster.host,
                                      registry=self.registry)
        self.metrics_port = server.server_port
        return self.metrics_port

    def addresses(self) -> list[tuple[str, str]]:
        """(address, pool) of every service the cluster runs now (drained-away instances are not watched)."""
        c = self.cluster
        return [(c.address, "router"), *((a, "prefill") for a in list(c.prefill_addrs)),
                *((a, "decode") for a in list(c.decode_addrs))]

    def poll(self, now: float | None = None) -> None:
        """One look at every service: note exits, start again the ones whose back-off has passed, and
        notice restarted ones that listen again."""
        now = time.monotonic() if now is None else now
        for address, pool in self.addresses():
            proc = self.cluster.process(address)
            w = self.watched.get(address)
            if w is None:
                w = self.watched[address] = Watched(self.cluster.service_name(address), pool)
            self.up.labels(w.name, pool).set(1 if proc.poll() is None else 0)
            if w.port_file is not None and proc.poll() is None and w.port_file.exists():
                self.cluster.listening_again(address, w.port_file)
                port = self.cluster.metrics_ports.get(address)
                self._say(f"{w.name} ({address}) listens again" + (
                    f"; metrics at http://{self.cluster.host}:{port}/metrics" if port else ""))
                w.port_file = None
            if w.restart_at is None and proc.poll() is not None:
                self._exited(address, w, proc.returncode, now)
            if w.restart_at is not None and now >= w.restart_at:
                self._restart(address, w, now)

    def _exited(self, address: str, w: Watched, code: int, now: float) -> None:
        if now - w.started >= self.cfg.restart_stable_after:
            w.quick_exits = 0
        wait = 0.0 if w.quick_exits == 0 else min(self.cfg.restart_backoff_max, 2.0 ** (w.quick_exits - 1))
        w.quick_exits += 1
        w.restart_at, w.port_file = now + wait, None
        self._say(f"{w.name} ({address}) {describe_exit(code)}; restarting"
                  + (f" in {wait:g} s" if wait else "") + f" (restart {w.quick_exits} in a row)")

    def _restart(self, address: str, w: Watched, now: float) -> None:
        try:
            proc = self.cluster.respawn(address)
        except OSError as exc:  # could not even spawn: try again after the next back-off
            self._say(f"{w.name}: cannot start: {exc}")
            self._exited(address, w, -1, now)
            return
        self.restarts.labels(w.name, w.pool).inc()
        w.started, w.restart_at, w.port_file = now, None, proc.pdserve_port_file  # type: ignore[attr-defined]

    @staticmethod
    def _say(text: str) -> None:
        print(f"pdserve up: {text}", file=sys.stderr, flush=True)


def run_supervised(supervisor: Supervisor, period: float = 0.5) -> None:
    """Supervise until KeyboardInterrupt (pdserve up's SIGINT / SIGTERM handler raises it)."""
    while True:
        supervisor.poll()
        time.sleep(period)

