"""Reservations of KV blocks under leases (decode side of the prefill → decode push).

A lease holds blocks for one request until the decode step claims them. Every write must name a live
lease and carry its random token; a lease nobody claims expires and frees its blocks; release frees
at once (prefill failure, client cancel). All methods are thread-safe (gRPC and receiver threads).
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from shared.kvcache.pool import BlockAllocator, OutOfBlocks

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
    received: set[tuple[int, str]] = field(default_factory=set)
    committed: bool = False

    @property
    def complete(self) -> bool:
        return self.committed and len(self.received) == self.num_layers * len(self.kinds)


class LeaseTable:
    def __init__(self, allocator: BlockAllocator, block_size: int, num_layers: int, kinds: tuple[str, ...],
                 ttl_seconds: float = 30.0):
        self.allocator, self.block_size = allocator, block_size
        self.num_layers, self.kinds, self.ttl = num_layers, kinds, ttl_seconds
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._expired: list[str] = []

    def __len__(self) -> int:
        return len(self._leases)

    def reserve(self, request_id: str, num_tokens: int, lease_id: str | None = None,
                token: bytes | None = None) -> Lease:
        """Blocks for `num_tokens` under a new lease (id and token given by a caller that mirrors
        the same lease on several ranks)."""
        need = -(-num_tokens // self.block_size)
        blocks = self.allocator.allocate(need)  # raises OutOfBlocks
        lease = Lease(lease_id or uuid.uuid4().hex, request_id, token or secrets.token_bytes(16), blocks,
                      time.monotonic() + self.ttl, self.num_layers, self.kinds)
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

    def mark_received(self, lease: Lease, layer: int, kind: str) -> None:
        with self._lock:
            lease.received.add((layer, kind))

    def commit(self, lease: Lease) -> bool:
        with self._lock:
            lease.committed = True
            return lease.complete

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
                missing = self.num_layers * len(self.kinds) - len(lease.received)
                raise LeaseError(f"lease {lease_id!r} is incomplete: {missing} layer caches missing"
                                 + ("" if lease.committed else ", no commit"))
            del self._leases[lease_id]
            return lease

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.allocator.free(lease.blocks)
        return lease is not None

    def expire(self, now: float | None = None) -> int:
        """Free every lease past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if now > lease.expires_at]
            for lease in dead:
                del self._leases[lease.lease_id]
        for lease in dead:
            self.allocator.free(lease.blocks)
        self._expired.extend(lease.lease_id for lease in dead)
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


__all__ = ["Lease", "LeaseError", "LeaseTable", "OutOfBlocks"]
