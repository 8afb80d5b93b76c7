"""The block ledger of a rank: who holds each KV block, and the one code that gives blocks back.

A block is free, evictable in the prefix cache, or held: by a lease (reserved for a push into decode), a
sequence (its block table; a prefix-cache block shared by n sequences is held by each of them), a push
(prefill: a completed prompt's blocks until its push commits), the isolation probe, a parallel rank's
scratch block, or a release queued from another thread. Every hand-off between holders is a method
here, called on the engine thread (the thread that steps the rank). A receiver thread (a dead lease's
last write ends, a stalled writer's lease is abandoned) only queues its release, which the engine thread
drains at every step and before every allocation: a queued block counts as free from the moment it is
queued, and only the engine thread changes the free list. A push thread hands its blocks back by a
command the engine thread applies (prefill_service.worker.FreeBlocks).

Debug mode (PDSERVE_KV_LEDGER_CHECK=1, read once per ledger; tests/conftest.py turns it on for the suite)
checks at every step (`settle`) that each block has exactly one owner and that a held block's reference
count equals its number of holders. It costs O(blocks) per step, so it is off by default.
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.kvcache.allocator import BlockAllocator, OutOfBlocks, PoolState

if TYPE_CHECKING:
    from shared.kvcache.tier import KVTier

CHECK_ENV = "PDSERVE_KV_LEDGER_CHECK"


class Owner(enum.Enum):
    """What a block belongs to: nobody (free), the prefix cache (evictable), or a kind of holder."""

    FREE = "free"
    PREFIX_CACHE = "prefix cache"
    LEASE = "lease"
    SEQUENCE = "sequence"
    PUSH = "push"
    PROBE = "probe"
    SCRATCH = "scratch"
    RELEASING = "releasing"  # released off the engine thread, not drained yet


@dataclass(frozen=True)
class Holder:
    """One holder of blocks; each holds one reference to each of its blocks."""

    owner: Owner
    name: str = ""  # a request or lease id; for a queued release, who queued it
    serial: int = 0  # tells two holders of one name apart (two pushes of one request id)

    def __str__(self) -> str:
        return f"{self.owner.value} {self.name}".rstrip()


@dataclass(frozen=True)
class Holding:
    holder: Holder
    blocks: Sequence[int]


class HoldingSource(Protocol):
    """Holders the ledger does not keep itself (the scheduler's sequences, a lease table's leases)."""

    def holdings(self) -> Iterable[Holding]: ...


class BlockTable(Protocol):
    """A sequence as the ledger sees it (shared.engine.scheduler.Sequence)."""

    request_id: str
    block_table: list[int]


class LedgerViolation(AssertionError):
    """The debug check found a block without exactly one owner (or with references ≠ holders)."""

    def __init__(self, block: int, owners: list[str], problem: str):
        super().__init__(f"KV block {block} {problem}; its owners: {', '.join(owners) or 'nobody'}")
        self.block, self.owners = block, owners


def check_from_env() -> bool:
    return os.environ.get(CHECK_ENV, "").strip() not in ("", "0")


class BlockLedger:
    """One rank's ledger over its BlockAllocator (module doc). Its methods run on the engine thread, but
    `queue_lease_end` (any thread); the holders it keeps itself change under its lock, so the debug check
    sees them whole even where a test hands a push's blocks back from the push's thread."""

    def __init__(self, allocator: BlockAllocator, check: bool | None = None):
        self.allocator = allocator
        self.checking = check_from_env() if check is None else check
        self._kept: dict[Holder, list[int]] = {}  # the holders the ledger keeps: pushes, probe, scratch
        self._sources: list[HoldingSource] = []
        self._serials = itertools.count(1)
        self._suspects: set[int] = set()  # blocks the last check saw with more references than holders
        self._lock = threading.Lock()
        self.tier: KVTier | None = None  # a second tier (KVCache.attach_tier): spilled to, restored from
        self.last_restored = 0  # blocks the last retain_prefix / lease_prefix read back from the tier

    # -- reads -----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def watch(self, source: HoldingSource) -> None:
        """A holder of blocks the debug check must count (the scheduler, a lease table)."""
        self._sources.append(source)

    # -- allocation and the prefix cache (engine thread) -------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Fresh blocks, one reference each, for the caller to hold (a lease reserving); OutOfBlocks."""
        self.drain()
        return self.allocator.allocate(n)

    def grow(self, seq: BlockTable, n: int) -> None:
        """A sequence's block table grows by `n` fresh blocks."""
        seq.block_table.extend(self.allocate(n))

    def retain_prefix(self, seq: BlockTable, hashes: list[bytes]) -> int:
        """Prefix cache → sequence: a queued request starts on the cached blocks of its longest cached
        prefix (one more reference each), then on the blocks the second tier holds past it (`restore`);
        how many in all (`last_restored` of them from the tier)."""
        seq.block_table = self.lease_prefix(hashes)  # the same claim as a reservation's
        return len(seq.block_table)

    def lease_prefix(self, hashes: list[bytes]) -> list[int]:
        """Prefix cache → lease: a reservation starts on the cached blocks of the longest cached prefix of
        its prompt (one more reference each), then on the second tier's past it (`restore`; the push fills
        only the blocks after them)."""
        hits = self.allocator.lookup(hashes)
        return hits + self.restore(hashes[len(hits):])

    def restore(self, hashes: list[bytes]) -> list[int]:
        """Second tier → prefix cache → caller: the longest run of `hashes` the tier holds (validated
        records only) is read into fresh blocks, each registered under its key and held once by the caller
        (retain_prefix's sequence, lease_prefix's lease), as a device hit would be. Takes free blocks only
        as far as the pool has them (evicting colder cached blocks, as any allocation does)."""
        self.last_restored = 0
        if self.tier is None or not hashes:
            return []
        self.drain()
        found = self.tier.fetch(hashes, self.allocator.num_free)
        if not found:
            return []
        try:
            blocks = self.allocator.allocate(len(found))
        except OutOfBlocks:  # another thread's reservation took them meanwhile: a miss
            return []
        for block, (key, payload) in zip(blocks, found):
            self.tier.load(block, payload)
            self.allocator.register(block, key)
        self.last_restored = len(blocks)
        return blocks

    def register(self, block: int, block_hash: bytes) -> None:
        """A held block whose KV is complete enters the prefix cache (its holders keep it), and is offered
        to the second tier (copied there off the engine thread)."""
        serial = self.allocator.register(block, block_hash)
        if serial and self.tier is not None:
            self.tier.offer(block, block_hash, serial)

    # -- sequences (engine thread) ---------------------------------------------------------------
    def release_prefix(self, seq: BlockTable) -> None:
        """A queued request not admitted after all gives its prefix-cache hits back (looked up again later)."""
        self._give_back(seq)

    def preempt(self, seq: BlockTable) -> None:
        """A preempted request gives its blocks back (it recomputes them later)."""
        self._give_back(seq)

    def finish(self, seq: BlockTable) -> None:
        """A request that ended (finished, aborted, cancelled, failed) gives its blocks back."""
        self._give_back(seq)

    def hand_to_push(self, seq: BlockTable) -> Holder:
        """Sequence → push: a completed prompt's blocks go to its KV push, which reads them until it
        commits (`end_push`); the sequence holds none any more."""
        holder = Holder(Owner.PUSH, seq.request_id, next(self._serials))
        with self._lock:
            self._kept[holder], seq.block_table = seq.block_table, []
        return holder

    def hold_cached(self, hashes: list[bytes], why: str) -> Holding:
        """Prefix cache → push: the cached blocks of the longest cached prefix of `hashes`, pinned (one more
        reference each) while a push to another instance reads them (`end_push`)."""
        holder = Holder(Owner.PUSH, why, next(self._serials))
        blocks = self.allocator.lookup(hashes)
        with self._lock:
            self._kept[holder] = blocks
        return Holding(holder, list(blocks))

    def adopt(self, lease_blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Claimed lease → prefix cache: blocks another instance pushed are registered under their keys (one
        key per leading block), then the lease's references go back: the registered ones stay cached."""
        for block, block_hash in zip(lease_blocks, hashes):
            self.register(block, block_hash)
        self._return(lease_blocks)

    def end_push(self, holder: Holder) -> None:
        """Push → free: the push committed, failed or was given up; its blocks go back."""
        with self._lock:
            self._return(self._kept.pop(holder))

    # -- leases ----------------------------------------------------------------------------------
    def seat(self, seq: BlockTable, lease_blocks: Sequence[int]) -> None:
        """Lease → sequence: a claimed lease's blocks become the sequence's block table (the lease's
        reference to each is the sequence's now)."""
        seq.block_table = list(lease_blocks)

    def drop_claimed(self, lease_blocks: Sequence[int]) -> None:
        """A claimed lease whose request could not start: its blocks go back."""
        self._return(lease_blocks)

    def end_lease(self, lease_blocks: Sequence[int]) -> None:
        """Engine thread: a lease released or expired with no write in flight; its blocks go back."""
        self._return(lease_blocks)

    def queue_lease_end(self, lease_id: str, lease_blocks: Sequence[int]) -> None:
        """Any thread (a receiver's): a dead lease's last write ended, or a stalled writer's lease was
        abandoned; its release is queued for the engine thread (`drain`). Its blocks count as free now."""
        self.allocator._queue_block_release(list(lease_blocks), f"lease {lease_id}")

    # -- the engine's own blocks (engine thread) -------------------------------------------------
    def borrow_probe(self) -> Holding:
        """One block for the isolation probe's one-token forward (OutOfBlocks: none free)."""
        holding = Holding(Holder(Owner.PROBE, serial=next(self._serials)), self.allocate(1))
        with self._lock:
            self._kept[holding.holder] = list(holding.blocks)
        return holding

    def return_probe(self, probe: Holding) -> None:
        with self._lock:
            self._return(self._kept.pop(probe.holder))

    def hold_scratch(self) -> list[int]:
        """A parallel rank's scratch block for dummy batches, held as long as the engine lives."""
        blocks = self.allocate(1)
        with self._lock:
            self._kept[Holder(Owner.SCRATCH, serial=next(self._serials))] = blocks
        return blocks

    # -- the engine thread's turn ----------------------------------------------------------------
    def drain(self) -> int:
        """Drop the references released off the engine thread since the last drain; how many."""
        return self.allocator._drain_block_releases()

    def settle(self) -> None:
        """At every step: drain the queued releases, and in debug mode check every block's owner."""
        self.drain()
        if self.checking:
            self.check()

    def _give_back(self, seq: BlockTable) -> None:
        blocks, seq.block_table = seq.block_table, []
        self._return(blocks)

    def _return(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.allocator._release_blocks(list(blocks))

    # -- debug check -----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise LedgerViolation unless every block has exactly one owner: free, the prefix cache, or its
        holders, as many as its references. A block with more references than holders is a leak when two
        checks in a row see it (a hand-off made on another thread may be seen half done once)."""
        with self._lock:  # the pool before the sources: a lease's release queued meanwhile is seen once at most
            pool = self.allocator.state()
            holdings = [Holding(h, list(b)) for h, b in self._kept.items()]
        holdings += [h for source in self._sources for h in source.holdings()]
        holders: dict[int, list[Holder]] = defaultdict(list)
        for block, whys in pool.releasing.items():
            holders[block] += [Holder(Owner.RELEASING, why) for why in whys]
        for holding in holdings:
            for block in holding.blocks:
                holders[block].append(holding.holder)
        self._check_owners(pool, holders)

    def _check_owners(self, pool: PoolState, holders: dict[int, list[Holder]]) -> None:
        free, evictable = set(pool.free), set(pool.evictable)

        def owners(block: int) -> list[str]:
            return ([Owner.FREE.value] * pool.free.count(block) + [Owner.PREFIX_CACHE.value] * (block in evictable)
                    + [str(h) for h in holders.get(block, [])])

        if len(free) < len(pool.free):
            block = min(b for b in free if pool.free.count(b) > 1)
            raise LedgerViolation(block, owners(block), "is on the free list twice")
        unheld = free | evictable
        if clash := (free & evictable) | (unheld & (pool.refs.keys() | holders.keys())):
            block = min(clash)
            raise LedgerViolation(block, owners(block), f"has {pool.refs.get(block, 0)} references and more "
                                                        "than one owner")
        counts = {block: (pool.refs.get(block, 0), len(holders.get(block, [])))
                  for block in pool.refs.keys() | holders.keys()}
        if over := [block for block, (refs, held) in counts.items() if held > refs]:
            block = min(over)
            raise LedgerViolation(block, owners(block), "has {} references for {} holders".format(*counts[block]))
        leaks = {block for block, (refs, held) in counts.items() if held < refs}
        if len(unheld) + len(pool.refs) != pool.num_blocks:  # disjoint by now: a block fell out of the books
            lost = min(set(range(pool.num_blocks)) - unheld - pool.refs.keys())
            raise LedgerViolation(lost, [], "is neither free, cached nor referenced")
        confirmed, self._suspects = leaks & self._suspects, leaks
        if confirmed:
            block = min(confirmed)
            raise LedgerViolation(block, owners(block), f"leaked: {pool.refs[block]} references for "
                                                        f"{len(holders.get(block, []))} holders")
