"""Paged KV cache: the one description of what is cached (KVLayout) and the pools that hold it."""

from shared.kvcache.layout import KVLayout
from shared.kvcache.pool import BlockAllocator, KVCache, OutOfBlocks

__all__ = ["BlockAllocator", "KVCache", "KVLayout", "OutOfBlocks"]
