"""The block allocator: reference-counted block ids with a prefix cache. Only the block ledger
(shared.kvcache.ledger) gives references back; everything else reads it or allocates."""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

from shared.kvcache.events import CacheEvent, CacheEventKind, CacheListener, Tier


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the caller decides (wait, preempt, reject)."""


@dataclass(frozen=True)
class PoolState:
    """A consistent copy of the allocator's books (the ledger's debug check reads it)."""

    num_blocks: int
    free: list[int]
    evictable: list[int]
    refs: dict[int, int]
    releasing: dict[int, list[str]]  # block → who queued a release of it (drained on the engine thread)


class BlockAllocator:
    """Reference-counted block ids with a prefix cache; thread-safe so gRPC handlers can reserve
    concurrently.

    A full block whose KV is computed can be registered under a hash of (parent hash, its tokens).
    When its last reference goes it stays cached (evictable, least recently used first) instead of
    returning to the free list, so a later request with the same prefix claims it with `lookup`
    instead of recomputing it. Allocation takes free blocks first, then evicts cached ones.

    A release another thread asks for is queued (`_queue_block_release`) until the engine thread drains
    it: a queued block counts as free, since the ledger drains the queue before every allocation."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._serial_of: dict[int, int] = {}  # block → its registration's serial (a second tier's copy checks it)
        self._serials = itertools.count(1)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._releasing: dict[int, list[str]] = {}  # references given up off the engine thread, not dropped yet
        self._lock = threading.Lock()
        self.listeners: list[CacheListener] = []  # told every block stored in / removed from the prefix cache

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get (free + evictable cached + queued releases of every reference)."""
        return len(self._free) + len(self._evictable) + self._num_releasing

    def _emit(self, kind: CacheEventKind, block_hash: bytes = b"") -> None:
        """Tell the listeners (lock held, so they see the cache's changes in order)."""
        if self.listeners:
            event = CacheEvent(kind, Tier.DEVICE, block_hash)
            for listener in self.listeners:
                listener(event)

    @property
    def num_cached(self) -> int:
        """Blocks held by the prefix cache (referenced or not)."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            available = len(self._free) + len(self._evictable)
            if n > available:
                raise OutOfBlocks(f"need {n} blocks, {available} free")
            blocks = []
            for _ in range(n):
                if self._free:
                    block = self._free.pop()
                else:  # evict the least recently used cached block
                    block, _ = self._evictable.popitem(last=False)
                    evicted = self._hash_of.pop(block)
                    del self._block_of[evicted], self._serial_of[block]
                    self._emit(CacheEventKind.REMOVED, evicted)
                self._refs[block] = 1
                blocks.append(block)
            return blocks

    def _release_blocks(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks stay cached (evictable).
        The ledger's alone to call."""
        with self._lock:
            for b in blocks:
                self._drop(b)

    def _drop(self, b: int) -> None:
        """One reference less (lock held)."""
        refs = self._refs.get(b)
        if refs is None:
            raise ValueError(f"block {b} freed twice or never allocated")
        if refs > 1:
            self._refs[b] = refs - 1
            return
        del self._refs[b]
        if b in self._hash_of:
            self._evictable[b] = None
        else:
            self._free.append(b)

    def _queue_block_release(self, blocks: list[int], why: str) -> None:
        """Another thread gives up one reference to each block (a lease's: a block it shares with the prefix
        cache has others); the ledger drains it on the engine thread (`_drain_block_releases`). The ledger's
        alone to call."""
        with self._lock:
            queued = Counter(blocks)
            for b, n in queued.items():
                if self._refs.get(b, 0) < len(self._releasing.get(b, ())) + n:
                    raise ValueError(f"block {b} ({why}): more releases than references "
                                     f"({self._refs.get(b, 0)} references, {len(self._releasing.get(b, ()))} queued)")
            for b in blocks:
                self._releasing.setdefault(b, []).append(why)

    @property
    def _num_releasing(self) -> int:
        """Queued blocks whose every reference is being released (they will be free)."""
        return sum(1 for b, whys in self._releasing.items() if len(whys) == self._refs.get(b))

    def _drain_block_releases(self) -> int:
        """Drop the queued releases' references; how many. The ledger's alone to call."""
        with self._lock:
            queued, self._releasing = self._releasing, {}
            for b, whys in queued.items():
                for _ in whys:
                    self._drop(b)
            return sum(len(whys) for whys in queued.values())

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Claim (one reference each) the cached blocks of the longest prefix of `hashes`."""
        hits = []
        with self._lock:
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                if block in self._evictable:
                    del self._evictable[block]
                    self._refs[block] = 1
                else:
                    self._refs[block] += 1
                hits.append(block)
        return hits

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading keys of `hashes` are cached, claiming nothing (a fetch plans with it)."""
        with self._lock:
            n = 0
            while n < len(hashes) and hashes[n] in self._block_of:
                n += 1
            return n

    def register(self, block: int, block_hash: bytes) -> int:
        """Cache a referenced block whose KV is complete (a hash already cached keeps its block). Returns
        the registration's serial (0: not registered), which `holds` checks: a block evicted and registered
        again, even under the same key, gets a new one."""
        with self._lock:
            if block_hash in self._block_of or block in self._hash_of or block not in self._refs:
                return 0
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block
            serial = self._serial_of[block] = next(self._serials)
            self._emit(CacheEventKind.STORED, block_hash)
            return serial

    def holds(self, block: int, block_hash: bytes, serial: int) -> bool:
        """Whether `block` is still cached under the registration `serial` made (so its bytes are that
        key's KV, unchanged since: an eviction removes the key before the block is reused)."""
        with self._lock:
            return self._hash_of.get(block) == block_hash and self._serial_of.get(block) == serial

    def cached_hashes(self) -> list[bytes]:
        """The keys of every cached block (what an event log attached late starts from: shared.kvcache.event_log)."""
        with self._lock:
            return list(self._block_of)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (unreferenced cached blocks become free)."""
        with self._lock:
            self._free.extend(self._evictable)
            self._evictable.clear()
            self._hash_of.clear()
            self._block_of.clear()
            self._serial_of.clear()
            self._emit(CacheEventKind.CLEARED)

    def state(self) -> PoolState:
        """A consistent copy of the books (O(blocks): the ledger's debug check)."""
        with self._lock:
            return PoolState(self.num_blocks, list(self._free), list(self._evictable), dict(self._refs),
                             {b: list(whys) for b, whys in self._releasing.items()})
