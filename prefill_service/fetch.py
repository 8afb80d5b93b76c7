"""Cross-instance fetch: a prefill instance that lacks a prompt's prefix another prefill instance caches pulls
those blocks over the transfer engine instead of computing them again.

Both ends run on the engine thread, by command, over the machinery a KV push already has:
* the fetching instance opens a lease on its own pool for the blocks it lacks (`OpenFetch`: a Destination
  as decode's, received by the same TcpReceiver and LeaseTable), its front asks the holder to push them
  (PushCached), then it adopts what arrived (`AdoptFetch`): the leading blocks written in every layer and
  cache kind enter its prefix cache under their keys, the rest go back; the prompt then starts on them
  like on any cache hit (the scheduler claims them), so nothing else in the engine knows about fetches.
* the holder pins its cached blocks of the keys (`PushCachedBlocks`) and pushes the ones from `first` on
  into the lease; when the push ends the blocks go back (by command, on the engine thread) and the caller
  is answered with how many blocks travelled.
The blocks travel like a prefill → decode push: over TCP, or by Mooncake one-sided writes into the fetch
lease's registered blocks when the instance's --kv-transport is mooncake (RDMA on clusters).
Keys are always hashed by the instance that uses them (from token ids and the tenant's salt), never taken
from a caller. Only one-rank instances fetch or serve fetches (a CP group's pool is split over its ranks,
a TP group's mirrored).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import grpc

from shared import metrics
from shared.config import PrefillConfig
from shared.engine import LLMEngine
from shared.engine.core import EngineCommand
from shared.kvcache import Holder, OutOfBlocks
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.protocol.limits import RequestLimits, check_cache_salt
from shared.protocol.prefix import prompt_block_hashes
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc
from shared.rpc.service import Credentials, aio_channel, wait_future
from shared.transfer import Destination, KVPush, TcpReceiver, TransferError
from shared.transfer.base import KVReceiver, cache_kinds
from shared.transfer.mooncake import MooncakeReceiver

log = logging.getLogger("pdserve.prefill")
FETCH_LEASE_SECONDS = 10.0  # a fetch lease nobody wrote to in this long goes back (the prompt is computed)
FETCH_TIMEOUT_S = 5.0  # a holder that has not pushed by then is given up on (the prompt is computed)


@dataclass(frozen=True)
class FetchEndpoint:
    """Where this instance receives fetched blocks (its flags: host, advertised host, TLS, timeouts)."""

    host: str
    advertise_host: str | None
    tls: object | None  # ssl.SSLContext of the receiver (server side), or None
    stall_seconds: float
    lease_seconds: float
    transport: str  # the instance's --kv-transport: mooncake receives fetched blocks by one-sided writes
    mooncake_protocol: str  # and its Mooncake flags
    mooncake_devices: str


# -- commands and answers -----------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenFetch(EngineCommand):
    """Plan a fetch of the blocks of `keys` (a prompt's leading block keys) this pool lacks."""

    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class FetchPlan:
    """What this pool caches of the keys already (`have` leading blocks), and where the holder pushes the
    rest (None: nothing to fetch)."""

    have: int
    destination: Destination | None = None


@dataclass(frozen=True)
class AdoptFetch(EngineCommand):
    """The holder's push ended: take what arrived into the prefix cache (`keys`: the lease's blocks' keys)."""

    lease_id: str
    keys: tuple[bytes, ...]


@dataclass(frozen=True)
class PushCachedBlocks(EngineCommand):
    """The holder's side: push the cached blocks of `keys` from the `first` on into `dest`."""

    fetch_id: str
    keys: tuple[bytes, ...]
    first: int
    dest: Destination


@dataclass(frozen=True)
class CachedPushed:
    """What a PushCachedBlocks sent: blocks and bytes."""

    blocks: int
    nbytes: int


@dataclass(frozen=True)
class EndCachedPush(EngineCommand):
    """A push of cached blocks ended (on its thread): the engine thread gives its blocks back."""

    hold: Holder


FETCH_COMMANDS = (OpenFetch, AdoptFetch, PushCachedBlocks, EndCachedPush)


def fetch_endpoint(cfg: PrefillConfig) -> FetchEndpoint | None:
    """Where a one-rank prefill instance receives fetched blocks (None: --no-kv-fetch, or a group of ranks)."""
    if cfg.no_kv_fetch or cfg.world > 1:
        return None
    return FetchEndpoint(cfg.host, cfg.public_host, Credentials.of(cfg).ssl_context(server=True), cfg.kv_stall_seconds,
                         FETCH_LEASE_SECONDS, cfg.kv_transport, cfg.mooncake_protocol, cfg.mooncake_devices)


def new_fetch_id() -> str:
    return "fetch-" + uuid.uuid4().hex


class FetchEnds:
    """Both ends of cross-instance fetches on one rank's pool. `open_push` opens a KV push to a destination;
    `later` queues a command for the engine thread; `on_done` answers a PushCachedBlocks' caller."""

    def __init__(self, engine: LLMEngine, endpoint: FetchEndpoint | None, open_push: Callable[[Destination], KVPush],
                 later: Callable[[EngineCommand], None] | None, on_done: Callable[[str, object], None]):
        self.engine, self.open_push, self.later, self.on_done = engine, open_push, later, on_done
        kv = engine.kv
        self.leases: LeaseTable | None = None
        self.receiver: KVReceiver | None = None
        self._control: TcpReceiver | None = None
        if endpoint is not None:
            self.leases = LeaseTable(kv.ledger, kv.layout.block_size, kv.layout.num_layers, cache_kinds(kv.layout),
                                     endpoint.lease_seconds)
            self.receiver = self._control = TcpReceiver(kv, self.leases, endpoint.host, 0,
                                                        advertise_host=endpoint.advertise_host, tls=endpoint.tls,
                                                        stall_seconds=endpoint.stall_seconds)
            if endpoint.transport == "mooncake":  # the holder writes the blocks one-sidedly, as prefill → decode
                self.receiver = MooncakeReceiver(kv, self._control, endpoint.advertise_host or endpoint.host,
                                                 endpoint.mooncake_protocol, endpoint.mooncake_devices)

    def apply(self, c: EngineCommand) -> object:
        if isinstance(c, OpenFetch):
            return self._open(c)
        if isinstance(c, AdoptFetch):
            return self._adopt(c)
        if isinstance(c, PushCachedBlocks):
            return self._push(c)
        if isinstance(c, EndCachedPush):
            self.engine.kv.ledger.end_push(c.hold)
            return None
        raise TypeError(f"not a fetch command: {type(c).__name__}")

    def _open(self, c: OpenFetch) -> FetchPlan:
        have = self.engine.kv.allocator.cached_prefix(list(c.keys))
        if have >= len(c.keys) or self.leases is None or self.receiver is None:
            return FetchPlan(have)
        try:
            lease = self.leases.reserve(new_fetch_id(), (len(c.keys) - have) * self.engine.kv.layout.block_size)
        except OutOfBlocks:  # no room to fetch into: the prompt is computed
            return FetchPlan(have)
        return FetchPlan(have, self.receiver.destination(lease))

    def _adopt(self, c: AdoptFetch) -> int:
        """Blocks adopted (0 when nothing usable arrived); the lease is gone either way."""
        assert self.leases is not None
        try:
            lease = self.leases.claim(c.lease_id, require_complete=False)
        except LeaseError:  # expired meanwhile, or a write still in flight (the holder gave up): computed instead
            self.leases.release(c.lease_id)
            return 0
        usable = min(self.leases.written_prefix(lease), len(c.keys))
        self.engine.kv.ledger.adopt(lease.blocks, c.keys[:usable])
        return usable

    def _push(self, c: PushCachedBlocks) -> None:
        """Pin and push; answered from the push's thread (or at once when there is nothing to send)."""
        if self.engine.parallel.is_parallel:  # a group's ranks must keep one cache: none serves alone
            self.on_done(c.fetch_id, TransferError("a group of ranks serves no fetch"))
            return None
        ledger = self.engine.kv.ledger
        held = ledger.hold_cached(list(c.keys), c.fetch_id)
        src = held.blocks[c.first:]
        if not src or len(src) > len(c.dest.block_ids):
            ledger.end_push(held.holder)
            self.on_done(c.fetch_id, CachedPushed(0, 0) if not src else
                         TransferError(f"destination holds {len(c.dest.block_ids)} blocks, {len(src)} to send"))
            return None
        try:
            push = self.open_push(c.dest)
            for layer in range(self.engine.kv.layout.num_layers):
                push.send_layer(layer, src, 0)
        except Exception as exc:  # a bad destination: nothing pinned stays
            ledger.end_push(held.holder)
            self.on_done(c.fetch_id, exc if isinstance(exc, TransferError) else TransferError(str(exc)))
            return None

        def ended(error: BaseException | None) -> None:
            push.close()
            if self.later is not None:
                self.later(EndCachedPush(held.holder))
            self.on_done(c.fetch_id, error if error is not None else CachedPushed(len(src), push.bytes_sent))

        push.finish_async(ended, commit=False)  # every write acknowledged, no commit: the fetcher adopts what came
        return None

    def expire(self) -> None:
        """Every step: fetch leases nobody filled in time go back."""
        if self.leases is not None:
            self.leases.expire()

    def close(self) -> None:
        for receiver in {id(r): r for r in (self.receiver, self._control) if r is not None}.values():
            receiver.close()


# -- the front's side (the gRPC process) ---------------------------------------------------------------
class FetchStepper(Protocol):
    """What the front holds of its engine core for fetches (PrefillEngineClient)."""

    limits: RequestLimits

    def fetch_step(self, command: EngineCommand) -> Future: ...


class PrefixFetcher:
    """A prefill front's fetches: pull the blocks a holder caches of a prompt this instance lacks (asked by the
    router), and serve other instances' PushCached from what this one caches."""

    def __init__(self, engine: FetchStepper, credentials: Credentials, enabled: bool):
        self.engine, self.credentials, self.enabled = engine, credentials, enabled
        self._stubs: dict[str, internal_pb2_grpc.PrefillStub] = {}

    def _stub(self, address: str) -> internal_pb2_grpc.PrefillStub:
        if address not in self._stubs:
            self._stubs[address] = internal_pb2_grpc.PrefillStub(aio_channel(address, self.credentials))
        return self._stubs[address]

    async def fetch(self, prompt: list[int], cache_salt: str, holder: str, blocks: int) -> int:
        """Prompt tokens fetched from `holder` into this instance's prefix cache (0: none needed, none came, or
        the fetch failed — the prompt is then computed as if never asked)."""
        bs = self.engine.limits.block_size
        blocks = min(blocks, (len(prompt) - 1) // bs)
        if not (self.enabled and holder and blocks > 0):
            return 0
        keys = tuple(prompt_block_hashes(prompt, bs, blocks, cache_salt))
        plan: FetchPlan = await wait_future(self.engine.fetch_step(OpenFetch(keys)))
        if plan.destination is None:
            metrics.KV_FETCHES.labels("not_needed" if plan.have >= blocks else "no_room").inc()
            return 0
        msg = plan.destination.to_proto(internal_pb2.KVDestination)
        msg.signature = self.credentials.sign(msg)
        ask = internal_pb2.PushCachedRequest(prompt_token_ids=prompt[: blocks * bs], cache_salt=cache_salt,
                                             first_block=plan.have, destination=msg)
        try:
            reply = await self._stub(holder).PushCached(ask, timeout=FETCH_TIMEOUT_S,
                                                        metadata=self.credentials.metadata)
            metrics.KV_FETCH_BYTES.inc(reply.bytes)
        except grpc.RpcError as exc:  # a holder gone or refusing: computed here instead
            log.warning("fetch of %d blocks from %s failed: %s", blocks - plan.have, holder, exc.code().name)
        finally:  # queued even when the caller went away meanwhile: the lease never waits for its expiry
            adopting = self.engine.fetch_step(AdoptFetch(plan.destination.lease_id, keys[plan.have:]))
        adopted = await wait_future(adopting)
        metrics.KV_FETCHES.labels("fetched" if adopted else "failed").inc()
        return adopted * bs

    async def push_cached(self, request: internal_pb2.PushCachedRequest) -> internal_pb2.PushCachedResponse:
        """The holder's side: push the cached blocks of the request's prefix into the asker's lease. Raises
        PermissionError (an unsigned destination) or ValueError naming a bad field."""
        problem = self.credentials.vouched(request.destination)
        if problem:
            raise PermissionError(problem)
        ids, bs = list(request.prompt_token_ids), self.engine.limits.block_size
        self.engine.limits.check_prompt_ids(ids)
        check_cache_salt(request.cache_salt)
        if len(ids) % bs:
            raise ValueError(f"prompt_token_ids: {len(ids)} tokens are not whole blocks of {bs}")
        if not 0 <= request.first_block < len(ids) // bs:
            raise ValueError(f"first_block: {request.first_block} of {len(ids) // bs} blocks")
        keys = tuple(prompt_block_hashes(ids, bs, len(ids) // bs, request.cache_salt))
        dest = Destination.from_proto(request.destination)
        done: CachedPushed = await wait_future(self.engine.fetch_step(
            PushCachedBlocks(new_fetch_id(), keys, request.first_block, dest)), FETCH_TIMEOUT_S)
        return internal_pb2.PushCachedResponse(blocks=done.blocks, bytes=done.nbytes)
