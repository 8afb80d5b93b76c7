"""Paged pools, with their block allocator and its ledger."""

from __future__ import annotations

import torch

from shared.device import zeros_on_huge_pages
from shared.kvcache.allocator import BlockAllocator
from shared.kvcache.layout import KVLayout
from shared.kvcache.ledger import BlockLedger
from shared.kvcache.tier import KVTier, TierStore
from shared.protocol.limits import blocks_for


class KVCache:
    """Per-layer paged pools described by a KVLayout, plus their block allocator (read it, allocate from
    it) and the ledger of who holds each block (the one way blocks go back).

    Pools are zero-initialized: padded attention reads unused slots, which must stay finite.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        L, bs = layout.num_layers, layout.block_size
        self.mla_codec, self.index_codec = layout.mla_codec(), layout.index_codec()
        self.mla = zeros_on_huge_pages((L, num_blocks, bs, self.mla_codec.width), self.mla_codec.dtype, device)
        self.index = (
            zeros_on_huge_pages((L, num_blocks, bs, self.index_codec.width), self.index_codec.dtype, device)
            if layout.has_index else None
        )
        self.allocator = BlockAllocator(num_blocks)
        self.ledger = BlockLedger(self.allocator)
        self.tier: KVTier | None = None  # attach_tier

    def pools(self) -> list[torch.Tensor]:
        """Every pool a block has rows in, block index at dim 1 (what a second tier copies per block)."""
        return [self.mla] + ([self.index] if self.index is not None else [])

    def attach_tier(self, tokens: int, directory: str | None = None, store: TierStore | None = None) -> KVTier:
        """A second tier of `tokens` capacity behind this cache (shared.kvcache.tier): the ledger spills
        registered blocks to it and reads prefixes back from it (from `store` when given: a cluster-wide one)."""
        self.tier = self.ledger.tier = KVTier.for_cache(self, tokens, directory, store)
        return self.tier

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
