"""Paged pools and the block allocator."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from shared.kvcache.layout import KVLayout
from shared.protocol.limits import blocks_for


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the caller decides (wait, preempt, reject)."""


class BlockAllocator:
    """Reference-counted block ids with a prefix cache; thread-safe so gRPC handlers can reserve
    concurrently.

    A full block whose KV is computed can be registered under a hash of (parent hash, its tokens).
    When its last reference goes it stays cached (evictable, least recently used first) instead of
    returning to the free list, so a later request with the same prefix claims it with `lookup`
    instead of recomputing it. Allocation takes free blocks first, then evicts cached ones."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks held by the prefix cache (referenced or not)."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > self.num_free:
                raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
            blocks = []
            for _ in range(n):
                if self._free:
                    block = self._free.pop()
                else:  # evict the least recently used cached block
                    block, _ = self._evictable.popitem(last=False)
                    del self._block_of[self._hash_of.pop(block)]
                self._refs[block] = 1
                blocks.append(block)
            return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks stay cached (evictable)."""
        with self._lock:
            for b in blocks:
                refs = self._refs.get(b)
                if refs is None:
                    raise ValueError(f"block {b} freed twice or never allocated")
                if refs > 1:
                    self._refs[b] = refs - 1
                    continue
                del self._refs[b]
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

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

    def register(self, block: int, block_hash: bytes) -> None:
        """Cache a referenced block whose KV is complete (a hash already cached keeps its block)."""
        with self._lock:
            if block_hash in self._block_of or block in self._hash_of or block not in self._refs:
                return
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block

    def cached_hashes(self) -> list[bytes]:
        """The keys of every cached block (for a prefix summary: see PrefixFilter)."""
        with self._lock:
            return list(self._block_of)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (unreferenced cached blocks become free)."""
        with self._lock:
            self._free.extend(self._evictable)
            self._evictable.clear()
            self._hash_of.clear()
            self._block_of.clear()


class KVCache:
    """Per-layer paged pools described by a KVLayout, plus their block allocator.

    Pools are zero-initialized: padded attention reads unused slots, which must stay finite.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        L, bs = layout.num_layers, layout.block_size
        self.mla_codec, self.index_codec = layout.mla_codec(), layout.index_codec()
        self.mla = torch.zeros(L, num_blocks, bs, self.mla_codec.width, dtype=self.mla_codec.dtype, device=device)
        self.index = (
            torch.zeros(L, num_blocks, bs, self.index_codec.width, dtype=self.index_codec.dtype, device=device)
            if layout.has_index else None
        )
        self.allocator = BlockAllocator(num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.layout.block_size)

    def read_tokens(self, block_table: list[int], num_tokens: int, layer: int) -> dict[str, torch.Tensor]:
        """A request's cached rows for one layer in position order, as stored (tests, debugging)."""
        bs = self.layout.block_size
        slots = torch.tensor([block_table[t // bs] * bs + t % bs for t in range(num_tokens)], dtype=torch.long)
        slots = slots.to(self.device)
        out = {"mla": self.mla[layer].view(-1, self.mla.shape[-1])[slots]}
        if self.index is not None:
            out["index"] = self.index[layer].view(-1, self.index.shape[-1])[slots]
        return out
