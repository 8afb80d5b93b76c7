"""`pdserve` command line.

    pdserve up [--model DIR] [--num-prefill M] [--num-decode N] [--port 50051] [--kv-transport tcp|mooncake]
               [--quantization w8a8] [--kv-cache-dtype int8] [--offload-layers 2-10] [--share-weights-dir DIR]
        all-in-one on loopback: router + M prefill + N decode subprocesses; default model is the
        demo model (models/demo-v32; the random tiny model where it is absent); Ctrl-C stops all.
    pdserve generate "text" | --prompt-token-ids 1 2 3 [--chat [--thinking]] [--address 127.0.0.1:50051] ...
        streams one request to the terminal (--chat: the text as a user message, chat-encoded).
    pdserve chat [--system TEXT] [--thinking] [--address 127.0.0.1:50051]
        interactive multi-turn chat.
    pdserve certs --out DIR [--host H ...]
        a cluster CA + node certificate for the services' --tls-cert/--tls-key/--tls-ca.
    pdserve profile [--router ADDR | --model DIR] [--out profile.json]
        measures prefill and decode curves (through a running router, or in-process) → the router's PerfModel.
    pdserve plan --rate R --ttft-p90 MS --tpot-p90 MS [--profile profile.json] [--isl 128] [--osl 128] ...
        M prefill / N decode instances for the workload (analytic, then simulated with the router's policy).
    pdserve convert --src DIR --dst DIR --format w8a8 [--ep N] [--max-shard-gb 5]
        offline W8A8 INT8 conversion of an FP8 / bf16 checkpoint, tensor by tensor (--ep: per-rank expert files).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.autoscale import AutoscaleConfig, Bounds, Target
from router.deploy import Deployment, EngineSpec
from router.perf import PerfModel, profile_engine, profile_served
from router.planner import Dist, Workload, run_plan
from router.server import RouterConfig
from router.supervise import Supervisor, SupervisorConfig, run_supervised
from shared.config import DecodeConfig, PrefillConfig, ServiceConfig, add_flags, from_flags, same_as
from shared.protocol.chat import EOS, split_reasoning
from shared.rpc.certs import CertFiles, make_cluster_certs
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.rpc.service import LAUNCHER_ENV, TOKEN_ENV, Credentials, channel

DEFAULT_MODEL = "models/demo-v32"  # the trained demo model (KJV English), committed
TINY_MODEL = "models/tiny-v32"  # random weights, generated on first use where the demo model is absent
# the engine flags `pdserve up` takes for prefill and decode alike (declared on ServiceConfig)
UP_ENGINE_FLAGS = ("kv_transport", "mooncake_protocol", "mooncake_devices", "dtype", "indexer_numerics",
                   "quantization", "kv_cache_dtype", "offload_layers", "offload_buffers", "share_weights_dir",
                   "speculative", "num_speculative_tokens")


def default_model() -> str:
    """The demo model when present (a checkout has it), else the embedded tiny model, generated on first
    use by a child process (writing weights needs torch; the command line itself never loads it)."""
    if (Path(DEFAULT_MODEL) / "config.json").exists():
        return DEFAULT_MODEL
    if not (Path(TINY_MODEL) / "config.json").exists():
        subprocess.run([sys.executable, "-m", "shared.loader.tiny", TINY_MODEL], check=True)
    return TINY_MODEL


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
        if address == self.address and self.http_address:
            pinned["--http-port"] = self.http_address.rpartition(":")[2]
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
        out = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "a")  # lives as long as the process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token,  # by environment: not in `ps`
               LAUNCHER_ENV: str(os.getpid())}  # the service dies with the thread that starts it here
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
        ports = Path(tempfile.mkdtemp(prefix="pdserve-ports-"))
        if self.tls and self.certs is None:
            self._cert_dir = tempfile.mkdtemp(prefix="pdserve-tls-")
            self.certs = make_cluster_certs(self._cert_dir, [self.host])
        if self.certs is not None:
            common += self.certs.flags()
        try:
            started = []
            for kind, n, extra in (("decode", self.num_decode, self.extra_decode),
                                   ("prefill", self.num_prefill, self.extra_prefill)):
                for i in range(n):
                    file = ports / f"{kind}{i}"
                    proc = self._spawn(f"{kind}{i}", [f"{kind}_service", *common, "--port", "0", "--port-file",
                                                      str(file), *engine, *extra])
                    started.append((kind, file, proc))
            for kind, file, proc in started:  # the models load in parallel; collect the ports
                addr = f"{self.host}:{wait_port_file(file, timeout, proc)}"
                (self.decode_addrs if kind == "decode" else self.prefill_addrs).append(addr)
                self._read_metrics_port(addr, file)
                self._by_address[addr] = proc
                self._commands[addr] = proc.pdserve_command
            file = ports / "router"
            pools = [",".join(self.prefill_addrs), ",".join(self.decode_addrs)]
            if self.elastic:  # the router re-reads the pool files; add_instance / remove_instance rewrite them
                self._pool_dir = Path(tempfile.mkdtemp(prefix="pdserve-pools-"))
                self._write_pools()
                pools = [f"file:{self._pool_dir / 'prefill'}", f"file:{self._pool_dir / 'decode'}"]
                self.extra_router += ["--discovery-interval", "1", "--metrics-port", "0"]
            proc = self._spawn("router", ["router", *common, "--port", str(self.port), "--port-file", str(file),
                                          "--prefill", pools[0], "--decode", pools[1], *self.extra_router])
            self.address = f"{self.host}:{wait_port_file(file, timeout, proc)}"
            self._by_address[self.address] = proc
            self._read_metrics_port(self.address, file)
            http_file = Path(f"{file}.http")
            if http_file.exists():  # written before the router's port file
                self.http_address = f"{self.host}:{int(http_file.read_text())}"
            self._commands[self.address] = proc.pdserve_command
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
        if self.elastic:
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


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """`--config FILE` (the deployment description the Helm chart also reads), else the flags."""
    if args.config:
        return Deployment.from_yaml(args.config)
    return Deployment.from_dict({
        "engine": {"dtype": args.dtype, "indexerNumerics": args.indexer_numerics, "kvTransport": args.kv_transport,
                   "mooncake": {"protocol": args.mooncake_protocol, "devices": args.mooncake_devices},
                   "quantization": args.quantization, "kvCacheDtype": args.kv_cache_dtype,
                   "offloadLayers": args.offload_layers, "offloadBuffers": args.offload_buffers,
                   "shareWeightsDir": args.share_weights_dir, "speculative": args.speculative,
                   "numSpeculativeTokens": args.num_speculative_tokens},
        "prefill": {"instances": args.num_prefill, "cp": args.prefill_cp, "tp": args.prefill_tp,
                    "ep": args.prefill_ep, "layerSharding": args.layer_sharding, "noPrefixCache": args.no_prefix_cache},
        "decode": {"instances": args.num_decode, "dp": args.decode_dp, "tp": args.decode_tp, "ep": args.decode_ep,
                   "layerSharding": args.layer_sharding,
                   "speculativeMaxDraftTokens": args.speculative_max_draft_tokens},
        "router": {"port": args.port, "localPrefillTokens": args.local_prefill_tokens, "httpPort": args.http_port,
                   "ttftSloMs": args.ttft_slo_ms, "tpotSloMs": args.tpot_slo_ms, "drainSeconds": args.drain_seconds,
                   "apiKeyFile": args.api_key_file,
                   "servedModelName": args.served_model_name, "chatMaxTokens": args.chat_max_tokens,
                   "profile": args.profile},
        "tls": {"enabled": args.tls}})


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


def cluster_from_args(args: argparse.Namespace, log_dir: Path | None = None) -> Cluster:
    """The Cluster `pdserve up` starts from its parsed flags (not started yet); ValueError naming a bad one."""
    dep = deployment_from_args(args)
    model = args.model or (dep.model.path if args.config and Path(dep.model.path).is_dir() else None) \
        or default_model()
    cluster = cluster_from_deployment(dep, model, log_dir)
    if args.config:  # the description's router files and model name, given (or replaced) on the command line
        for flag, value in (("--api-key-file", args.api_key_file), ("--profile", args.profile),
                            ("--served-model-name", args.served_model_name)):
            if value is not None:
                cluster.extra_router += [flag, value]
    if args.autoscale:  # the router decides the pools' sizes, the cluster follows (LocalAutoscaler)
        Bounds.parse(args.autoscale)
        cluster.elastic = True
        cluster.extra_router += ["--autoscale", args.autoscale, "--autoscale-period", str(args.autoscale_period),
                                 "--autoscale-down-after", str(args.autoscale_down_after),
                                 "--autoscale-headroom", str(args.autoscale_headroom),
                                 "--autoscale-window", str(args.autoscale_window)]
    return cluster


def cmd_up(args: argparse.Namespace) -> None:
    try:
        cluster = cluster_from_args(args, Path(args.log_dir) if args.log_dir else None)
        restarts = from_flags(SupervisorConfig, args)
    except (ValueError, OSError) as exc:  # a bad flag or description: one line naming the key, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    model = cluster.model
    print(f"starting {cluster.num_prefill} prefill + {cluster.num_decode} decode + router on {model} ...",
          flush=True)
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (background jobs)
        signal.signal(sig, interrupt)
    cluster.start()
    print(f"pdserve up: router at {cluster.address}; prefill {cluster.prefill_addrs}; decode {cluster.decode_addrs}")
    if cluster.http_address:
        scheme = "https" if cluster.certs is not None else "http"
        print(f"OpenAI-compatible HTTP API at {scheme}://{cluster.http_address}/v1 "
              f"(model {cluster.served_model_name})")
    if cluster.certs is not None:
        print(f"mutual TLS on every hop; clients verify the router with --tls-ca {cluster.certs.ca}")
    print("metrics: " + "; ".join(f"{cluster.service_name(a)} http://{cluster.host}:{port}/metrics"
                                  for a, port in cluster.metrics_ports.items()))
    scaler = LocalAutoscaler(cluster).start() if args.autoscale else None
    if scaler is not None:
        print(f"autoscaling each pool within {args.autoscale} instances (the router decides every "
              f"{args.autoscale_period:g} s)")
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


def sampling_args(args: argparse.Namespace) -> generation_pb2.SamplingParams:
    sp = generation_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, ignore_eos=args.ignore_eos, stop=args.stop or [],
                                       skip_special_tokens=not args.keep_special_tokens)
    if args.seed is not None:
        sp.seed = args.seed
    return sp


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    common = {"sampling_params": sampling_args(args), "priority": args.priority,
              "sla": generation_pb2.Sla(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)}
    if args.chat:  # the prompt as one user turn, rendered with the model's chat encoding by the router
        return generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="user", content=args.prompt)],
                                              thinking=args.thinking, **common)
    return generation_pb2.GenerateRequest(prompt=args.prompt or "", prompt_token_ids=args.prompt_token_ids or [],
                                          **common)


def client_channel(args: argparse.Namespace) -> grpc.Channel:
    """The router's public port: plain, or TLS verified with --tls-ca (no client certificate needed)."""
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)
    return grpc.secure_channel(args.address, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()))


def cmd_certs(args: argparse.Namespace) -> None:
    files = make_cluster_certs(args.out, args.host or [], args.days)
    print(f"CA {files.ca}\ncertificate {files.cert}\nkey {files.key}\nservice flags: {' '.join(files.flags())}")


def cmd_generate(args: argparse.Namespace) -> None:
    with client_channel(args) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        t0, first, ids = time.perf_counter(), None, []
        try:
            for msg in stub.Generate(build_request(args), timeout=args.timeout):
                if first is None and msg.token_ids:
                    first = time.perf_counter()
                ids.extend(msg.token_ids)
                print(msg.text if msg.text else "".join(f" {t}" for t in msg.token_ids), end="", flush=True)
                if msg.finish_reason:
                    print(f"\n[finish={msg.finish_reason} prompt_tokens={msg.usage.prompt_tokens} "
                          f"cached_prompt_tokens={msg.usage.cached_prompt_tokens} "
                          f"completion_tokens={msg.usage.completion_tokens} "
                          f"ttft={1e3 * ((first or t0) - t0):.1f}ms]")
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            sys.exit(1)
    if args.show_ids:
        print("token ids:", ids)


def cmd_chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> None:
    """Interactive chat: each turn sends the whole conversation (DeepSeek-V3.2 chat encoding on the
    router); in thinking mode the reasoning is shown dimmed and dropped from the history."""
    system = [generation_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    history = list(system)
    args.keep_special_tokens = args.keep_special_tokens or args.thinking  # </think> separates the answer
    print("pdserve chat: /reset clears the conversation, /exit (or Ctrl-D) quits", flush=True)
    with client_channel(args) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        while True:
            try:
                line = read("you> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                history = list(system)
                continue
            if not line.strip():
                continue
            history.append(generation_pb2.ChatMessage(role="user", content=line))
            req = generation_pb2.GenerateRequest(messages=history, thinking=args.thinking,
                                                 sampling_params=sampling_args(args))
            text = ""
            print("assistant> ", end="", flush=True)
            try:
                for msg in stub.Generate(req, timeout=args.timeout):
                    print(msg.text, end="", flush=True)
                    text += msg.text
            except grpc.RpcError as exc:
                print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
                history.pop()
                continue
            print(flush=True)
            reasoning, answer = split_reasoning(text) if args.thinking else ("", text)
            history.append(generation_pb2.ChatMessage(role="assistant", content=answer.replace(EOS, "")))


def cmd_profile(args: argparse.Namespace) -> None:

    if args.router:
        args.address = args.router
        perf = profile_served(args.router, open_channel=lambda _: client_channel(args))
    else:
        perf = profile_engine(args.model or default_model(), args.dtype)
    perf.save(args.out)
    print(f"wrote {args.out}")


def cmd_plan(args: argparse.Namespace) -> None:

    perf = PerfModel.load(args.profile) if args.profile else PerfModel()
    w = Workload(args.rate, Dist.parse(args.isl), Dist.parse(args.osl), args.ttft_p90 / 1e3, args.tpot_p90 / 1e3,
                 args.attainment)
    if run_plan(perf, w, args.max_m, args.max_n, args.dp, args.requests, args.seed, args.plot) is None:
        sys.exit(1)


def cmd_convert(args: argparse.Namespace) -> None:
    from shared.loader.convert import convert_checkpoint  # torch, loaded by this command only

    try:
        print(convert_checkpoint(args.src, args.dst, args.format, args.ep, args.max_shard_gb, progress=True))
    except (ValueError, KeyError, OSError) as exc:  # a bad checkpoint or flag: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def _add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--tls-ca", default=None, help="the router serves TLS: verify it with this CA certificate")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--keep-special-tokens", action="store_true", help="keep special tokens (e.g. <think>) in the text")
    p.add_argument("--thinking", action="store_true", help="chat: thinking mode (the reply starts with reasoning)")
    p.add_argument("--timeout", type=float, default=600.0)


def parser() -> argparse.ArgumentParser:
    """The `pdserve` command line (tests parse `pdserve up ...` with it, as a user types it)."""
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run router + prefill + decode on loopback")
    up.add_argument("--model", default=None, help=f"checkpoint dir (default: the demo model {DEFAULT_MODEL})")
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    up.add_argument("--port", type=int, default=50051, help="router port")
    up.add_argument("--log-dir", default=None, help="write each service's log here")
    add_flags(up, ServiceConfig, only=UP_ENGINE_FLAGS)  # the services' own defaults, choices and help
    up.add_argument("--prefill-cp", type=int, default=1, help="context-parallel ranks per prefill instance")
    up.add_argument("--prefill-tp", type=int, default=1, help="local-TP ranks per prefill instance (with cp 1)")
    up.add_argument("--prefill-ep", type=int, default=1, help="expert-parallel ranks per prefill instance")
    up.add_argument("--decode-dp", type=int, default=1, help="attention-DP ranks per decode instance")
    up.add_argument("--decode-tp", type=int, default=1, help="local-TP ranks per decode instance (with dp 1)")
    up.add_argument("--decode-ep", type=int, default=1, help="expert-parallel ranks per decode instance")
    up.add_argument("--layer-sharding", default="", help="o_proj,q_b_proj: store layer i's weight on rank i %% K")
    add_flags(up, DecodeConfig, only=("speculative_max_draft_tokens",))  # decode's own flag, with --speculative
    add_flags(up, RouterConfig, only=("local_prefill_tokens", "http_port", "api_key_file", "ttft_slo_ms",
                                      "tpot_slo_ms", "profile", "served_model_name", "chat_max_tokens",
                                      "drain_seconds"))
    add_flags(up, PrefillConfig, only=("no_prefix_cache",))
    add_flags(up, AutoscaleConfig)  # passed to the router, which decides
    add_flags(up, SupervisorConfig)  # pdserve up's own: how it restarts a service that exits
    up.add_argument("--config", default=None,
                    help="deployment description (YAML, the Helm chart's values keys); replaces the shape flags")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS on every hop (gRPC and KV) with a CA and certificate made for this start")
    up.set_defaults(fn=cmd_up)
    certs = sub.add_parser("certs", help="make a cluster CA and a node certificate for --tls-*")
    certs.add_argument("--out", required=True, help="directory for ca.pem, ca.key, node.pem, node.key")
    certs.add_argument("--host", action="append", help="a host name or IP the services are reached at (repeat)")
    certs.add_argument("--days", type=int, default=30)
    certs.set_defaults(fn=cmd_certs)
    gen = sub.add_parser("generate", help="stream one request from the router")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--prompt-token-ids", type=int, nargs="+", default=None)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat encoding)")
    _add_sampling_flags(gen, 32)
    gen.add_argument("--show-ids", action="store_true")
    gen.add_argument("--priority", type=int, default=0,
                     help="lower is more urgent: < 0 may use its whole SLA targets, > 0 is refused first under load; "
                          "the prefill queue serves lower first")
    gen.add_argument("--ttft-ms", type=float, default=0.0, help="this request's TTFT target (0: the router's)")
    gen.add_argument("--tpot-ms", type=float, default=0.0, help="this request's TPOT target (0: the router's)")
    gen.set_defaults(fn=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the router (DeepSeek-V3.2 chat encoding)")
    chat.add_argument("--system", default="", help="system prompt")
    _add_sampling_flags(chat, 256)
    chat.set_defaults(fn=cmd_chat)
    prof = sub.add_parser("profile", help="measure the engine's prefill and decode curves → profile.json")
    prof.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    add_flags(prof, ServiceConfig, only=("dtype",))
    prof.add_argument("--out", default="profile.json")
    prof.set_defaults(fn=cmd_profile)
    plan = sub.add_parser("plan", help="how many prefill (M) and decode (N) instances a workload needs")
    plan.add_argument("--profile", default=None, help="profile.json from `pdserve profile` (default: built-in)")
    plan.add_argument("--rate", type=float, required=True, help="requests per second")
    plan.add_argument("--isl", default="128", help="prompt tokens: N, LO:HI (uniform) or exp:MEAN")
    plan.add_argument("--osl", default="128", help="output tokens: N, LO:HI (uniform) or exp:MEAN")
    plan.add_argument("--ttft-p90", type=float, required=True, help="TTFT target (ms) for the attainment share")
    plan.add_argument("--tpot-p90", type=float, required=True, help="TPOT target (ms)")
    plan.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both")
    plan.add_argument("--max-m", type=int, default=8)
    plan.add_argument("--max-n", type=int, default=16)
    plan.add_argument("--dp", type=int, default=1, help="attention-DP ranks per decode instance")
    plan.add_argument("--requests", type=int, default=2000, help="simulated requests per stage-B run")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--plot", default=None, help="PNG of SLA attainment vs request rate")
    plan.set_defaults(fn=cmd_plan)
    conv = sub.add_parser("convert", help="convert a checkpoint offline (W8A8 INT8), tensor by tensor")
    conv.add_argument("--src", required=True, help="Hugging Face checkpoint dir (FP8 release or bf16/fp32)")
    conv.add_argument("--dst", required=True, help="output dir (must not hold a checkpoint yet)")
    conv.add_argument("--format", default="w8a8", choices=["w8a8"], help="target format")
    conv.add_argument("--ep", type=int, default=1, help="write routed experts to N per-rank files (1: no slicing)")
    conv.add_argument("--max-shard-gb", type=float, default=5.0, help="size limit of the shared shards")
    conv.set_defaults(fn=cmd_convert)
    return p


def up_cluster(argv: list[str], log_dir: Path | None = None) -> Cluster:
    """The Cluster `pdserve up ARGV` starts (not started yet)."""
    return cluster_from_args(parser().parse_args(["up", *argv]), log_dir)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
