"""`pdserve up`'s cluster on one host: the router, M prefill and N decode services as subprocesses on loopback,
each reporting the port it bound through a port file; a service started again on its own ports (the
supervisor's respawn), instances added and drained at run time (the local autoscaler)."""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.deploy import Deployment, EngineSpec
from shared.config import ServiceConfig, same_as
from shared.rpc.certs import CertFiles, make_cluster_certs
from shared.rpc.forkserver import ForkServer
from shared.rpc.service import LAUNCHER_ENV, TOKEN_ENV, Credentials, channel

DEFAULT_MODEL = "models/demo-v32"  # the trained demo model (KJV English), committed
TINY_MODEL = "models/tiny-v32"  # random weights, generated on first use where the demo model is absent

def default_model() -> str:
    """The demo model when present (a checkout has it), else the embedded tiny model, generated on first
    use by a child process (writing weights needs torch; the command line itself never loads it)."""
    if (Path(DEFAULT_MODEL) / "config.json").exists():
        return DEFAULT_MODEL
    if not (Path(TINY_MODEL) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "shared.loader.tiny", TINY_MODEL], check=True)
    return TINY_MODEL


FORKED_SERVICES = ("decode_service", "prefill_service")  # started by the fork server (shared.rpc.forkserver)
_fork_server: ForkServer | None = None
_fork_server_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This launcher's fork server: one per process, started on first use, for every cluster it runs."""
    global _fork_server
    with _fork_server_lock:
        if _fork_server is None:
            _fork_server = ForkServer([f"{m}.server" for m in FORKED_SERVICES],
                                      {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_ENV: str(os.getpid())})
        return _fork_server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port_file(path: Path, timeout: float, proc: subprocess.Popen) -> int:
    """The port a service wrote to `path` once it was serving (fails fast if the process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args[2:4])} exited with {proc.returncode} before serving")
        time.sleep(0.1)
    raise TimeoutError(f"no port reported in {path} within {timeout}s")


def wait_serving(address: str, timeout: float = 180.0, proc: subprocess.Popen | None = None,
                 credentials: Credentials | None = None) -> None:
    """Block until the gRPC health check at `address` says SERVING."""
    deadline = time.monotonic() + timeout
    with channel(address, credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                time.sleep(0.02)  # not yet: asking in a tight loop takes the cores the service is starting on
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"{address} did not become SERVING within {timeout}s")


@dataclass
class Cluster:
    """Router + M prefill + N decode subprocesses on loopback."""

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    port: int = 0
    kv_transport: str = same_as(ServiceConfig, "kv_transport")
    dtype: str = same_as(ServiceConfig, "dtype")
    indexer_numerics: str = same_as(ServiceConfig, "indexer_numerics")
    quantization: str = same_as(ServiceConfig, "quantization")  # both prefill and decode
    kv_cache_dtype: str = same_as(ServiceConfig, "kv_cache_dtype")  # both (they must agree)
    offload_layers: str = same_as(ServiceConfig, "offload_layers")
    offload_buffers: int = same_as(ServiceConfig, "offload_buffers")  # passed only with offload_layers
    share_weights_dir: str = ""  # e.g. /dev/shm/pdserve: the co-located services map one copy of the weights
    host: str = "127.0.0.1"
    extra_prefill: list[str] = field(default_factory=list)
    extra_decode: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(32))  # the cluster's secret, one per start
    tls: bool = False  # mutual TLS on every hop with a CA and certificate made for this start
    extra_router: list[str] = field(default_factory=list)
    certs: CertFiles | None = None
    elastic: bool = False  # the router follows pool files: instances join and leave at run time (--autoscale)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # service address → its /metrics port
    http_address: str = ""  # the router's OpenAI-compatible HTTP API (host:port), when --http-port is given
    kserve_address: str = ""  # the router's KServe v2 gRPC API (host:port), when --kserve-port is given
    epp_address: str = ""  # the router's endpoint picker (Envoy ext_proc), when --epp-port is given
    fork_services: bool = True  # prefill and decode fronts forked from a fork server that imported them once
    _commands: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # address → (name, argv)
    _by_address: dict[str, subprocess.Popen] = field(default_factory=dict)
    _draining: list[subprocess.Popen] = field(default_factory=list)  # removed instances on their way out
    _pool_dir: Path = field(default_factory=Path)
    _added: Iterator[int] = field(default_factory=lambda: itertools.count(100))  # names of added instances
    _lock: threading.Lock = field(default_factory=threading.Lock)
    procs: list[subprocess.Popen] = field(default_factory=list)
    prefill_addrs: list[str] = field(default_factory=list)
    decode_addrs: list[str] = field(default_factory=list)
    address: str = ""

    def restart(self, address: str, timeout: float = 240.0) -> None:
        """Start the service that served `address` again on the same ports (after it died or was
        killed; a live one is killed first), and wait until it serves."""
        old = self._by_address.get(address)
        if old is not None and old.poll() is None:
            old.kill()
            old.wait(10)
        proc = self.respawn(address)
        wait_serving(address, timeout, proc, self.credentials)
        self.listening_again(address, proc.pdserve_port_file)

    def respawn(self, address: str) -> subprocess.Popen:
        """Start the service that served `address` again, on the same gRPC port (and the router on the same
        HTTP port), without waiting: the router finds a restarted instance by reconnecting, clients find a
        restarted router where it was. It reports to `proc.pdserve_port_file` once it listens."""
        name, args = self._commands[address]
        pinned = {"--port": address.rpartition(":")[2]}
        if address == self.address:
            for flag, where in (("--http-port", self.http_address), ("--kserve-port", self.kserve_address),
                                ("--epp-port", self.epp_address)):
                if where:
                    pinned[flag] = where.rpartition(":")[2]
        port_file = Path(tempfile.mkdtemp(prefix="pdserve-restart-")) / name
        pinned["--port-file"] = str(port_file)
        args = [pinned.get(prev, a) for prev, a in zip(["", *args], args)]
        if "--port-file" not in args:
            args += ["--port-file", str(port_file)]
        proc = self._spawn(name, args)
        proc.pdserve_port_file = port_file  # type: ignore[attr-defined]
        self._by_address[address] = proc
        return proc

    def listening_again(self, address: str, port_file: Path) -> None:
        """A respawned service listens: take in its new metrics port and drop its port file."""
        self._read_metrics_port(address, port_file)
        shutil.rmtree(port_file.parent, ignore_errors=True)

    @property
    def served_model_name(self) -> str:
        """The HTTP API's model id: the router's --served-model-name, else the model directory's name."""
        flags = self.extra_router
        named = [v for f, v in zip(flags, flags[1:]) if f == "--served-model-name"]
        return named[-1] if named else Path(self.model).resolve().name

    def service_name(self, address: str) -> str:
        """decode0, prefill1, router, ...: the name its log file has."""
        return self._commands[address][0]

    def _read_metrics_port(self, address: str, port_file: Path) -> None:
        metrics_file = Path(f"{port_file}.metrics")
        if metrics_file.exists():
            self.metrics_ports[address] = int(metrics_file.read_text())

    def process(self, address: str) -> subprocess.Popen:
        """The process serving `address` (router, prefill or decode)."""
        return self._by_address[address]

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token,  # by environment: not in `ps`
               LAUNCHER_ENV: str(os.getpid())}  # it dies with its parent: this thread or the fork server
        proc = None
        if self.fork_services and args[0] in FORKED_SERVICES:  # else, or where it cannot fork: a new interpreter
            proc = fork_server().spawn(args[0], args[1:], env, str(log) if log else None)
        if proc is None:
            out = open(log, "a") if log else subprocess.DEVNULL  # lives as long as the process
            proc = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        proc.pdserve_command = (name, args)  # type: ignore[attr-defined] - what restart() runs again
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 240.0) -> Cluster:
        """Every service binds port 0 (the router too unless `port` is set) and reports the port it
        got through a port file, so concurrent clusters never race for ports."""
        common = ["--model", self.model, "--host", self.host, "--metrics-port", "0"]  # every service's /metrics
        engine = EngineSpec(dtype=self.dtype, indexer_numerics=self.indexer_numerics, kv_transport=self.kv_transport,
                            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                            offload_layers=self.offload_layers, offload_buffers=self.offload_buffers,
                            share_weights_dir=self.share_weights_dir).flags()  # rendered as the chart renders it
        if self.fork_services:
            fork_server().start()  # its imports overlap the certificates' making
        ports = Path(tempfile.mkdtemp(prefix="pdserve-ports-"))
        if self.tls and self.certs is None:
            self._cert_dir = tempfile.mkdtemp(prefix="pdserve-tls-")
            self.certs = make_cluster_certs(self._cert_dir, [self.host])
        if self.certs is not None:
            common += self.certs.flags()
        # The router starts beside the instances, on pool files that list nothing until they listen (it reads them
        # again within 50 ms while they are empty): its imports overlap the instances' start.
        self._pool_dir = Path(tempfile.mkdtemp(prefix="pdserve-pools-"))
        self._write_pools()
        if self.elastic:  # the router re-reads the pool files; add_instance / remove_instance rewrite them
            self.extra_router += ["--discovery-interval", "1", "--metrics-port", "0"]
        try:
            router_file = ports / "router"
            router = self._spawn("router", ["router", *common, "--port", str(self.port), "--port-file",
                                            str(router_file), "--prefill", f"file:{self._pool_dir / 'prefill'}",
                                            "--decode", f"file:{self._pool_dir / 'decode'}", *self.extra_router])
            started = []
            for kind, n, extra in (("decode", self.num_decode, self.extra_decode),
                                   ("prefill", self.num_prefill, self.extra_prefill)):
                for i in range(n):
                    file = ports / f"{kind}{i}"
                    proc = self._spawn(f"{kind}{i}", [f"{kind}_service", *common, "--port", "0", "--port-file",
                                                      str(file), *engine, *extra])
                    started.append((kind, file, proc))
            self.procs.remove(router)  # procs in the order callers index them: decodes, prefills, the router
            self.procs.append(router)
            for kind, file, proc in started:  # the models load in parallel; collect the ports
                addr = f"{self.host}:{wait_port_file(file, timeout, proc)}"
                (self.decode_addrs if kind == "decode" else self.prefill_addrs).append(addr)
                self._read_metrics_port(addr, file)
                self._by_address[addr] = proc
                self._commands[addr] = proc.pdserve_command
            self._write_pools()
            self.address = f"{self.host}:{wait_port_file(router_file, timeout, router)}"
            self._by_address[self.address] = router
            self._read_metrics_port(self.address, router_file)
            http_file = Path(f"{router_file}.http")
            if http_file.exists():  # written before the router's port file
                self.http_address = f"{self.host}:{int(http_file.read_text())}"
            if (kserve_file := Path(f"{router_file}.kserve")).exists():
                self.kserve_address = f"{self.host}:{int(kserve_file.read_text())}"
            if (epp_file := Path(f"{router_file}.epp")).exists():
                self.epp_address = f"{self.host}:{int(epp_file.read_text())}"
            self._commands[self.address] = router.pdserve_command
            for addr in [*self.decode_addrs, *self.prefill_addrs, self.address]:
                wait_serving(addr, timeout, credentials=self.credentials)
        except BaseException:
            self.stop()
            raise
        finally:
            shutil.rmtree(ports, ignore_errors=True)
        return self

    def _write_pools(self) -> None:
        for kind, addrs in (("prefill", self.prefill_addrs), ("decode", self.decode_addrs)):
            tmp = self._pool_dir / f"{kind}.tmp"
            tmp.write_text("\n".join(addrs) + "\n")
            tmp.replace(self._pool_dir / kind)  # the router never reads half a file

    def add_instance(self, kind: str, timeout: float = 240.0) -> str:
        """Start one more `kind` instance like the first of its pool and, once it serves, list it for the
        router (elastic clusters); its address. It lives as long as the calling thread."""
        return self.join_instance(kind, *self.start_instance(kind), timeout=timeout)

    def start_instance(self, kind: str) -> tuple[subprocess.Popen, Path]:
        """Spawn one more `kind` instance like the first of its pool (see join_instance); the process and
        its port file."""
        addrs = self.prefill_addrs if kind == "prefill" else self.decode_addrs
        with self._lock:  # several may start at once
            name, args = self._commands[addrs[0]]
            index = next(self._added)
            port_file = self._pool_dir / f"{kind}{index}.port"
            args = [("0" if prev == "--port" else str(port_file) if prev == "--port-file" else a)
                    for prev, a in zip(["", *args], args)]
            return self._spawn(f"{kind}{index}", args), port_file

    def join_instance(self, kind: str, proc: subprocess.Popen, port_file: Path, timeout: float = 240.0) -> str:
        """Wait until a started instance serves, then list it for the router; its address."""
        addrs = self.prefill_addrs if kind == "prefill" else self.decode_addrs
        address = f"{self.host}:{wait_port_file(port_file, timeout, proc)}"
        wait_serving(address, timeout, proc, self.credentials)
        with self._lock:
            self._by_address[address] = proc
            self._commands[address] = proc.pdserve_command
            self._read_metrics_port(address, port_file)
            addrs.append(address)
            self._write_pools()
        return address

    def remove_instance(self, kind: str, grace: float = 1.5) -> str:
        """Take the newest `kind` instance out of the router's list, then SIGTERM it: a decode instance
        drains (its running requests move to the others at once), a prefill finishes what it started. It
        exits on its own; the cluster no longer watches it. Its address."""
        addrs = self.prefill_addrs if kind == "prefill" else self.decode_addrs
        if len(addrs) <= 1:
            raise ValueError(f"the {kind} pool keeps at least one instance")
        address = addrs.pop()
        self._write_pools()
        time.sleep(grace)  # the router re-reads the list (a request placed meanwhile is refused and fails over)
        proc = self._by_address[address]
        self.procs.remove(proc)
        proc.send_signal(signal.SIGTERM)
        self._draining.append(proc)
        return address

    def stop(self) -> None:
        self.procs += [p for p in self._draining if p.poll() is None]
        self._draining.clear()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()
        if getattr(self, "_cert_dir", None):
            shutil.rmtree(self._cert_dir, ignore_errors=True)
        if self._pool_dir != Path():
            shutil.rmtree(self._pool_dir, ignore_errors=True)

    @property
    def credentials(self) -> Credentials:
        """This cluster's credentials: its token and, with TLS, its certificate files."""
        files = (str(self.certs.cert), str(self.certs.key), str(self.certs.ca)) if self.certs else (None,) * 3
        return Credentials(self.token, False, *files)

    def channel(self, address: str) -> grpc.Channel:
        """A channel with this cluster's credentials (to call the router, or an internal service directly)."""
        return channel(address, self.credentials)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_from_deployment(dep: Deployment, model: str, log_dir: Path | None = None) -> Cluster:
    """A local Cluster running `dep`: same service flags as the chart, but every port picked by the
    service (one host: fixed KV ports would collide) and metrics on a free port each."""
    def local(flags: list[str]) -> list[str]:
        out = list(flags)
        if "--kv-port" in out:
            out[out.index("--kv-port") + 1] = "0"
        return out

    e = dep.engine
    return Cluster(model, dep.prefill.instances, dep.decode.instances, dep.router.port, e.kv_transport,
                   e.dtype, e.indexer_numerics, e.quantization, e.kv_cache_dtype, e.offload_layers.strip(),
                   e.offload_buffers, e.weights_dir, tls=dep.tls.enabled, log_dir=log_dir,
                   extra_prefill=local(dep.flags("prefill")), extra_decode=local(dep.flags("decode")),
                   extra_router=dep.flags("router"))
