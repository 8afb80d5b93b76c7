"""A rank's (or an instance's) prefix-cache event log: what routers subscribe to, exactly.

A `CacheEventLog` is an allocator listener (shared.kvcache.events): each CacheEvent is appended under
the allocator's lock with the next sequence number, and the set of hashes stored per (rank, tier) is
kept current, so a snapshot is a copy, not a replay. History is bounded (`history` events): a
subscriber whose last sequence number fell out of it gets a snapshot instead. `epoch` is random per
log (a process start), so a subscriber that names another epoch knows the instance restarted.

Two uses: on each engine rank, attached to its allocator (the engine core drains what is new each
turn, `drain`, and carries it to the front as a KvEventsNotice); on the gRPC front, the instance's log
every rank's events are recorded into (`apply`), which the KvEvents stream serves."""

from __future__ import annotations

import secrets
import struct
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared import metrics
from shared.kvcache.events import CacheEvent, CacheEventKind, Tier
from shared.kvcache.pool import KVCache

DEFAULT_HISTORY = 1 << 16  # events kept for resuming subscribers (~5 MB of 32-byte keys and their records)
ROW_EVENTS = 64  # cache events a decode rank's fixed per-turn row carries (more: its object part)
ROW_WIDTH = 1 + 5 * ROW_EVENTS  # a count, then per event its code and its 32-byte key as 4 integers
_KINDS, _TIERS = tuple(CacheEventKind), tuple(Tier)


@dataclass(frozen=True)
class KvEvent:
    """A CacheEvent as the instance's log numbers it: its sequence number and the rank whose pool it is."""

    seq: int
    rank: int
    kind: CacheEventKind
    tier: Tier
    block_hash: bytes = b""


@dataclass(frozen=True)
class RankKvEvents:
    """One rank's new cache events, in order (what a turn carries to rank 0 and the front)."""

    rank: int
    events: list[CacheEvent]


@dataclass(frozen=True)
class KvEventsNotice:
    """Core process → front, per turn with any: every rank's new cache events."""

    ranks: list[RankKvEvents]


@dataclass(frozen=True)
class KvSnapshot:
    """Everything a log holds as of `seq`: (rank, tier) → stored hashes, oldest first."""

    epoch: int
    seq: int
    blocks: dict[tuple[int, Tier], list[bytes]] = field(default_factory=dict)


class CacheEventLog:
    """Sequence-numbered cache events with bounded history and the current stored set per (rank, tier).
    Thread-safe: engine threads record, gRPC handlers read. `published`: this is the instance's log the
    KvEvents stream serves (its events count in pdserve_kv_events_total)."""

    def __init__(self, rank: int = 0, history: int = DEFAULT_HISTORY, published: bool = False):
        self.rank = rank
        self.epoch = secrets.randbits(63) | 1  # never 0: a request's 0 means "none seen"
        self.published = published
        self._seq = 0
        self._history: deque[KvEvent] = deque(maxlen=max(1, history))
        self._held: dict[tuple[int, Tier], dict[bytes, None]] = {}
        self._drained = 0  # `drain`'s cursor
        self._lock = threading.Lock()
        self.wakers: list[Callable[[], None]] = []  # told after events are recorded (the streams' wake-ups)

    # -- recording ---------------------------------------------------------------------------------------
    def __call__(self, event: CacheEvent) -> None:
        """The allocator's listener (its lock held): an append and a set update."""
        with self._lock:
            self._record(self.rank, event)

    def apply(self, notice: KvEventsNotice) -> None:
        """Record every rank's events of a turn (the front's log), then wake the streams."""
        with self._lock:
            for per_rank in notice.ranks:
                for event in per_rank.events:
                    self._record(per_rank.rank, event)
        for wake in list(self.wakers):
            wake()

    def _record(self, rank: int, event: CacheEvent) -> None:
        held = self._held.setdefault((rank, event.tier), {})
        if event.kind is CacheEventKind.STORED:
            held[event.block_hash] = None
        elif event.kind is CacheEventKind.REMOVED:
            held.pop(event.block_hash, None)
        else:
            held.clear()
        self._seq += 1
        self._history.append(KvEvent(self._seq, rank, event.kind, event.tier, event.block_hash))
        if self.published:
            metrics.KV_EVENTS.labels(event.kind.value, event.tier.value).inc()

    def seed(self, hashes: list[bytes], tier: Tier = Tier.DEVICE) -> None:
        """What the pool caches already when the log is attached (recorded as STORED)."""
        with self._lock:
            for h in hashes:
                self._record(self.rank, CacheEvent(CacheEventKind.STORED, tier, h))

    # -- reading -----------------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        return self._seq

    def since(self, seq: int) -> list[KvEvent] | None:
        """Events after `seq`, in order; None when some of them are no longer kept (take a snapshot)."""
        with self._lock:
            if seq > self._seq or seq < 0:
                return None
            if seq == self._seq:
                return []
            oldest = self._history[0].seq if self._history else self._seq + 1
            if seq + 1 < oldest:
                return None
            return list(self._history)[seq + 1 - oldest:]

    def snapshot(self) -> KvSnapshot:
        with self._lock:
            return KvSnapshot(self.epoch, self._seq, {k: list(v) for k, v in self._held.items() if v})

    def drain(self) -> RankKvEvents | None:
        """A rank's events since the last drain (None: none). A drain that fell out of history (more
        events in a turn than it keeps) becomes CLEARED for each tier, then STORED for what is held: the
        same state, so no subscriber ever misses an event."""
        new = self.since(self._drained)
        if new is None:
            snap = self.snapshot()
            events = [CacheEvent(CacheEventKind.CLEARED, tier) for tier in Tier]
            events += [CacheEvent(CacheEventKind.STORED, tier, h) for (_, tier), hs in snap.blocks.items() for h in hs]
            self._drained = snap.seq
            return RankKvEvents(self.rank, events)
        if not new:
            return None
        self._drained = new[-1].seq
        return RankKvEvents(self.rank, [CacheEvent(e.kind, e.tier, e.block_hash) for e in new])

    def held(self, rank: int, tier: Tier) -> int:
        """How many blocks (rank, tier) holds."""
        with self._lock:
            return len(self._held.get((rank, tier), ()))

    def leading_blocks(self, hashes: list[bytes], ranks: int, tiers: tuple[Tier, ...] = (Tier.DEVICE,)) -> list[int]:
        """Per rank 0..ranks-1, how many leading `hashes` it holds in any of `tiers`."""
        out = []
        with self._lock:
            for rank in range(ranks):
                sets = [self._held.get((rank, t), {}) for t in tiers]
                n = 0
                for h in hashes:
                    if not any(h in s for s in sets):
                        break
                    n += 1
                out.append(n)
        return out


def listen_to(kv: KVCache, rank: int = 0) -> CacheEventLog:
    """A rank's log on its cache: seeded with what its pool (and its second tier) holds already, then told
    every change by the allocator's listeners (the second tier emits through them too)."""
    log = CacheEventLog(rank)
    log.seed(kv.allocator.cached_hashes())
    if kv.tier is not None:
        log.seed(kv.tier.keys(), Tier.HOST)
    kv.allocator.listeners.append(log)
    return log


def events_to_row(events: list[CacheEvent]) -> list[int] | None:
    """A turn's cache events as ROW_WIDTH integers (a decode rank's fixed report row), or None when they do
    not fit (more than ROW_EVENTS, or a key that is not a 32-byte SHA-256): they travel as objects then."""
    if len(events) > ROW_EVENTS or any(len(e.block_hash) not in (0, 32) for e in events):
        return None
    out = [len(events)]
    for e in events:
        out.append(_KINDS.index(e.kind) * len(_TIERS) + _TIERS.index(e.tier) + (len(_KINDS) * len(_TIERS)
                                                                            if e.block_hash else 0))
        out += struct.unpack("<4q", e.block_hash or bytes(32))
    return out + [0] * (ROW_WIDTH - len(out))


def events_from_row(values: list[int]) -> list[CacheEvent]:
    """`events_to_row` read back."""
    out, plain = [], len(_KINDS) * len(_TIERS)
    for i in range(values[0]):
        code, *key = values[1 + 5 * i: 6 + 5 * i]
        kind, tier = divmod(code % plain, len(_TIERS))
        out.append(CacheEvent(_KINDS[kind], _TIERS[tier], struct.pack("<4q", *key) if code >= plain else b""))
    return out
