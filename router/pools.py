"""The router's pools: the prefill and the decode instances it knows (static addresses, `dns:` names and
`file:` lists, kept current), each with its view (router.policy) refreshed from its load reports, and its
health. What the policy chooses among and what a request's tries are sent to."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.kv_index import KV_GRACE_S, KvIndex
from router.policy import DecodeView, PrefillView, RankView
from shared import metrics
from shared.protocol.load import LoadReport
from shared.rpc.convert import load_from_proto
from shared.rpc.pdserve.v1 import internal_pb2
from shared.rpc.service import Credentials, aio_channel

log = logging.getLogger("pdserve.router")
# A down instance is polled again after interval × 2^failures, at most this long: an instance that comes
# back (a restart, a rolling upgrade) takes requests within about this many seconds.
MAX_POLL_BACKOFF = 2.0
KV_RETRY_S = 30.0  # an instance without KvEvents (an older build) is asked again after this long
EMPTY_FILES_POLL_S = 0.05  # how soon a pool of file: lists that name nothing yet reads them again (Pool.discover)
Resolver = Callable[[str, str], Awaitable[list[str]]]


@dataclass
class Instance:
    address: str
    stub: object
    view: PrefillView | DecodeView
    channel: grpc.aio.Channel | None = field(default=None, repr=False)
    outstanding: int = 0  # changed only on the event loop: no lock
    failures: int = 0  # consecutive failed load polls (back-off)
    due: float = 0.0  # next load poll (monotonic seconds)


@contextlib.contextmanager
def in_flight(inst: Instance) -> Iterator[Instance]:
    """`inst` counts one more call outstanding while the block runs."""
    inst.outstanding += 1
    try:
        yield inst
    finally:
        inst.outstanding -= 1


class Pool:
    """Instances of one kind, with the router's view of each (its load reports, plus what was
    dispatched since the last one); an instance whose calls or load polls fail is taken out of the
    choice and polled back in with back-off. An address `dns:NAME:PORT` (a Kubernetes headless
    service) stands for every address NAME resolves to, re-resolved every `discover` period: pods
    that appear are added, pods that vanish are dropped. `file:PATH` stands for the addresses listed in
    PATH, one a line, re-read alike (what `pdserve up --autoscale` writes as it starts and drains instances).

    `kv_index` (router.kv_index) is what the instances' prefix caches hold, from one KvEvents subscription
    per instance (started with the load polls, resumed after a break, dropped with the instance)."""

    def __init__(self, kind: str, addresses: list[str], stub_cls, credentials: Credentials | None = None):
        self.kind, self.stub_cls, self.credentials = kind, stub_cls, credentials
        metrics.FAILOVERS.labels(kind)  # exported at 0 from the start
        self.static = [a for a in addresses if not a.startswith(("dns:", "file:"))]
        self.names = [a[4:] for a in addresses if a.startswith("dns:")]
        self.files = [a[5:] for a in addresses if a.startswith("file:")]
        self.instances: list[Instance] = [self._make(a) for a in self.static]
        self._retired: list[tuple[float, grpc.aio.Channel]] = []
        self.kv_index = KvIndex(kind)
        self._kv_tasks: dict[str, asyncio.Task] = {}
        self._added = asyncio.Event()  # discovery added instances: poll them now, not at the next interval

    def _make(self, address: str) -> Instance:
        channel = aio_channel(address, self.credentials)
        view = PrefillView if self.kind == "prefill" else DecodeView
        inst = Instance(address, self.stub_cls(channel), view(address), channel)
        inst.view.up = False  # until its first load report: a router never counts on an instance it has not reached
        return inst

    async def discover(self, period: float = 5.0, resolve: Resolver | None = None) -> None:
        """Keep the instances of the dns: names and file: lists current (static addresses always stay). A pool of
        file: lists that exist but name nothing yet is read again within EMPTY_FILES_POLL_S: a launcher that starts
        the router beside its instances writes them once they listen (a missing file waits `period`, warned of)."""
        resolve = resolve or resolve_addresses
        while True:
            await self.refresh(resolve)
            waiting = self.files and not self.instances and all(Path(f).is_file() for f in self.files)
            await asyncio.sleep(EMPTY_FILES_POLL_S if waiting else period)

    async def refresh(self, resolve: Resolver) -> None:
        wanted = list(self.static)
        for name in self.names:
            host, _, port = name.rpartition(":")
            try:
                wanted += [a for a in await resolve(host, port) if a not in wanted]
            except OSError as exc:  # keep what we have: a DNS hiccup must not empty the pool
                log.warning("%s: cannot resolve %s: %s", self.kind, host, exc)
                wanted += [x.address for x in self.instances if x.address not in wanted]
        for path in self.files:
            try:
                wanted += [a for a in Path(path).read_text().split() if a not in wanted]
            except OSError as exc:
                log.warning("%s: cannot read %s: %s", self.kind, path, exc)
                wanted += [x.address for x in self.instances if x.address not in wanted]
        current = {x.address: x for x in self.instances}
        added = [a for a in wanted if a not in current]
        gone = [x for x in self.instances if x.address not in wanted]
        if added or gone:
            log.info("%s instances: +%s -%s", self.kind, added, [x.address for x in gone])
            self.instances = [current.get(a) or self._make(a) for a in wanted]
            if added:
                self._added.set()
            now = time.monotonic()
            self._retired += [(now, x.channel) for x in gone if x.channel is not None]
        while self._retired and time.monotonic() - self._retired[0][0] > 600:  # in-flight streams drain first
            await self._retired.pop(0)[1].close()

    async def watch_health(self, period: float = 2.0) -> None:
        """pdserve_router_instance_up for every instance, from its health check every `period` s."""
        while True:
            for inst in list(self.instances):
                try:
                    stub = health_pb2_grpc.HealthStub(inst.channel)
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=period)
                    up = reply.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    up = False
                metrics.INSTANCE_UP.labels(self.kind, inst.address).set(int(up))
            await asyncio.sleep(period)

    async def poll_loads(self, interval: float, metadata: tuple) -> None:
        """Refresh every instance's view from its GetLoad report every `interval` s; a failing one is
        out (its view down) and retried after interval · 2^failures (at most 8 s)."""
        while True:
            self.follow_kv_events(metadata)
            now = time.monotonic()
            await asyncio.gather(*(self._poll(inst, interval, metadata) for inst in list(self.instances)
                                   if now >= inst.due))
            try:  # the next round after `interval`, or at once when discovery adds instances
                await asyncio.wait_for(self._added.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._added.clear()

    async def _poll(self, inst: Instance, interval: float, metadata: tuple) -> None:
        try:
            answer = await inst.stub.GetLoad(internal_pb2.LoadRequest(), timeout=max(1.0, 4 * interval),
                                             metadata=metadata)
        except grpc.RpcError:
            inst.failures += 1
            inst.view.up = False
            inst.due = time.monotonic() + min(MAX_POLL_BACKOFF, interval * 2 ** inst.failures)
            metrics.INSTANCE_PLACEABLE.labels(self.kind, inst.address).set(0)
            return
        inst.failures, inst.view.up = 0, True
        metrics.INSTANCE_PLACEABLE.labels(self.kind, inst.address).set(1)
        _apply(inst.view, load_from_proto(answer))

    def follow_kv_events(self, metadata: tuple) -> None:
        """One KvEvents subscription per instance of the pool; an instance gone loses its task and entries."""
        current = {inst.address: inst for inst in self.instances}
        for address in [a for a in self._kv_tasks if a not in current]:
            self._kv_tasks.pop(address).cancel()
            self.kv_index.drop(address)
        for address in [a for a in self.kv_index.addresses() if a not in current]:
            self.kv_index.drop(address)
        for address, inst in current.items():
            if address not in self._kv_tasks or self._kv_tasks[address].done():
                self._kv_tasks[address] = asyncio.create_task(self._follow(inst, metadata))

    async def _follow(self, inst: Instance, metadata: tuple) -> None:
        """Read an instance's KvEvents into the index, resuming after a break from the last (epoch, sequence
        number); after KV_GRACE_S without a stream its entries go (and the next subscription starts afresh)."""
        epoch = last = failures = 0
        down_since: float | None = None
        while True:
            try:
                request = internal_pb2.KvEventsRequest(epoch=epoch, last_seq=last)
                async for batch in inst.stub.KvEvents(request, metadata=metadata):
                    if batch.epoch != epoch and not batch.snapshot:
                        raise ValueError(f"epoch: {batch.epoch} without a snapshot")
                    self.kv_index.apply(inst.address, batch)
                    inst.view.kv_seq = batch.last_seq
                    epoch, last, failures, down_since = batch.epoch, batch.last_seq, 0, None
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.kv_index.drop(inst.address)
                    await asyncio.sleep(KV_RETRY_S)
                    continue
            except ValueError as exc:  # a broken stream: forget the instance, subscribe afresh
                log.warning("%s: KvEvents %s; resubscribing", inst.address, exc)
                self.kv_index.drop(inst.address)
                epoch = last = 0
            now = time.monotonic()
            down_since = down_since if down_since is not None else now
            if now - down_since > KV_GRACE_S and epoch:
                self.kv_index.drop(inst.address)
                epoch = last = 0
            failures += 1
            await asyncio.sleep(min(MAX_POLL_BACKOFF, 0.05 * 2 ** min(failures, 8)))

    @staticmethod
    def ordered(instances: list[Instance], indices: list[int]) -> list[Instance]:
        """`instances` (a snapshot the policy saw) at `indices` in the policy's order, repeats dropped,
        then the rest as the fail-over order."""
        seen = list(dict.fromkeys(indices))
        return [instances[i] for i in seen] + [x for i, x in enumerate(instances) if i not in seen]


def _apply(view: PrefillView | DecodeView, report: LoadReport) -> None:
    """An instance's view as its load report says (what was dispatched since is counted again from here)."""
    view.block_size = report.block_size or view.block_size
    if isinstance(view, PrefillView):
        view.queued_tokens = report.queued_prompt_tokens
        view.reports += 1
    else:
        view.ranks = [RankView(r.running + r.active_leases, r.tokens, r.queued_prompt_tokens) for r in report.ranks]
        view.free_blocks = min(r.free_blocks for r in report.ranks)


async def resolve_addresses(host: str, port: str) -> list[str]:
    """host:port addresses of every IP `host` resolves to (IPv6 bracketed), in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class EndpointList:
    """The routers to pick from: addresses, and dns:NAME:PORT names resolved every `discover` interval."""

    def __init__(self, addresses: list[str]):
        self.static = [a for a in addresses if not a.startswith("dns:")]
        self.names = [a[4:] for a in addresses if a.startswith("dns:")]
        self.resolved: list[str] = []

    def __call__(self) -> list[str]:
        return [*self.static, *self.resolved]

    async def discover(self, interval: float) -> None:
        while self.names:
            found = []
            for name in self.names:
                host, _, port = name.rpartition(":")
                try:
                    found += await resolve_addresses(host, port)
                except OSError as exc:
                    log.warning("endpoint picker: %s does not resolve (%s)", name, exc)
            self.resolved = found
            await asyncio.sleep(interval)


__all__ = ["EndpointList", "Instance", "Pool", "in_flight", "resolve_addresses"]
