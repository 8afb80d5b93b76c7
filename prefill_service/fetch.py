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
Keys are always hashed by the instance that uses them (from token ids and the tenant's salt), never taken
from a caller. Only one-rank instances fetch or serve fetches (a CP group's pool is split over its ranks,
a TP group's mirrored).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine import LLMEngine
from shared.engine.core import EngineCommand
from shared.kvcache import Holder, OutOfBlocks
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.transfer import Destination, KVPush, TcpReceiver, TransferError
from shared.transfer.base import cache_kinds

log = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True)
class FetchEndpoint:
    """Where this instance receives fetched blocks (its flags: host, advertised host, TLS, timeouts)."""

    host: str
    advertise_host: str | None
    tls: object | None  # ssl.SSLContext of the receiver (server side), or None
    stall_seconds: float
    lease_seconds: float


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
        self.receiver: TcpReceiver | None = None
        if endpoint is not None:
            self.leases = LeaseTable(kv.ledger, kv.layout.block_size, kv.layout.num_layers, cache_kinds(kv.layout),
                                     endpoint.lease_seconds)
            self.receiver = TcpReceiver(kv, self.leases, endpoint.host, 0, advertise_host=endpoint.advertise_host,
                                        tls=endpoint.tls, stall_seconds=endpoint.stall_seconds)

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
        if self.receiver is not None:
            self.receiver.close()
