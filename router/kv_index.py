"""The router's index of the fleet's prefix caches: which instance (and DP rank, and tier) holds which block.

Built only from the instances' KvEvents streams (router.pools subscribes one task per instance), so every
router replica that has read the same events holds the same index. A snapshot replaces an instance's
entries; an instance that leaves its pool, or whose stream stays down past `KV_GRACE_S`, loses them.

Bounded: at most `max_entries` (instance, rank, tier, block) entries (DEFAULT_MAX_ENTRIES, about 200 B
each: ~100 MiB at the default). Past it, the instance holding the most entries loses its oldest stored
entry. An index miss is only a missed hit (the request's prefix is computed or pushed again), never a
wrong one: a prompt's hits are counted as its *leading* blocks held, so a dropped entry at most shortens
the prefix counted. No torch here: keys are the bytes of shared.protocol.prefix.prompt_block_hashes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared import metrics
from shared.rpc.pdserve.v1 import internal_pb2

DEFAULT_MAX_ENTRIES = 1 << 19
KV_GRACE_S = 10.0  # a stream down this long: its instance's entries are dropped (a restart sends a snapshot)
HOST_HIT_WEIGHT = 0.5  # a block in the second tier saves its compute or push but costs a read back: half a hit
MAX_RANK = 1 << 12  # a streamed rank beyond this is refused (a hostile or broken instance)
MAX_HASH_BYTES = 64
DEVICE, HOST = internal_pb2.KvBlockEvent.DEVICE, internal_pb2.KvBlockEvent.HOST
STORED, REMOVED, CLEARED = (internal_pb2.KvBlockEvent.STORED, internal_pb2.KvBlockEvent.REMOVED,
                            internal_pb2.KvBlockEvent.CLEARED)
Entry = tuple[int, int, bytes]  # (rank, tier, block hash)


@dataclass(frozen=True)
class CachedPrefix:
    """How much of a prompt's leading blocks one rank of one instance holds, by tier."""

    device_blocks: int = 0
    host_blocks: int = 0

    def tokens(self, block_size: int) -> int:
        """Prompt tokens counted as cached: a device block whole, a host block at HOST_HIT_WEIGHT."""
        return int((self.device_blocks + HOST_HIT_WEIGHT * self.host_blocks) * block_size)


class KvIndex:
    """Instance address → its (rank, tier, hash) entries (oldest stored first), and hash → who holds it."""

    def __init__(self, kind: str, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.kind, self.max_entries = kind, max_entries
        self._of: dict[str, OrderedDict[Entry, None]] = {}
        self._where: dict[bytes, set[tuple[str, int, int]]] = {}
        self.block_size: dict[str, int] = {}
        self.size = 0
        metrics.KV_INDEX_BLOCKS.labels(kind).set(0)
        metrics.KV_INDEX_RESYNCS.labels(kind)

    def apply(self, address: str, batch: internal_pb2.KvEventBatch) -> None:
        """One streamed batch (a snapshot's first one forgets the instance first). ValueError naming the
        field for an event no instance sends (the caller drops the instance and subscribes afresh)."""
        if batch.snapshot:
            self.drop(address)
            metrics.KV_INDEX_RESYNCS.labels(self.kind).inc()
        if batch.block_size > 0:
            self.block_size[address] = batch.block_size
        entries = self._of.setdefault(address, OrderedDict())
        for ev in batch.events:
            if not 0 <= ev.rank < MAX_RANK:
                raise ValueError(f"events.rank: {ev.rank} out of range")
            if ev.tier not in (DEVICE, HOST):
                raise ValueError(f"events.tier: {ev.tier} is not DEVICE or HOST")
            if ev.kind == CLEARED:
                for entry in [e for e in entries if e[0] == ev.rank and e[1] == ev.tier]:
                    self._remove(address, entries, entry)
                continue
            if not 0 < len(ev.block_hash) <= MAX_HASH_BYTES:
                raise ValueError(f"events.block_hash: {len(ev.block_hash)} bytes")
            entry = (ev.rank, ev.tier, ev.block_hash)
            if ev.kind == STORED:
                if entry in entries:
                    entries.move_to_end(entry)
                    continue
                entries[entry] = None
                self._where.setdefault(ev.block_hash, set()).add((address, ev.rank, ev.tier))
                self.size += 1
            elif ev.kind == REMOVED:
                self._remove(address, entries, entry)
            else:
                raise ValueError(f"events.kind: {ev.kind} is not STORED, REMOVED or CLEARED")
        self._trim()
        metrics.KV_INDEX_BLOCKS.labels(self.kind).set(self.size)

    def drop(self, address: str) -> None:
        """Forget an instance (it left the pool, stayed down, restarted, or sends a snapshot)."""
        entries = self._of.pop(address, None)
        for rank, tier, h in entries or ():
            holders = self._where.get(h)
            if holders is not None:
                holders.discard((address, rank, tier))
                if not holders:
                    del self._where[h]
        self.size -= len(entries or ())
        metrics.KV_INDEX_BLOCKS.labels(self.kind).set(self.size)

    def _remove(self, address: str, entries: OrderedDict[Entry, None], entry: Entry) -> None:
        if entries.pop(entry, False) is not False:
            self.size -= 1
            holders = self._where.get(entry[2])
            if holders is not None:
                holders.discard((address, entry[0], entry[1]))
                if not holders:
                    del self._where[entry[2]]

    def _trim(self) -> None:
        """Past the cap: the largest instance's oldest entries go."""
        while self.size > self.max_entries:
            address, entries = max(self._of.items(), key=lambda kv: len(kv[1]))
            self._remove(address, entries, next(iter(entries)))

    def addresses(self) -> list[str]:
        return list(self._of)

    def entries(self, address: str) -> int:
        return len(self._of.get(address, ()))

    def cached(self, address: str, hashes: list[bytes], rank: int = 0) -> CachedPrefix:
        """The leading blocks of `hashes` that `rank` of `address` holds: on the device, else in the host tier."""
        device = host = 0
        for h in hashes:
            holders = self._where.get(h, ())
            if (address, rank, DEVICE) in holders:
                device += 1
            elif (address, rank, HOST) in holders:
                host += 1
            else:
                break
        return CachedPrefix(device, host)

    def best_rank(self, address: str, hashes: list[bytes], ranks: int) -> CachedPrefix:
        """The rank of `address` (of `ranks`) holding the most of the prompt's leading blocks."""
        return max((self.cached(address, hashes, r) for r in range(max(1, ranks))),
                   key=lambda c: c.tokens(1), default=CachedPrefix())
