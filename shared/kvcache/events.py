"""What a rank's prefix cache tells the fleet: a block stored in or removed from one of its tiers.

The allocator emits these for the device pool; a second tier emits its own. Every event names the
block by its prefix-cache key (shared.protocol.prefix.block_hash: chained SHA-256 of the tokens and
the tenant's salt), never by its id, so a router's index keys match the keys it hashes from a prompt."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Tier(enum.Enum):
    """Where a cached block lives: the device pool, or the second tier (host memory on an accelerator,
    a file on local disk on CPU)."""

    DEVICE = "device"
    HOST = "host"


class CacheEventKind(enum.Enum):
    STORED = "stored"  # the block's KV is complete and can be matched
    REMOVED = "removed"  # evicted: no longer matched in this tier
    CLEARED = "cleared"  # the tier forgot everything (block_hash empty)


@dataclass(frozen=True)
class CacheEvent:
    kind: CacheEventKind
    tier: Tier
    block_hash: bytes = b""


CacheListener = Callable[[CacheEvent], None]  # called under the allocator's lock: keep it to an append
