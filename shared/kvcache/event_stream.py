"""The KvEvents stream of a prefill or decode front: its instance's CacheEventLog as batches, resumable.

A subscriber names the epoch and the last sequence number it saw. The same epoch and a sequence number
the log still keeps: the events after it, then live batches. Anything else (no epoch, another epoch, a
sequence number too old): a snapshot first (its first batch marked `snapshot`), then live batches. A
resumed subscription with nothing new yet gets one empty batch at once (it is live). A subscriber too slow
for the log's history gets a snapshot again rather than a gap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from shared.kvcache.event_log import CacheEventLog, KvEvent, KvSnapshot
from shared.kvcache.events import CacheEventKind, Tier
from shared.rpc.pdserve.v1 import internal_pb2

BATCH_EVENTS = 4096  # events per batch (~170 KiB): a snapshot of a large pool travels in many batches
KINDS = {CacheEventKind.STORED: internal_pb2.KvBlockEvent.STORED,
         CacheEventKind.REMOVED: internal_pb2.KvBlockEvent.REMOVED,
         CacheEventKind.CLEARED: internal_pb2.KvBlockEvent.CLEARED}
TIERS = {Tier.DEVICE: internal_pb2.KvBlockEvent.DEVICE, Tier.HOST: internal_pb2.KvBlockEvent.HOST}
MAX_U63 = (1 << 63) - 1


def request_problem(request: internal_pb2.KvEventsRequest, log: CacheEventLog) -> str | None:
    """What is wrong with a subscription (None: nothing): a sequence number without an epoch, or
    ahead of this log under its own epoch."""
    if request.epoch > MAX_U63:
        return f"epoch: {request.epoch} is not one an instance issues"
    if request.epoch == 0 and request.last_seq:
        return "last_seq: given without an epoch"
    if request.epoch == log.epoch and request.last_seq > log.seq:
        return f"last_seq: {request.last_seq} is ahead of the log (at {log.seq})"
    return None


def _batches(epoch: int, block_size: int, events: list[KvEvent]) -> list[internal_pb2.KvEventBatch]:
    out = []
    for i in range(0, len(events), BATCH_EVENTS):
        chunk = events[i:i + BATCH_EVENTS]
        out.append(internal_pb2.KvEventBatch(
            epoch=epoch, last_seq=chunk[-1].seq, block_size=block_size,
            events=[internal_pb2.KvBlockEvent(kind=KINDS[e.kind], tier=TIERS[e.tier], rank=e.rank,
                                              block_hash=e.block_hash) for e in chunk]))
    return out


def snapshot_batches(snap: KvSnapshot, block_size: int) -> list[internal_pb2.KvEventBatch]:
    """A snapshot as STORED batches, the first marked `snapshot` (one empty batch when nothing is held)."""
    events = [KvEvent(snap.seq, rank, CacheEventKind.STORED, tier, h)
              for (rank, tier), hashes in sorted(snap.blocks.items(), key=lambda kv: (kv[0][0], kv[0][1].value))
              for h in hashes]
    out = _batches(snap.epoch, block_size, events) or [
        internal_pb2.KvEventBatch(epoch=snap.epoch, last_seq=snap.seq, block_size=block_size)]
    out[0].snapshot = True
    return out


async def serve_kv_events(log: CacheEventLog, block_size: int, request: internal_pb2.KvEventsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[internal_pb2.KvEventBatch]:
    """The KvEvents handler's body (validated here: INVALID_ARGUMENT naming the field)."""
    problem = request_problem(request, log)
    if problem:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def waker() -> None:
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    log.wakers.append(waker)
    try:
        cursor = request.last_seq if request.epoch == log.epoch else -1
        acked = False
        while True:
            wake.clear()
            new = log.since(cursor) if cursor >= 0 else None
            if new is None:  # a first subscription, a restart, or fell out of history
                snap = log.snapshot()
                for batch in snapshot_batches(snap, block_size):
                    yield batch
                cursor, acked = snap.seq, True
                continue
            if new:
                for batch in _batches(log.epoch, block_size, new):
                    yield batch
                cursor, acked = new[-1].seq, True
                continue
            if not acked:  # resumed with nothing new: an empty batch says the subscription is live
                yield internal_pb2.KvEventBatch(epoch=log.epoch, last_seq=cursor, block_size=block_size)
                acked = True
            await wake.wait()
    finally:
        log.wakers.remove(waker)
