"""Reservations of KV blocks under leases (decode side of the prefill → decode push).

A lease holds blocks for one request until the decode step claims them. Every write must name a live
lease and carry its random token; a lease nobody claims expires and frees its blocks; release frees
at once (prefill failure, client cancel); a receiver abandons a lease whose writer stalled or went
mid-write. All methods are thread-safe (engine and receiver threads: see LeaseTable).

Leases are fences: a write holds its lease from `begin_write` to `end_write`; a lease released or
expired meanwhile leaves the table at once (no new writes, no claim) but its blocks are freed only
when the last write in flight ends, so no block is reused while bytes still land in it. Completion is
per block: every block of every layer and cache kind must have been written before a commit holds.

Blocks go back through the rank's BlockLedger: at once for a release or expiry on the engine thread,
queued (drained by the engine thread) when a receiver thread ends a dead lease's last write or abandons
a lease.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.kvcache.allocator import OutOfBlocks
from shared.kvcache.ledger import BlockLedger, Holder, Holding, Owner

LEASE_ID_LEN = 32  # uuid4 hex


class LeaseError(RuntimeError):
    """Unknown, expired, incomplete or mis-authenticated lease."""


@dataclass
class Lease:
    lease_id: str
    request_id: str
    token: bytes
    blocks: list[int]
    expires_at: float
    num_layers: int
    kinds: tuple[str, ...]
    prompt_blocks: int = 0  # blocks the push must fill (the prompt's); the rest are for generated tokens
    reused: int = 0  # leading blocks taken from this pool's prefix cache: shared, read-only, never pushed
    reused_hashes: tuple[bytes, ...] = ()  # their keys (the admitted prompt must hash to them)
    restored: int = 0  # of `reused`, read back from the second KV tier (the ledger's last_restored)
    covered: dict[tuple[int, str], set[int]] = field(default_factory=dict)  # (layer, kind) → written blocks
    committed: bool = False
    writers: int = 0  # writes in flight
    dead: bool = False  # released or expired while written: blocks freed by the last writer

    @property
    def missing(self) -> int:
        """(layer, kind) caches not fully written yet."""
        need = range(self.reused, self.prompt_blocks)
        return sum(1 for layer in range(self.num_layers) for kind in self.kinds
                   if not self.covered.get((layer, kind), set()).issuperset(need))

    @property
    def complete(self) -> bool:
        return self.committed and self.missing == 0


class LeaseTable:
    """The leases of one rank's pool. `reserve`, `claim`, `release` and `expire` run on the engine thread;
    the receiver threads write (`begin_write` / `end_write`), `commit`, `touch` and `abandon`."""

    def __init__(self, ledger: BlockLedger, block_size: int, num_layers: int, kinds: tuple[str, ...],
                 ttl_seconds: float = 30.0):
        self.ledger, self.block_size = ledger, block_size
        self.num_layers, self.kinds, self.ttl = num_layers, kinds, ttl_seconds
        self._leases: dict[str, Lease] = {}
        self._fenced: dict[str, Lease] = {}  # out of the table, blocks held until their writes in flight end
        self._lock = threading.Lock()
        self._expired: list[str] = []
        self.on_end: list[Callable[[Lease], None]] = []  # called once when a lease leaves the table
        ledger.watch(self)

    def _ended(self, leases: list[Lease]) -> None:
        for lease in leases:
            for hook in self.on_end:
                hook(lease)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def reserve(self, request_id: str, num_tokens: int, lease_id: str | None = None,
                token: bytes | None = None, prompt_tokens: int | None = None,
                prefix: Sequence[bytes] = ()) -> Lease:
        """Blocks for `num_tokens` under a new lease (id and token given by a caller that mirrors
        the same lease on several ranks); the push must fill the first `prompt_tokens` (all by default).
        With `prefix` (the prompt's leading block keys, fewer than its blocks) the lease starts on the blocks
        of the longest of them this pool caches: the push fills only the blocks after them."""
        need = -(-num_tokens // self.block_size)
        filled = need if prompt_tokens is None else -(-min(prompt_tokens, num_tokens) // self.block_size)
        reused = self.ledger.lease_prefix(list(prefix[: max(0, filled - 1)])) if prefix else []
        try:
            blocks = reused + self.ledger.allocate(need - len(reused))
        except OutOfBlocks:
            self.ledger.end_lease(reused)
            raise
        lease = Lease(lease_id or uuid.uuid4().hex, request_id, token or secrets.token_bytes(16), blocks,
                      time.monotonic() + self.ttl, self.num_layers, self.kinds, prompt_blocks=filled,
                      reused=len(reused), reused_hashes=tuple(prefix[: len(reused)]),
                      restored=self.ledger.last_restored if reused else 0)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def check(self, lease_id: str, token: bytes) -> Lease:
        """The live lease a write may target; LeaseError otherwise."""
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or time.monotonic() > lease.expires_at:
            raise LeaseError(f"unknown or expired lease {lease_id!r}")
        if not secrets.compare_digest(lease.token, token):
            raise LeaseError(f"bad token for lease {lease_id!r}")
        return lease

    def begin_write(self, lease_id: str, token: bytes, layer: int, kind: str, first: int, count: int) -> Lease:
        """Hold the lease for a write of its blocks [first, first + count) of one layer and kind."""
        lease = self.check(lease_id, token)
        if count <= 0 or first < lease.reused or first + count > len(lease.blocks):
            raise LeaseError(f"write of blocks [{first}, {first + count}) does not fit lease {lease_id!r} "
                             f"({len(lease.blocks)} blocks, the first {lease.reused} read-only: the prefix cache's)")
        if not 0 <= layer < self.num_layers or kind not in self.kinds:
            raise LeaseError(f"no cache for layer {layer} kind {kind!r}")
        with self._lock:
            if self._leases.get(lease_id) is not lease:
                raise LeaseError(f"unknown or expired lease {lease_id!r}")
            lease.writers += 1
            lease.expires_at = max(lease.expires_at, time.monotonic() + self.ttl)  # written to: alive
        return lease

    def end_write(self, lease: Lease, layer: int, kind: str, first: int, count: int, ok: bool) -> None:
        """Release the hold; a completed write covers its blocks. The last writer of a dead lease frees it."""
        with self._lock:
            lease.writers -= 1
            if ok and not lease.dead:
                lease.covered.setdefault((layer, kind), set()).update(range(first, first + count))
            free = lease.dead and lease.writers == 0
            if free:
                del self._fenced[lease.lease_id]
        if free:  # a receiver's thread: the engine thread drops the references
            self.ledger.queue_lease_end(lease.lease_id, lease.blocks)

    def touch(self, lease: Lease) -> None:
        """Keep-alive from the prefill working on this lease (queued or computing): it lives another TTL."""
        with self._lock:
            lease.expires_at = max(lease.expires_at, time.monotonic() + self.ttl)

    def commit(self, lease: Lease) -> bool:
        with self._lock:
            lease.committed = True
            return lease.complete and not lease.dead

    def written_prefix(self, lease: Lease) -> int:
        """Leading blocks of the lease written in every layer and cache kind (what a fetch can adopt)."""
        with self._lock:
            n = len(lease.blocks)
            for layer in range(self.num_layers):
                for kind in self.kinds:
                    covered, m = lease.covered.get((layer, kind), set()), 0
                    while m < n and m in covered:
                        m += 1
                    n = m
            return n

    def is_complete(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            return lease is not None and lease.complete

    def claim(self, lease_id: str, require_complete: bool = True) -> Lease:
        """Hand a complete lease's blocks to the caller (who frees them from now on). A TP mirror
        rank claims without the push (its KV is copied from rank 0 afterwards)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise LeaseError(f"unknown or expired lease {lease_id!r}")
            if require_complete and not lease.complete:
                raise LeaseError(f"lease {lease_id!r} is incomplete: {lease.missing} layer caches missing"
                                 + ("" if lease.committed else ", no commit"))
            if lease.writers:
                raise LeaseError(f"lease {lease_id!r} still has {lease.writers} writes in flight")
            del self._leases[lease_id]
        self._ended([lease])
        return lease

    def _retire(self, lease: Lease) -> bool:
        """Take a lease out of the table (lock held); True when its blocks can be freed now."""
        del self._leases[lease.lease_id]
        lease.dead = True
        if lease.writers:
            self._fenced[lease.lease_id] = lease
        return lease.writers == 0

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            free = lease is not None and self._retire(lease)
        if lease is not None:
            self._ended([lease])
        if free:
            self.ledger.end_lease(lease.blocks)
        return lease is not None

    def abandon(self, lease_id: str) -> bool:
        """Its writer stalled or went mid-write, so the push cannot complete: the lease leaves the table
        now (its blocks are freed as soon as the writes in flight end) and is reported with the expired
        ones (`drain_expired`, so a front forgets its routing). Whether it was still held."""
        with self._lock:
            lease = self._leases.get(lease_id)
            free = lease is not None and self._retire(lease)
            if lease is not None:
                self._expired.append(lease_id)
        if lease is not None:
            self._ended([lease])
        if free:  # a receiver's thread: the engine thread drops the references
            self.ledger.queue_lease_end(lease.lease_id, lease.blocks)
        return lease is not None

    def expire(self, now: float | None = None) -> int:
        """Free every lease past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if now > lease.expires_at]
            freeable = [lease for lease in dead if self._retire(lease)]
            self._expired.extend(lease.lease_id for lease in dead)
        self._ended(dead)
        for lease in freeable:
            self.ledger.end_lease(lease.blocks)
        return len(dead)

    def overdue(self, now: float | None = None) -> list[str]:
        """Ids of leases past their deadline, without freeing them (a TP mirror group releases them
        as an ordered command on every rank instead)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [lease.lease_id for lease in self._leases.values() if now > lease.expires_at]

    def drain_expired(self) -> list[str]:
        """Ids of leases expired since the last call (so a front can forget their routing)."""
        with self._lock:
            out, self._expired = self._expired, []
        return out

    def reserved_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.blocks) for lease in self._leases.values())

    def holdings(self) -> list[Holding]:
        """The blocks each lease holds: live ones, and dead ones fenced by a write in flight (the ledger's check)."""
        with self._lock:
            return [Holding(Holder(Owner.LEASE, lease.lease_id + (" (ended, a write in flight)" if lease.dead else "")),
                            lease.blocks) for lease in [*self._leases.values(), *self._fenced.values()]]


__all__ = ["Lease", "LeaseError", "LeaseTable", "OutOfBlocks"]
