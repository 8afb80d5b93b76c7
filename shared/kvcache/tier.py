"""The second KV tier: full prefix-cache blocks kept past their eviction from the device pool, in pinned host
memory (an accelerator's pool) or in files on local disk (a CPU's pool), read back when a prompt's cached
prefix on the device ends where the tier's begins.

Writes: **write-through, copy-then-verify, on a background thread**. Registering a block in the prefix cache
(BlockLedger.register) only queues (block, key, registration serial) — nothing is copied on the engine
thread. The writer copies the block's bytes of every pool KVCache has (the MLA latents with the MTP layer's
rows and C8 scales, the indexer keys: `KVCache.pools()`), then asks the allocator, under its lock, whether the
block still holds that key under the same registration (`BlockAllocator.holds`). An eviction removes the key
before the block is handed out again, and registering it again (even under the same key) takes a new serial,
so a block that was reused while being copied fails the check and the copy is discarded: a record is only
ever the bytes of a block that held its key throughout the copy, which nobody writes (a cached block is
complete). On an accelerator the copy is queued on the writer thread's current stream (the default stream,
behind the step that computed the block) and waited for before the check.

Reads (engine thread, BlockLedger.retain_prefix / lease_prefix → `fetch`): the keys after the device's hits
are looked up in order; each hit's record is validated (magic, key, layout description, length, SHA-256 of
the payload) before its bytes are copied into a fresh block; a record that fails is **dropped, never served**
(`dropped_corrupt`; pdserve_kv_tier_dropped_blocks_total reason=corrupt) and the prefix ends there (a miss:
the rest is computed).

Staleness: **a fresh store per process** — the file store is a new temporary directory (under `kv_tier_dir`
when given) removed on close and at exit; host memory dies with the process — so a restart serves nothing
written before it. A prefix-cache reset (the allocator's CLEARED) forgets the tier at once. The exception is
a *shared* store (`--kv-store-master`: Mooncake Store, shared.transfer.mooncake_store): its records are named
by the checkpoint's and layout's digest and the block key, so what any instance of the same model wrote is
what this one would compute; they are validated like any record and looked up when this rank's index misses.

Capacity: `kv_tier_tokens // block_size` blocks, least recently used (stored or read) evicted first
(`dropped_full`; reason=full). Every store, eviction and clear is told to the allocator's listeners as a
CacheEvent of Tier.HOST.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from shared.device import host_buffer, on_host
from shared.kvcache.allocator import BlockAllocator
from shared.kvcache.events import CacheEvent, CacheEventKind, Tier

log = logging.getLogger("pdserve.kvtier")

MAGIC = b"PDSKVT01"
_HEAD = struct.Struct("<8sI")  # magic, header length (the JSON header is padded so the payload is 16-aligned)
_ALIGN = 16


@dataclass
class TierStats:
    """What the tier did (tests read these; each rank's load report carries them to its front's /metrics:
    `totals`). Each count has one writing thread, so a reader on another sees whole numbers."""

    stored: int = 0  # records written
    written_bytes: int = 0
    read_blocks: int = 0  # records served (restored into device blocks)
    read_bytes: int = 0
    dropped_corrupt: int = 0
    dropped_full: int = 0
    discarded: int = 0  # copies thrown away: the block changed hands while being copied


def totals(tier: KVTier | None) -> TierStats:
    """A copy of a rank's tier counts, zeros without a tier (what its load report carries every turn)."""
    return replace(tier.stats) if tier is not None else TierStats()


@dataclass(frozen=True)
class PoolSlice:
    """One pool's share of a block's payload: where it lies and how it is shaped."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class TierStore(Protocol):
    """Where records live; a handle names one record (a path, a host tensor, a store's object name).
    A `shared` store (Mooncake Store: shared.transfer.mooncake_store) outlives this process and serves
    other instances: this rank's index only remembers what it wrote, `find` looks up what it did not, and
    forgetting a record (capacity, a clear) never deletes it for the others."""

    shared: bool

    def find(self, keys: list[bytes]) -> list[object]: ...

    def put(self, key: bytes, record: bytes, payload: torch.Tensor) -> object: ...

    def get(self, handle: object) -> torch.Tensor | None: ...

    def delete(self, handle: object) -> None: ...

    def close(self) -> None: ...


class FileStore:
    """One file per record in a fresh directory of this process (under `parent`, default the system's
    temporary directory); written to a temporary name and renamed, so a reader sees whole files or none."""

    shared = False

    def __init__(self, parent: str | None):
        if parent:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-tier-", dir=parent or None))
        self._names = iter(range(1, 1 << 62))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)

    def put(self, key: bytes, record: bytes, payload: torch.Tensor) -> Path:
        path = self.dir / f"{key.hex()[:32]}-{next(self._names)}"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(record)
            f.write(memoryview(payload.numpy()))
        os.replace(tmp, path)
        return path

    def get(self, handle: object) -> torch.Tensor | None:
        try:
            data = Path(str(handle)).read_bytes()
        except OSError:  # evicted meanwhile (a miss), or unreadable
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def find(self, keys: list[bytes]) -> list[object]:
        return []  # private to this process: the index knows every record

    def delete(self, handle: object) -> None:
        Path(str(handle)).unlink(missing_ok=True)

    def close(self) -> None:
        self._finalizer()


class HostStore:
    """Records in host memory: page-locked on an accelerator (shared.device.host_buffer), so a hit's copy
    into the device pool is a DMA."""

    shared = False

    def __init__(self, device: torch.device):
        self.device = device

    def put(self, key: bytes, record: bytes, payload: torch.Tensor) -> torch.Tensor:
        buf = host_buffer(len(record) + payload.numel(), self.device)
        buf[: len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        buf[len(record):] = payload
        return buf

    def get(self, handle: object) -> torch.Tensor | None:
        return handle if isinstance(handle, torch.Tensor) else None

    def find(self, keys: list[bytes]) -> list[object]:
        return []  # private to this process: the index knows every record

    def delete(self, handle: object) -> None:
        pass  # the index held the only reference

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _Offer:
    block: int
    key: bytes
    serial: int
    epoch: int


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class KVTier:
    """The second tier of one rank's KVCache (module doc). `offer` (engine thread, from the ledger's
    register) queues a write; `fetch` + `load` (engine thread) read records back into device blocks."""

    def __init__(self, pools: list[torch.Tensor], allocator: BlockAllocator, layout: dict[str, object],
                 capacity_blocks: int, store: TierStore):
        if capacity_blocks < 1:
            raise ValueError(f"kv_tier_tokens: the tier must hold at least one block, got {capacity_blocks}")
        self.pools, self.allocator, self.layout, self.capacity = pools, allocator, layout, capacity_blocks
        self.device = pools[0].device
        self.store = store
        self.slices: list[PoolSlice] = []
        offset = 0
        for pool in pools:  # [layers, blocks, block_size, width]: one block is pool[:, block]
            shape = (pool.shape[0], *pool.shape[2:])
            nbytes = pool[:, 0].numel() * pool.element_size()
            self.slices.append(PoolSlice(offset, nbytes, pool.dtype, shape))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.block_nbytes = offset
        self.stats = TierStats()
        self._index: OrderedDict[bytes, object] = OrderedDict()  # key → store handle, least recently used first
        self._epoch = 0  # a clear bumps it: offers and copies from before are discarded
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Offer | _Flush | None] = queue.Queue(maxsize=4 * capacity_blocks + 64)
        allocator.listeners.append(self._on_device_event)
        # the writer holds the tier weakly: an engine dropped without close() frees its pools and store
        self._writer = threading.Thread(target=_write_loop, args=(self._queue, weakref.ref(self)),
                                        name="kv-tier-writer", daemon=True)
        self._writer.start()
        weakref.finalize(self, self._queue.put, None)

    @classmethod
    def for_cache(cls, kv: object, tokens: int, directory: str | None, store: TierStore | None = None) -> KVTier:
        """The tier of a KVCache: in `store` when given, else host memory on an accelerator and files (under
        `directory`) on CPU."""
        pools = kv.pools()  # type: ignore[attr-defined]
        device = pools[0].device
        if store is None:
            store = FileStore(directory) if on_host(pools[0]) else HostStore(device)
        return cls(pools, kv.allocator, kv.layout.describe(), max(1, tokens // kv.layout.block_size), store)  # type: ignore[attr-defined]

    # -- state ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def handle(self, key: bytes) -> object | None:
        """Where a key's record is (a file path on CPU): tests alter it."""
        with self._lock:
            return self._index.get(key)

    # -- writes (engine thread queues, the writer copies) -------------------------------------------
    def offer(self, block: int, key: bytes, serial: int) -> None:
        """A block just registered under `key` (registration `serial`): copy it to the tier later. Never
        blocks: with the writer far behind, the offer is skipped (the block is simply not spilled)."""
        try:
            self._queue.put_nowait(_Offer(block, key, serial, self._epoch))
        except queue.Full:
            self.stats.discarded += 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every offer queued so far is written or discarded (tests, shutdown)."""
        marker = _Flush()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def _write(self, offer: _Offer) -> None:
        with self._lock:
            if offer.epoch != self._epoch:
                return
            if offer.key in self._index:
                self._index.move_to_end(offer.key)
                return
        payload = self._copy(offer.block)
        if not self.allocator.holds(offer.block, offer.key, offer.serial):  # reused while copied: not its KV
            self.stats.discarded += 1
            return
        record = self._header(offer.key, payload)
        handle = self.store.put(offer.key, record, payload)
        evicted: list[object] = []
        with self._lock:
            if offer.epoch != self._epoch or offer.key in self._index:
                evicted.append(handle)
            else:
                while len(self._index) >= self.capacity:
                    old, old_handle = self._index.popitem(last=False)
                    evicted.append(old_handle)
                    self.stats.dropped_full += 1
                    self._emit(CacheEventKind.REMOVED, old)
                self._index[offer.key] = handle
                self.stats.stored += 1
                self.stats.written_bytes += len(record) + payload.numel()
                self._emit(CacheEventKind.STORED, offer.key)
        if not self.store.shared:  # a shared store's records serve others: forgetting one here deletes nothing
            for old_handle in evicted:
                self.store.delete(old_handle)

    def _copy(self, block: int) -> torch.Tensor:
        """The block's bytes of every pool, in one host buffer (pinned on an accelerator)."""
        buf = host_buffer(self.block_nbytes, self.device)
        for pool, s in zip(self.pools, self.slices):
            self._view(buf, s).copy_(pool[:, block])  # a blocking copy: done when it returns
        return buf

    def _header(self, key: bytes, payload: torch.Tensor) -> bytes:
        """Magic, then the JSON header (key, layout, length, SHA-256 of the payload), padded to 16 bytes."""
        head = json.dumps({"key": key.hex(), "layout": self.layout, "length": payload.numel(),
                           "sha256": hashlib.sha256(memoryview(payload.numpy())).hexdigest()}).encode()
        head += b" " * (-(len(head) + _HEAD.size) % _ALIGN)
        return _HEAD.pack(MAGIC, len(head)) + head

    @staticmethod
    def _view(buf: torch.Tensor, s: PoolSlice) -> torch.Tensor:
        return buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)

    # -- reads (engine thread) ------------------------------------------------------------------------
    def fetch(self, keys: list[bytes], limit: int) -> list[tuple[bytes, torch.Tensor]]:
        """The validated payloads of the longest run of `keys` (at most `limit`) the tier holds, each
        touched as recently used; a record that fails validation is dropped and ends the run."""
        found: list[tuple[bytes, torch.Tensor]] = []
        keys = keys[: max(0, limit)]
        elsewhere: dict[bytes, object] | None = None  # a shared store's records of keys this rank did not write
        for i, key in enumerate(keys):
            with self._lock:
                handle = self._index.get(key)
                if handle is not None:
                    self._index.move_to_end(key)
            if handle is None and self.store.shared:
                if elsewhere is None:  # one lookup for the rest of the prompt
                    elsewhere = dict(zip(keys[i:], self.store.find(keys[i:])))
                handle = elsewhere.get(key)
            if handle is None:
                break
            record = self.store.get(handle)
            if record is None:  # evicted while we looked
                break
            payload = self._validate(key, record)
            if payload is None:
                self._drop_corrupt(key, handle)
                break
            found.append((key, payload))
        return found

    def _validate(self, key: bytes, record: torch.Tensor) -> torch.Tensor | None:
        """The record's payload if it is whole and this key's, in this layout; None otherwise."""
        raw = memoryview(record.numpy())
        if len(raw) < _HEAD.size:
            return None
        magic, head_len = _HEAD.unpack(raw[: _HEAD.size])
        start = _HEAD.size + head_len
        if magic != MAGIC or start > len(raw):
            return None
        try:
            head = json.loads(bytes(raw[_HEAD.size : start]))
        except ValueError:
            return None
        payload = record[start:]
        if (not isinstance(head, dict) or head.get("key") != key.hex() or head.get("layout") != self.layout
                or head.get("length") != self.block_nbytes or payload.numel() != self.block_nbytes):
            return None
        if hashlib.sha256(raw[start:]).hexdigest() != head.get("sha256"):
            return None
        return payload

    def _drop_corrupt(self, key: bytes, handle: object) -> None:
        with self._lock:
            if self._index.get(key) is handle:
                del self._index[key]
                self._emit(CacheEventKind.REMOVED, key)
            self.store.delete(handle)
        self.stats.dropped_corrupt += 1
        log.warning("KV tier: dropped a corrupt record (key %s)", key.hex()[:16])

    def load(self, block: int, payload: torch.Tensor) -> None:
        """A validated payload into a device block (every pool)."""
        for pool, s in zip(self.pools, self.slices):
            pool[:, block].copy_(self._view(payload, s))
        self.stats.read_blocks += 1
        self.stats.read_bytes += payload.numel()

    # -- events, clearing, shutdown -----------------------------------------------------------------
    def _emit(self, kind: CacheEventKind, key: bytes = b"") -> None:
        """Tell the allocator's listeners (tier lock held, so they see the tier's changes in order)."""
        event = CacheEvent(kind, Tier.HOST, key)
        for listener in list(self.allocator.listeners):
            if listener != self._on_device_event:
                listener(event)

    def _on_device_event(self, event: CacheEvent) -> None:
        """The device cache was reset: forget the tier too (its records may no longer be what the model
        computes). Called under the allocator's lock: only the index changes here; files go on close."""
        if event.tier is Tier.DEVICE and event.kind is CacheEventKind.CLEARED:
            self.clear()

    def clear(self) -> None:
        with self._lock:
            self._epoch += 1
            handles = list(self._index.values())
            self._index.clear()
            self._emit(CacheEventKind.CLEARED)
        if not self.store.shared:
            for handle in handles:
                self.store.delete(handle)

    def close(self) -> None:
        """Stop the writer and remove the store (files included)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)
        with self._lock:
            self._index.clear()
        self.store.close()


def _write_loop(offers: queue.Queue, tier_ref: weakref.ref[KVTier]) -> None:
    """The writer thread: offers in order until None (close, or the tier collected)."""
    while (item := offers.get()) is not None:
        if isinstance(item, _Flush):
            item.done.set()
            continue
        tier = tier_ref()
        if tier is None:
            return
        try:
            tier._write(item)
        except Exception:  # a full disk, an I/O error: that block is not spilled; the tier goes on
            log.exception("KV tier: writing a block failed")
        del tier
