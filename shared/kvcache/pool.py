"""Paged pools and the block allocator."""

from __future__ import annotations

import threading

import torch

from shared.kvcache.layout import KVLayout


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the caller decides (wait, preempt, reject)."""


class BlockAllocator:
    """Free-list allocator of block ids; thread-safe so gRPC handlers can reserve concurrently."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
            blocks = [self._free.pop() for _ in range(n)]
            self._used.update(blocks)
            return blocks

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            for b in blocks:
                if b not in self._used:
                    raise ValueError(f"block {b} freed twice or never allocated")
                self._used.remove(b)
                self._free.append(b)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCache:
    """Per-layer paged pools described by a KVLayout, plus their block allocator.

    Pools are zero-initialized: padded attention reads unused slots, which must stay finite.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        L, bs = layout.num_layers, layout.block_size
        self.mla = torch.zeros(L, num_blocks, bs, layout.mla_dim, dtype=layout.dtype, device=device)
        self.index = (
            torch.zeros(L, num_blocks, bs, layout.index_head_dim, dtype=layout.index_dtype, device=device)
            if layout.has_index else None
        )
        self.allocator = BlockAllocator(num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.layout.block_size)

    def read_tokens(self, block_table: list[int], num_tokens: int, layer: int) -> dict[str, torch.Tensor]:
        """A request's cached rows for one layer in position order (tests, debugging)."""
        bs = self.layout.block_size
        slots = torch.tensor([block_table[t // bs] * bs + t % bs for t in range(num_tokens)], dtype=torch.long)
        slots = slots.to(self.device)
        out = {"mla": self.mla[layer].view(-1, self.layout.mla_dim)[slots]}
        if self.index is not None:
            out["index"] = self.index[layer].view(-1, self.layout.index_head_dim)[slots]
        return out
