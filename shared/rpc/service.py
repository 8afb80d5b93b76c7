"""gRPC plumbing shared by the services: asyncio servers with health + reflection, internal-call
authentication (cluster token or mutual TLS), dead-peer detection, lifecycle
(proto conversions: shared.rpc.convert).

Servers are `grpc.aio`: a streaming RPC is a coroutine, not a thread, so the number of concurrent
streams does not depend on a thread pool, and health checks are answered on the event loop while
thousands of streams are open. Engines run on their own threads and hand results to the loop.

Internal services (Prefill, Decode) accept only cluster members: callers presenting the cluster's
shared secret (`authorization: Bearer <token>`; from `--auth-token-file` or PDSERVE_CLUSTER_TOKEN),
or, with `--tls-cert/--tls-key/--tls-ca`, peers whose certificate the cluster CA signed (mutual
TLS on every hop; the router's public port then serves TLS without asking clients for a
certificate). Secure by default: a service with neither refuses every internal call unless started
with an explicit `--insecure`. Health checks and reflection stay open (probes). KV destinations
handed out by Reserve are signed with the token, and a prefill instance pushes only to a
destination whose signature holds, so a direct Prefill call cannot make it send KV anywhere.

Peers that stop answering (killed, SIGSTOPped, partitioned) are found by HTTP/2 keepalive pings
every KEEPALIVE_MS with a KEEPALIVE_TIMEOUT_MS deadline: their calls end with UNAVAILABLE in a few
seconds instead of hanging until a deadline. The deadline is 3 s, not 1: a process on a saturated
node (2 cores serving 512 streams in the soak test, a CPU-throttled pod) can miss a 1 s ping answer
while perfectly alive, and its streams would be cut.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import hashlib
import hmac
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.config import EndpointConfig
from shared.rpc.certs import TLS_SERVER_NAME
from shared.rpc.pdserve.v1 import internal_pb2

log = logging.getLogger("pdserve")

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
INTERNAL_SERVICES = ("pdserve.v1.Prefill", "pdserve.v1.Decode")
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 1000, 3000
_MESSAGE_LIMITS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
_KEEPALIVE = [("grpc.keepalive_time_ms", KEEPALIVE_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
              ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
              ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_MS),
              ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS)]
CHANNEL_OPTIONS = [*_MESSAGE_LIMITS, *_KEEPALIVE,
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000)]  # a restarted peer is found again within ~2 s
SERVER_OPTIONS = [*_MESSAGE_LIMITS, *_KEEPALIVE, ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
                  ("grpc.http2.max_ping_strikes", 0),
                  ("grpc.so_reuseport", 0)]  # a second process on a taken port fails instead of sharing it


@dataclass(frozen=True)
class Credentials:
    """What this process presents (client) and demands (internal services): the cluster token
    and/or certificate files for mutual TLS."""

    token: str | None = None
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    @classmethod
    def from_args(cls, token_file: str | None, insecure: bool, tls_cert: str | None = None,
                  tls_key: str | None = None, tls_ca: str | None = None) -> Credentials:
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV) or None
        tls = (tls_cert, tls_key, tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
        for path in filter(None, tls):
            if not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")
        creds = cls(token, insecure, *tls)
        if not creds.authenticated and not insecure:
            log.warning("no cluster token (--auth-token-file or %s) and no --tls-*: internal calls will be "
                        "refused; pass --insecure to accept them without credentials", TOKEN_ENV)
        return creds

    @classmethod
    def of(cls, endpoint: EndpointConfig) -> Credentials:
        """The credentials a service's endpoint flags name."""
        return cls.from_args(endpoint.auth_token_file, endpoint.insecure, endpoint.tls_cert, endpoint.tls_key,
                             endpoint.tls_ca)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    @property
    def authenticated(self) -> bool:
        return bool(self.token) or self.tls

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def allows(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """May a caller with this metadata use internal services? Under mutual TLS the handshake
        already proved cluster membership (the server demands a certificate signed by the CA)."""
        if self.insecure or self.tls:
            return True
        if not self.token:
            return False
        got = dict(metadata or ()).get("authorization", "")
        return hmac.compare_digest(str(got).encode(), f"Bearer {self.token}".encode())

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return tuple(Path(p).read_bytes() for p in (self.tls_key, self.tls_cert, self.tls_ca))  # type: ignore[return-value]

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        key, cert, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def ssl_context(self, server: bool):  # ssl.SSLContext | None
        """The KV channel's TLS: both sides present a certificate and accept only the cluster CA's."""
        if not self.tls:
            return None
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        ctx.load_verify_locations(self.tls_ca)
        if not server:  # verified by the cluster CA and TLS_SERVER_NAME (see connect), not the pod address
            ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    # -- vouching for KV destinations --------------------------------------------------------------
    def sign(self, dest: internal_pb2.KVDestination) -> bytes:
        """HMAC of a destination with the cluster token (empty without one)."""
        if not self.token:
            return b""
        fields = (dest.transport, dest.endpoint, dest.lease_id, dest.token.hex(), dest.control_endpoint,
                  ",".join(map(str, dest.block_ids)), ",".join(map(str, dest.mla_base)),
                  ",".join(map(str, dest.index_base)), dest.layout_json, str(dest.reused_blocks))
        return hmac.new(self.token.encode(), "\x1f".join(fields).encode(), hashlib.sha256).digest()

    def vouched(self, dest: internal_pb2.KVDestination) -> str | None:
        """None when a prefill may push to `dest`, else why not: a destination must carry the
        cluster's signature (decode signed it at Reserve), unless this process runs --insecure
        without a token, or under TLS the KV peer's certificate is what vouches (tcp only)."""
        if self.token:
            return None if hmac.compare_digest(self.sign(dest), dest.signature) else \
                "destination: not signed by a decode instance of this cluster"
        if self.insecure or (self.tls and dest.transport == "tcp"):
            return None
        return "destination: cannot be verified without the cluster token"


class _Authenticate(grpc.aio.ServerInterceptor):
    """Internal methods without cluster credentials end with UNAUTHENTICATED before any work."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        service = details.method.split("/")[1] if details.method.count("/") >= 2 else ""
        if handler is None or service not in INTERNAL_SERVICES or self.credentials.allows(details.invocation_metadata):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{details.method} needs the cluster's credentials")

        kind = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)
        return kind(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


# The health service name a liveness probe asks: SERVING while the process can serve, whatever its readiness
# (a router that reaches no instance yet, or drains, is not ready; restarting it would fix nothing).
LIVENESS_SERVICE = "pdserve.liveness"


class Lifecycle:
    """Health (readiness: the server's and its services' names; liveness: LIVENESS_SERVICE), fatal failure
    and signal-driven drain of one asyncio gRPC server."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 service_names: list[str]):
        self.server, self.health, self.names = server, health_servicer, ["", *service_names]
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        self.servicer: object | None = None  # the service's own servicer, for its main
        self.extra_ports: list[int] = []  # start_server's extra_ports, bound
        self.named_ports: dict[str, int] = {}  # what the service calls them

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.health.set(name, status)

    def fail(self, reason: str, grace: float = 1.0) -> None:
        """Thread-safe: the engine loop cannot go on. Report NOT_SERVING at once (liveness too), give
        streams `grace` seconds to end with UNAVAILABLE, then exit non-zero so the orchestrator restarts
        the process."""
        log.error("engine loop failed, exiting in %.1fs: %s", grace, reason)
        asyncio.run_coroutine_threadsafe(self.set(False), self.loop)
        asyncio.run_coroutine_threadsafe(self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse
                                                         .NOT_SERVING), self.loop)
        timer = threading.Timer(grace, lambda: os._exit(70))
        timer.daemon = True
        timer.start()

    def announce(self, port: int, port_file: str | None, banner: str) -> None:
        """Serving: report the bound port (to the launcher's port file) and say so on stdout."""
        write_port_file(port_file, port)
        print(banner, flush=True)

    async def run(self, drain_seconds: float, cleanup: Callable[[], None] = lambda: None,
                  on_stop: Callable[[], Awaitable[None]] | None = None,
                  alongside: Callable[[float], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM/SIGINT, then stop accepting (NOT_SERVING, new RPCs refused; `on_stop` hands
        running work elsewhere), let in-flight RPCs finish for up to `drain_seconds` (then they are
        cancelled) while `alongside(deadline)` drains what else the process serves (the router's HTTP API)
        by the same monotonic deadline, clean up and exit. A watchdog exits regardless if cleanup hangs, so
        a stop signal always ends the process."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(sig, self.stopping.set)
        await self.stopping.wait()
        watchdog = threading.Timer(drain_seconds + 10, lambda: os._exit(0))
        watchdog.daemon = True
        watchdog.start()
        deadline = time.monotonic() + drain_seconds
        await self.set(False)
        if on_stop is not None:
            await on_stop()
        stopped = self.server.stop(max(0.0, deadline - time.monotonic()))
        await (asyncio.gather(stopped, alongside(deadline)) if alongside is not None else stopped)
        await self.loop.run_in_executor(None, cleanup)
        sys.stdout.flush()
        os._exit(0)


async def start_server(host: str, port: int, register: Iterable[Callable[[grpc.aio.Server], None]],
                       service_names: list[str], credentials: Credentials | None = None,
                       public: bool = False, extra_ports: Sequence[int] = ()
                       ) -> tuple[grpc.aio.Server, int, Lifecycle]:
    """Start an asyncio server with health checking and reflection (only of its own services) and
    mark it SERVING; returns it with its bound port (`extra_ports`: more ports serving the same, bound ones in
    `life.extra_ports`). Under TLS an internal server demands a client certificate from the cluster CA; a
    `public` one (the router) serves TLS to any client."""
    credentials = credentials or Credentials()
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[_Authenticate(credentials)])
    for add in register:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    tls = credentials.server_credentials(require_client_cert=not public)
    bound_ports = []
    for p in (port, *extra_ports):
        address = f"{host}:{p}"
        bound = server.add_secure_port(address, tls) if tls else server.add_insecure_port(address)
        if bound == 0:
            raise RuntimeError(f"cannot bind {address}")
        bound_ports.append(bound)
    await server.start()
    life = Lifecycle(server, health_servicer, service_names)
    life.extra_ports = bound_ports[1:]
    await life.set(True)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    freeze_startup_heap()  # a service's process: its engine (when in process) and server are up by now
    return server, bound_ports[0], life


class LoopQueue:
    """An asyncio queue that engine threads feed (`put` is thread-safe) and a coroutine drains."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody reads any more
            pass

    async def get(self) -> object:
        return await self._queue.get()

    @staticmethod
    def put_all(pairs: list[tuple[Any, object]]) -> None:
        """Thread-safe: deliver many (sink, item) pairs with one wake-up per event loop (one per
        engine step, not one per token), other sinks item by item."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[LoopQueue, object]]] = {}
        for sink, item in pairs:
            if isinstance(sink, LoopQueue):
                by_loop.setdefault(sink.loop, []).append((sink, item))
            else:
                sink.put(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass


def _deliver(batch: list[tuple[LoopQueue, object]]) -> None:
    for sink, item in batch:
        sink._queue.put_nowait(item)


async def wait_future(fut, timeout: float | None = None):  # concurrent Future, its result
    """Await a concurrent.futures.Future from an engine thread without blocking the event loop.
    Unlike asyncio.wrap_future, a cancelled caller (client gone, deadline) does not cancel `fut`:
    the engine thread that settles it must never find it cancelled under its feet."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def copy(done) -> None:
        if waiter.done():  # the caller stopped waiting
            return
        if done.cancelled():
            waiter.cancel()
        elif done.exception() is not None:
            waiter.set_exception(done.exception())
        else:
            waiter.set_result(done.result())

    def hand_over(done) -> None:  # on the thread that settled `fut`
        try:
            loop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the event loop is gone (shutdown): nobody waits any more
            pass

    fut.add_done_callback(hand_over)
    return await asyncio.wait_for(waiter, timeout)


def serve_follower_health(host: str, port: int, credentials: Credentials | None = None,
                          port_file: str | None = None):
    """A follower rank (one pod of a multi-node instance) serves only grpc.health.v1 on its --port
    (0: a free one, reported in --port-file), SERVING while its rank loop runs, so orchestrator
    probes work on every rank's pod. Returns a function that marks it NOT_SERVING (the loop ended)."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    tls = (credentials or Credentials()).server_credentials(require_client_cert=True)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls) if tls else server.add_insecure_port(address)
    if not bound:
        raise RuntimeError(f"cannot bind {address}")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    write_port_file(port_file, bound)

    def down() -> None:  # holds `server`: a collected grpc.Server stops serving
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        server.stop(grace=1)

    return down


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child process: get `sig` when the parent dies, even by SIGKILL (Linux), so a killed
    service or `pdserve up` leaves no orphans holding ports."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def leave_stop_signals_to_front() -> None:
    """In a process a service's front started to work for it (its engine core, its local follower ranks): a stop
    signal sent to the whole process group (Ctrl-C, `kill -TERM -PGID`, a supervisor stopping the group) is the
    front's to act on. The front drains (its running requests handed back to the router as draining) and then stops
    its helpers itself; a core that died of the signal first failed those requests as a dead engine's, so they
    moved as `unavailable`, not as a drain (a loaded run counted no drain though every stream came whole). So the
    helper ignores SIGTERM and SIGINT, and is killed outright when the front dies (parent-death SIGKILL)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


def freeze_startup_heap() -> None:
    """Once a serving process has started (its engine built and warmed, its server up): move every object
    alive now into the collector's permanent generation (gc.freeze), as vLLM's engine core and SGLang's
    scheduler do. A full collection otherwise walks them all: ~180k objects once an engine is up, 117 ms of
    stall (measured) every time enough requests' objects pile up, in the middle of a step or a token stream;
    with them frozen it took 5 ms. Only for processes that live as long as the objects they freeze (frozen
    objects are never collected): never in a library caller's process."""
    gc.freeze()


LAUNCHER_ENV = "PDSERVE_LAUNCHER_PID"  # set by a launcher (pdserve up) whose services must not outlive it


def die_with_launcher() -> None:
    """At a service's start: when a launcher asked for it (LAUNCHER_ENV), die with the launcher's thread
    that started this process (die_with_parent), and exit now if it is gone already. Done here, after
    exec, rather than in a fork-time hook: running Python between fork and exec in a process with gRPC
    threads can crash the child."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher:
        die_with_parent()
        if os.getppid() != int(launcher):
            sys.exit(0)


def write_port_file(path: str | None, port: int) -> None:
    """Report the port a service bound (port 0 = the OS picked one), atomically: a launcher reads it."""
    if path:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(str(port))
        tmp.replace(path)


class _PresentToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.extra = metadata

    def _details(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.extra)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def channel(address: str, credentials: Credentials | None = None) -> grpc.Channel:
    """A blocking channel to a peer (clients, tools, tests): TLS with the cluster CA when configured,
    the cluster token on every call when there is one, keepalive to notice a dead peer."""
    creds = credentials or Credentials()
    tls = creds.channel_credentials()
    ch = (grpc.secure_channel(address, tls, options=[*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override",
                                                                        TLS_SERVER_NAME)]) if tls
          else grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
    if creds.token:
        ch = grpc.intercept_channel(ch, _PresentToken(creds.metadata))
    return ch


def aio_channel(address: str, credentials: Credentials | None = None) -> grpc.aio.Channel:
    """The asyncio twin of `channel` for services calling services (calls pass `credentials.metadata`)."""
    tls = (credentials or Credentials()).channel_credentials()
    return (grpc.aio.secure_channel(address, tls, options=[*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override",
                                                                              TLS_SERVER_NAME)]) if tls
            else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))


__all__ = ["Credentials", "Lifecycle", "LoopQueue", "aio_channel", "channel", "die_with_parent", "internal_pb2",
           "leave_stop_signals_to_front", "start_server"]
