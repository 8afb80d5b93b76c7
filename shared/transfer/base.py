"""KV transfer interface: a prefill instance pushes one request's per-layer MLA and indexer blocks
into blocks a decode instance reserved under a lease.

Both backends move the same thing — for each layer and each cache kind ("mla", "index"), whole
blocks of the pool described by KVLayout, source block i of the request → destination block i of
the lease — and end with a commit, after which the decode side knows every layer arrived.
"""

from __future__ import annotations

import json
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.kvcache import KVCache, KVLayout


class TransferError(RuntimeError):
    """A push failed (peer gone, lease refused, layout mismatch)."""


@dataclass
class Destination:
    """Where to push one request's KV (mirrors pdserve.v1.KVDestination)."""

    transport: str
    endpoint: str
    lease_id: str
    token: bytes
    block_ids: list[int]
    layout: dict
    mla_base: list[int] = field(default_factory=list)
    index_base: list[int] = field(default_factory=list)
    control_endpoint: str = ""
    signature: bytes = b""  # the decode instance's HMAC over the fields above (Credentials.sign)
    reused_blocks: int = 0  # the lease's leading blocks decode caches already: a push fills the ones after
    restored_blocks: int = 0  # of those, read back from decode's second KV tier (its metrics; not on the wire)
    follow_up: bool = False  # they hold an earlier prompt whole: a follow-up turn (decode's metrics; not on the wire)

    def to_proto(self, msg_cls):  # generated message class
        return msg_cls(transport=self.transport, endpoint=self.endpoint, lease_id=self.lease_id, token=self.token,
                       block_ids=self.block_ids, layout_json=json.dumps(self.layout), mla_base=self.mla_base,
                       index_base=self.index_base, control_endpoint=self.control_endpoint,
                       signature=self.signature, reused_blocks=self.reused_blocks)

    @classmethod
    def from_proto(cls, msg) -> Destination:
        return cls(msg.transport, msg.endpoint, msg.lease_id, bytes(msg.token), list(msg.block_ids),
                   json.loads(msg.layout_json or "{}"), list(msg.mla_base), list(msg.index_base),
                   msg.control_endpoint, bytes(msg.signature), msg.reused_blocks)


def cache_kinds(layout: KVLayout) -> tuple[str, ...]:
    return ("mla", "index") if layout.has_index else ("mla",)


def pool_of(kv: KVCache, kind: str) -> torch.Tensor:
    """[layers, blocks, block_size, dim] tensor of one cache kind."""
    pool = kv.mla if kind == "mla" else kv.index
    if pool is None:
        raise TransferError(f"this pool has no {kind!r} cache")
    return pool


def block_bytes(layout: KVLayout, kind: str) -> int:
    per_token = layout.mla_bytes_per_token if kind == "mla" else layout.index_bytes_per_token
    return per_token * layout.block_size


class KVPush(ABC):
    """One request's push session. `send_layer` only queues (it is called from the model's
    layer_done hook, so the wire work overlaps the next layer's compute); `finish_async` lets the
    push's own thread drain the queue, commit and report; `finish` waits for that; `abort` drops the
    session without waiting. Nothing here blocks the engine thread."""

    def __init__(self, kv: KVCache, dest: Destination):
        if dest.layout != kv.layout.describe():
            raise TransferError(f"KV layout mismatch: destination {dest.layout} != source {kv.layout.describe()}")
        self.kv, self.dest = kv, dest
        self.kinds = cache_kinds(kv.layout)
        self.bytes_sent = 0
        self._queue: queue.Queue = queue.Queue()
        self._aborted = False
        self._commit_at_end = False
        self._on_end: Callable[[BaseException | None], None] | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-push-{dest.lease_id[:8]}", daemon=True)
        self._thread.start()

    def send_layer(self, layer: int, src_blocks: list[int], first: int) -> None:
        """Queue layer `layer`'s blocks `src_blocks` → the lease's blocks [first, first + len)."""
        if first + len(src_blocks) > len(self.dest.block_ids):
            raise TransferError(f"push of {first + len(src_blocks)} blocks exceeds the lease's "
                                f"{len(self.dest.block_ids)}")
        self._queue.put((layer, list(src_blocks), first))

    def finish_async(self, on_end: Callable[[BaseException | None], None], commit: bool = True) -> None:
        """No more layers: the push thread writes what is queued, commits (unless another rank of a
        CP group commits for all: `commit=False`), then calls on_end(None or the error) itself."""
        self._on_end, self._commit_at_end = on_end, commit
        self._queue.put(None)

    def finish(self, timeout: float = 60.0, commit: bool = True) -> None:
        """finish_async, waiting for the outcome; raises TransferError on failure."""
        done, outcome = threading.Event(), []
        self.finish_async(lambda error: (outcome.append(error), done.set()), commit)
        if not done.wait(timeout):
            self.abort()
            raise TransferError("KV push did not finish in time")
        if outcome[0] is not None:
            raise TransferError(str(outcome[0])) from outcome[0]

    def commit(self) -> None:
        """Tell the receiver the push is complete (after finish(commit=False) on every CP rank)."""
        self._commit()

    def close(self) -> None:  # optional hook
        self._close()

    def abort(self) -> None:
        """Drop the session; the push thread lets go of its connection when it sees this."""
        self._aborted = True
        self._queue.put(None)

    def _run(self) -> None:
        error: BaseException | None = None
        ended = False
        try:
            self._connect()
            while True:
                try:
                    item = self._queue.get(timeout=self.keepalive_seconds)
                except queue.Empty:  # the prompt is still queued or computing: keep its lease alive
                    self._keepalive()
                    continue
                if item is None:
                    ended = True
                    break
                if self._aborted:
                    continue
                layer, src, first = item
                for kind in self.kinds:
                    self._write(layer, kind, src, first)
            if self._aborted:
                raise TransferError("push aborted")
            self._finish_writes()
            if self._commit_at_end:
                self._commit()
        except BaseException as exc:  # reported to on_end
            error = exc
            self._close()  # a failed push lets go of its connection at once
            while not ended and self._queue.get() is not None:  # the producer ends with None
                pass
        if self._on_end is not None:
            self._on_end(error)

    keepalive_seconds = 2.0  # an idle push touches its lease this often; a lease lives a TTL from the last touch

    def _keepalive(self) -> None:  # noqa: B027 - transports with a connection to keep warm override it
        """Tell the receiver this lease is still being worked on."""

    def _finish_writes(self) -> None:  # noqa: B027 - optional hook, a no-op for most transports
        """After the last write of this sender (before any commit): transports that report writes separately."""

    @abstractmethod
    def _connect(self) -> None: ...

    @abstractmethod
    def _write(self, layer: int, kind: str, src_blocks: list[int], first: int) -> None: ...

    @abstractmethod
    def _commit(self) -> None: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass


class KVReceiver(ABC):
    """Decode side of a transport: accepts writes into leased blocks and commits."""

    transport: str

    @abstractmethod
    def destination(self, lease) -> Destination:  # kvcache.lease.Lease
        """The descriptor a prefill instance needs to push into `lease`."""

    @abstractmethod
    def close(self) -> None: ...


class KVSender(ABC):
    """Prefill side of a transport: opens one push session per request."""

    @abstractmethod
    def open(self, dest: Destination) -> KVPush: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
