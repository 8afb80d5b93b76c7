"""Prefix-cache keys of prompt blocks: the router hashes a prompt's blocks to find the instance that holds
its prefix (in its index of the instances' KvEvents streams, router.kv_index), without the KV cache or torch."""

from __future__ import annotations

import hashlib
from array import array


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Prefix-cache key of a full block: SHA-256 of the parent block's key and this block's token ids
    (a collision-resistant hash, so no request can forge another's prefix)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def salt_root(cache_salt: str) -> bytes | None:
    """The parent key of a salted prompt's first block: a tenant's `cache_salt` starts its own chain, so
    its cached prefix is never matched by a request with another salt or none (the empty salt: None,
    today's unsalted keys)."""
    return hashlib.sha256(b"pdserve-cache-salt\0" + cache_salt.encode()).digest() if cache_salt else None


def prompt_block_hashes(tokens: list[int], block_size: int, limit: int | None = None,
                        cache_salt: str = "") -> list[bytes]:
    """The prefix-cache keys of a prompt's full blocks (the router computes them to look for hits),
    chained from `cache_salt`'s root as the engine's scheduler chains them."""
    out: list[bytes] = []
    root = salt_root(cache_salt)
    for i in range(min(len(tokens) // block_size, limit if limit is not None else 1 << 30)):
        out.append(block_hash(out[-1] if out else root, tokens[i * block_size : (i + 1) * block_size]))
    return out
