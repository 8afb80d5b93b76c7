"""`pdserve up` as a supervisor, as Kubernetes is for the chart: a service that exits (killed, crashed, drained
after its own SIGTERM) is started again on the same ports, with a back-off when it keeps failing; the rest of the
cluster goes on serving meanwhile (the router migrates what ran on a lost decode instance, fails a prefill over,
and takes a restarted instance back by reconnecting). Only `pdserve up`'s own SIGINT / SIGTERM stops everything.

Restarts are logged and counted (`pdserve_up_restarts_total{service,pool}` on the launcher's /metrics). With
--autoscale, LocalAutoscaler starts and drains instances to the sizes the router decides; `supervise_cluster` is
`pdserve up` once its flags are parsed: start, banner, supervise until stopped."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from router.autoscale import AutoscaleConfig, Target
from router.cluster import Cluster
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


class LocalAutoscaler:
    """`pdserve up --autoscale MIN:MAX`: the router decides each pool's size (router.autoscale, exported as
    pdserve_router_desired_instances); this loop starts instances (in parallel) or drains them to match.
    Runs on its own thread; `history` keeps (time, sizes) after each change."""

    def __init__(self, cluster: Cluster, period: float = 1.0):
        self.cluster, self.period = cluster, period
        self.history: list[tuple[float, Target]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscale", daemon=True)

    def start(self) -> LocalAutoscaler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def sizes(self) -> Target:
        return Target(len(self.cluster.prefill_addrs), len(self.cluster.decode_addrs))

    def desired(self) -> Target | None:
        port = self.cluster.metrics_ports[self.cluster.address]
        with urllib.request.urlopen(f"http://{self.cluster.host}:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        found = dict(re.findall(r'^pdserve_router_desired_instances\{pool="(\w+)"\} ([0-9.]+)$', text, re.M))
        return Target(int(float(found["prefill"])), int(float(found["decode"]))) if len(found) == 2 else None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            have, want = self.sizes(), self.desired()
            if want is None or want == have:
                continue
            print(f"autoscale: prefill {have.prefill} → {want.prefill}, decode {have.decode} → {want.decode}",
                  flush=True)
            adds = [kind for kind, n, m in (("prefill", have.prefill, want.prefill),
                                            ("decode", have.decode, want.decode)) for _ in range(m - n)]
            try:
                # started here, on this long-lived thread (a service dies with the thread that started it),
                # then waited for together: the new instances load their models at once
                started = [(kind, *self.cluster.start_instance(kind)) for kind in adds]
                with ThreadPoolExecutor(max(1, len(started))) as pool:
                    for kind, address in zip(adds, pool.map(lambda s: self.cluster.join_instance(*s), started),
                                             strict=True):
                        print(f"autoscale: + {kind} {address}", flush=True)
                for kind, n, m in (("prefill", have.prefill, want.prefill), ("decode", have.decode, want.decode)):
                    for _ in range(n - m):
                        print(f"autoscale: - {kind} {self.cluster.remove_instance(kind)} (draining)", flush=True)
            except (RuntimeError, OSError, ValueError) as exc:  # an instance that failed to start: try again later
                print(f"autoscale: {exc}", file=sys.stderr, flush=True)
            self.history.append((time.monotonic(), self.sizes()))


def supervise_cluster(cluster: Cluster, restarts: SupervisorConfig, autoscaling: AutoscaleConfig) -> None:
    """`pdserve up`: start the cluster, print where everything is, then supervise it (and, with --autoscale,
    size its pools) until SIGINT / SIGTERM; stop it all on the way out."""
    print(f"starting {cluster.num_prefill} prefill + {cluster.num_decode} decode + router on {cluster.model} ...",
          flush=True)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (background jobs)
        signal.signal(sig, interrupt)
    cluster.start()
    _banner(cluster)
    scaler = LocalAutoscaler(cluster).start() if autoscaling.autoscale else None
    if scaler is not None:
        print(f"autoscaling each pool within {autoscaling.autoscale} instances (the router decides every "
              f"{autoscaling.autoscale_period:g} s)")
    supervisor = Supervisor(cluster, restarts)
    print(f"supervising: a service that exits is started again (restarts counted at "
          f"http://{cluster.host}:{supervisor.serve_metrics()}/metrics)")
    print("Ctrl-C to stop", flush=True)
    try:
        run_supervised(supervisor)
    except KeyboardInterrupt:
        pass
    finally:
        if scaler is not None:
            scaler.stop()
        cluster.stop()
        print("stopped")


def _banner(cluster: Cluster) -> None:
    """Where the started cluster serves: the router, the pools, the HTTP API, TLS, every /metrics."""
    print(f"pdserve up: router at {cluster.address}; prefill {cluster.prefill_addrs}; decode {cluster.decode_addrs}")
    if cluster.http_address:
        scheme = "https" if cluster.certs is not None else "http"
        print(f"OpenAI-compatible HTTP API at {scheme}://{cluster.http_address}/v1 "
              f"(model {cluster.served_model_name})")
    if cluster.kserve_address:
        print(f"KServe v2 gRPC (Open Inference Protocol) at {cluster.kserve_address} (model "
              f"{cluster.served_model_name})")
    if cluster.epp_address:
        print(f"Gateway API Inference Extension endpoint picker (Envoy ext_proc) at {cluster.epp_address}")
    if cluster.certs is not None:
        print(f"mutual TLS on every hop; clients verify the router with --tls-ca {cluster.certs.ca}")
    print("metrics: " + "; ".join(f"{cluster.service_name(a)} http://{cluster.host}:{port}/metrics"
                                  for a, port in cluster.metrics_ports.items()))
