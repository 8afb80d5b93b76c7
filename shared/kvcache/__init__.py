"""Paged KV cache: the one description of what is cached (KVLayout), the pools that hold it, the block
allocator, and the ledger of who holds each block."""

from shared.kvcache.allocator import BlockAllocator, OutOfBlocks
from shared.kvcache.events import CacheEvent, CacheEventKind, Tier
from shared.kvcache.layout import KVLayout
from shared.kvcache.ledger import BlockLedger, Holder, Holding, LedgerViolation, Owner
from shared.kvcache.pool import KVCache

__all__ = ["BlockAllocator", "BlockLedger", "CacheEvent", "CacheEventKind", "Holder", "Holding", "KVCache", "KVLayout",
           "LedgerViolation", "OutOfBlocks", "Owner", "Tier"]
