"""Prefix-cache keys of prompt blocks and the Bloom filter load reports carry: the router hashes a
prompt's blocks to find the instance that holds its prefix, without the KV cache or torch."""

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


class PrefixFilter:
    """A Bloom filter of cached block keys: what a prefill instance's prefix cache holds, in
    ~10 bits per block (8192 blocks → 10 KiB), so load reports can carry it. The keys are SHA-256
    digests already, so the k probe positions are slices of the key."""

    PROBES = 4

    def __init__(self, bits: bytes):
        self.bits = bits

    @classmethod
    def build(cls, hashes: list[bytes], capacity: int) -> PrefixFilter:
        size = max(64, 10 * capacity) // 8 * 8
        bits = bytearray(size // 8)
        for h in hashes:
            for pos in cls._positions(h, size):
                bits[pos >> 3] |= 1 << (pos & 7)
        return cls(bytes(bits))

    @staticmethod
    def _positions(h: bytes, size: int) -> list[int]:
        return [int.from_bytes(h[4 * i : 4 * i + 4], "little") % size for i in range(PrefixFilter.PROBES)]

    def __contains__(self, h: bytes) -> bool:
        size = len(self.bits) * 8
        return size > 0 and all(self.bits[p >> 3] >> (p & 7) & 1 for p in self._positions(h, size))

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its chained keys) the filter says are cached."""
        n = 0
        for h in hashes:
            if h not in self:
                break
            n += 1
        return n
