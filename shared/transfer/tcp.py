"""Built-in TCP transport (the embedded default).

Framed writes go straight from the source pool's block memory (scatter-gather `sendmsg`) into the
destination pool's block memory (`recv_into`): no pickling, no staging copies for host pools (an
accelerator's pool goes through one host copy on each side: `PoolBytes`). Each frame names a
lease and carries its token; a frame for an unknown or expired lease, or with a bad token, is
refused and the connection closed. A COMMIT frame ends a push and is acknowledged once every
layer of every cache kind has arrived.

Frame header (network order): magic "PDKV", version, type (1 WRITE, 2 COMMIT, 3 MARK, 4 TOUCH, 5 SYNC), lease id
(32 ascii), token (16), layer (u16), kind (u8: 0 mla, 1 index), first block (u32), block count (u32),
payload bytes (u64). A WRITE payload is `count` ≥ 1 whole blocks of that layer and kind; the write
holds its lease until the last byte landed (a lease released meanwhile frees its blocks only then);
a write that gets no byte for the receiver's `stall_seconds`, or whose peer goes mid-frame, abandons its
lease (its blocks freed at once: the push cannot complete), and a write whose lease is released or
expires meanwhile is dropped within WRITE_POLL_SECONDS, so no lease outlives its writer.
TOUCH (no payload) keeps a lease alive while its prompt waits in the prefill queue or computes (an
idle push sends one every KVPush.keepalive_seconds). MARK (no payload) reports blocks written
one-sidedly by Mooncake and is accepted only by a receiver that serves as Mooncake's control
channel. SYNC (no payload) is answered once every earlier frame of the connection has landed: a CP
rank that does not commit waits for it before telling the committing rank it is done. A commit
holds only when every block of every layer and kind was written. Connections idle between frames
past IDLE_TIMEOUT are closed; at most MAX_CONNECTIONS at a time.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (a str host's first connect imports it: ~2 ms of the first KV push)
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from shared.config import DecodeConfig, PrefillConfig, knob_default
from shared.device import on_host
from shared.kvcache import KVCache
from shared.kvcache.lease import Lease, LeaseError, LeaseTable
from shared.rpc.certs import TLS_SERVER_NAME
from shared.transfer.base import Destination, KVPush, KVReceiver, KVSender, TransferError, block_bytes, pool_of

log = logging.getLogger("pdserve.transfer")
MAGIC, VERSION = b"PDKV", 1
WRITE, COMMIT, MARK, TOUCH, SYNC = 1, 2, 3, 4, 5
KINDS = ("mla", "index")
HEADER = struct.Struct("!4sBB32s16sHBIIQ")
OK, REFUSED = 0, 1
CONNECT_TIMEOUT = 5.0
IDLE_TIMEOUT = 10.0  # a peer silent this long between frames is disconnected; pushes touch every 2 s
MAX_CONNECTIONS = 256
STALL_SECONDS = knob_default(PrefillConfig, "kv_stall_seconds")  # a push without progress this long fails
RECEIVE_STALL_SECONDS = knob_default(DecodeConfig, "kv_stall_seconds")  # a write without a byte this long is dropped
WRITE_POLL_SECONDS = 0.2  # a write in progress looks at its lease (released? stalled?) at least this often


class WriteStalled(ConnectionError):
    """A write's payload stopped arriving, or its lease was released or expired under it."""


class Arrival:
    """A write's payload as it arrives: each wait for bytes is short (WRITE_POLL_SECONDS), so a write
    whose lease died lets go at once and one that gets no byte for `stall_seconds` is given up."""

    def __init__(self, conn: socket.socket, lease: Lease, stall_seconds: float):
        self.conn, self.lease, self.stall = conn, lease, stall_seconds
        self.last = time.monotonic()

    def recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.conn.recv_into(view[got:])
            except TimeoutError:  # socket.timeout; TLS reads raise it too
                if self.lease.dead:
                    raise WriteStalled("its lease was released or expired during the write") from None
                if time.monotonic() - self.last > self.stall:
                    raise WriteStalled(f"no byte for {self.stall:g} s in the middle of a write") from None
                continue
            if n == 0:
                raise ConnectionError("peer closed mid-frame")
            got += n
            self.last = time.monotonic()


class PoolBytes:
    """One cache kind's pool as wire bytes. A host pool is sent from and received into in place
    (scatter-gather views of its blocks, no copy); an accelerator's pool (GPU, NPU) goes through host
    memory: a sender gathers the blocks into one host copy, a receiver lands the payload in a host
    buffer and copies it into the blocks (on the copying thread's stream, ordered with compute)."""

    def __init__(self, kv: KVCache, kind: str):
        self.pool = pool_of(kv, kind)
        self.rows = self.pool.view(torch.uint8).numpy().reshape(*self.pool.shape[:2], -1) if on_host(self.pool) \
            else None
        self.block_bytes = block_bytes(kv.layout, kind)

    def views(self, layer: int, blocks: list[int]) -> list[memoryview]:
        """The blocks' bytes, to send."""
        if self.rows is not None:
            return block_runs(self.rows, layer, blocks)
        staged = self.pool[layer, torch.tensor(blocks, device=self.pool.device)].cpu()
        return [memoryview(staged.view(torch.uint8).numpy().reshape(-1))]

    def receive(self, recv_into: Callable[[memoryview], None], layer: int, blocks: list[int]) -> None:
        """Fill the blocks with the next len(blocks) · block_bytes bytes that `recv_into` reads."""
        if self.rows is not None:
            for view in block_runs(self.rows, layer, blocks):
                recv_into(view)
            return
        buf = torch.empty(len(blocks) * self.block_bytes, dtype=torch.uint8)
        recv_into(memoryview(buf.numpy()))
        rows = buf.view(self.pool.dtype).view(len(blocks), *self.pool.shape[2:])
        self.pool[layer, torch.tensor(blocks, device=self.pool.device)] = rows.to(self.pool.device)


def pool_bytes(kv: KVCache) -> dict[str, PoolBytes]:
    return {kind: PoolBytes(kv, kind) for kind in KINDS if pool_of_or_none(kv, kind) is not None}


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def block_runs(rows: np.ndarray, layer: int, blocks: list[int]) -> list[memoryview]:
    """Memory views of `blocks` of one layer, consecutive block ids merged into one view (fewer
    syscalls and Python iterations; leases and block tables are mostly consecutive)."""
    views, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            b0, n = blocks[start], i - start
            views.append(memoryview(rows[layer, b0 : b0 + n].reshape(-1)))
            start = i
    return views


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed mid-frame")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def send_views(sock: socket.socket, views: list[memoryview]) -> int:
    """sendmsg until every byte of every view is out (sendmsg may stop part-way)."""
    total = sum(len(v) for v in views)
    if isinstance(sock, ssl.SSLSocket):  # TLS has no scatter-gather send
        for view in views:
            sock.sendall(view)
        return total
    pending = [v.cast("B") for v in views]
    while pending:
        sent = sock.sendmsg(pending[:512])
        while sent:
            if sent >= len(pending[0]):
                sent -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0
    return total


class TcpReceiver(KVReceiver):
    """Listens for pushes into a KVCache's leased blocks."""

    transport = "tcp"

    def __init__(self, kv: KVCache, leases: LeaseTable, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, tls: ssl.SSLContext | None = None,
                 stall_seconds: float = RECEIVE_STALL_SECONDS):
        self.kv, self.leases, self.tls, self.stall_seconds = kv, leases, tls, stall_seconds
        self.abandoned = 0  # leases given up because their writer stalled or went mid-write (logged, counted)
        self._pools = pool_bytes(kv)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"{advertise_host or host}:{self.port}"
        self._closed = False
        self.bytes_received = 0  # payload bytes written into leased blocks (a metric)
        self.accept_marks = False  # True when this receiver is Mooncake's control channel
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()

    def destination(self, lease) -> Destination:
        return Destination("tcp", self.endpoint, lease.lease_id, lease.token, list(lease.blocks),
                           self.kv.layout.describe(), reused_blocks=lease.reused)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._connections.acquire(blocking=False):  # refused off the accept thread: it never blocks
                threading.Thread(target=self._refuse_and_close, args=(conn,), daemon=True).start()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IDLE_TIMEOUT)
        with conn:
            try:
                if self.tls is not None:  # the handshake refuses peers without the cluster CA's certificate
                    conn = self.tls.wrap_socket(conn, server_side=True)
                while error := self._frame(conn):
                    if error is not True:
                        return self._refuse(conn, error)
            except (ConnectionError, OSError):  # ssl.SSLError is an OSError
                return
            finally:
                self._connections.release()
                conn.close()

    def _frame(self, conn: socket.socket) -> str | bool:
        """Serve one frame: True to go on, an error message to refuse and close, False at end of stream."""
        try:
            raw = _recv_exact(conn, HEADER.size)
        except ConnectionError:
            return False
        magic, version, ftype, lease_raw, token, layer, kind_id, first, count, nbytes = HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION:
            return "bad frame magic/version"
        try:
            lease_id = lease_raw.decode("ascii")
        except UnicodeDecodeError:
            return "lease id is not ASCII"
        kind = KINDS[kind_id] if kind_id < len(KINDS) else f"#{kind_id}"
        try:
            if ftype == COMMIT:
                lease = self.leases.check(lease_id, token)
                done = self.leases.commit(lease)
                self._reply(conn, OK if done else REFUSED,
                            "" if done else f"commit with {lease.missing} layer caches not fully written")
                return True
            if ftype == TOUCH:
                self.leases.touch(self.leases.check(lease_id, token))
                return True
            if ftype == SYNC:  # frames of a connection are applied in order: all earlier writes landed
                self.leases.check(lease_id, token)
                self._reply(conn, OK, "")
                return True
            if ftype == MARK and self.accept_marks and nbytes == 0:
                lease = self.leases.begin_write(lease_id, token, layer, kind, first, count)
                self.leases.end_write(lease, layer, kind, first, count, ok=True)
                return True
            if ftype != WRITE:
                return f"frame type {ftype} not accepted here"
            lease = self.leases.begin_write(lease_id, token, layer, kind, first, count)
        except LeaseError as exc:
            return str(exc)
        ok = False
        try:
            pool = self._pools.get(kind)
            if pool is None or nbytes != count * pool.block_bytes:
                return f"write of {count} blocks carries {nbytes} bytes"
            self._receive(conn, pool, lease, layer, first, count)
            self.bytes_received += nbytes
            ok = True
            return True
        except WriteStalled as exc:
            return f"KV write given up: {exc}; its reservation is released"
        finally:
            self.leases.end_write(lease, layer, kind, first, count, ok)

    def _receive(self, conn: socket.socket, pool: PoolBytes, lease: Lease, layer: int, first: int, count: int) -> None:
        """A write's payload into its lease's blocks. A writer that stalls or goes mid-write abandons the
        lease: the push cannot complete, so its blocks are freed as this write ends, not at its expiry."""
        conn.settimeout(min(WRITE_POLL_SECONDS, self.stall_seconds))
        try:
            pool.receive(Arrival(conn, lease, self.stall_seconds).recv_into, layer, lease.blocks[first : first + count])
        except (ConnectionError, OSError) as exc:  # WriteStalled included
            if self.leases.abandon(lease.lease_id):
                self.abandoned += 1
                log.warning("KV write into lease %s (request %s) given up: %s; its %d blocks are freed",
                            lease.lease_id, lease.request_id, exc or type(exc).__name__, len(lease.blocks))
            raise
        finally:
            conn.settimeout(IDLE_TIMEOUT)

    @staticmethod
    def _reply(conn: socket.socket, status: int, message: str) -> None:
        data = message.encode()[:65535]
        conn.sendall(struct.pack("!BH", status, len(data)) + data)

    def _refuse_and_close(self, conn: socket.socket) -> None:
        with conn:
            self._refuse(conn, f"too many KV connections (at most {MAX_CONNECTIONS})")

    def _refuse(self, conn: socket.socket, message: str) -> None:
        """Reply, then drain what the peer already sent: closing with unread bytes would reset the
        connection and lose the reply."""
        try:
            self._reply(conn, REFUSED, message)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(2)
            while conn.recv(1 << 16):
                pass
        except OSError:
            pass


def pool_of_or_none(kv: KVCache, kind: str) -> torch.Tensor | None:
    return kv.mla if kind == "mla" else kv.index


def read_reply(sock: socket.socket) -> tuple[int, str]:
    status, length = struct.unpack("!BH", _recv_exact(sock, 3))
    return status, _recv_exact(sock, length).decode(errors="replace")


def connect(endpoint: str, tls: ssl.SSLContext | None, timeout: float) -> socket.socket:
    """A connection to a KV receiver (TLS when the cluster has certificates); `timeout` bounds every
    later send and receive without progress."""
    host, port = split_endpoint(endpoint)
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=TLS_SERVER_NAME)  # the name every node certificate has
        except BaseException:
            sock.close()
            raise
    sock.settimeout(timeout)
    return sock


class TcpPush(KVPush):
    def __init__(self, kv: KVCache, dest: Destination, pools: dict[str, PoolBytes],
                 tls: ssl.SSLContext | None = None, stall_seconds: float = STALL_SECONDS,
                 slot: threading.Semaphore | None = None):
        self._pools, self._tls, self._stall = pools, tls, stall_seconds
        self._slot, self._holds_slot = slot, False
        self._sock: socket.socket | None = None
        self._lease = dest.lease_id.encode("ascii")
        super().__init__(kv, dest)

    def _connect(self) -> None:
        """Take one of the sender's connection slots for this receiver (touching the lease while
        waiting, so a long queue does not expire it), then connect."""
        if self._slot is not None:
            while not self._slot.acquire(timeout=self.keepalive_seconds):
                if self._aborted:
                    raise TransferError("push aborted")
                touch_over_tcp(self.dest.endpoint, self.dest.lease_id, self.dest.token, self._tls, self._stall)
            if self._aborted:
                self._slot.release()
                raise TransferError("push aborted")
            self._holds_slot = True
        try:
            self._sock = connect(self.dest.endpoint, self._tls, self._stall)
        except OSError as exc:
            raise TransferError(f"KV receiver {self.dest.endpoint} unreachable: {exc}") from exc

    def _header(self, ftype: int, layer: int = 0, kind: int = 0, first: int = 0, count: int = 0,
                nbytes: int = 0) -> bytes:
        return HEADER.pack(MAGIC, VERSION, ftype, self._lease, self.dest.token, layer, kind, first, count, nbytes)

    def _write(self, layer: int, kind: str, src_blocks: list[int], first: int) -> None:
        views = self._pools[kind].views(layer, src_blocks)
        header = self._header(WRITE, layer, KINDS.index(kind), first, len(src_blocks), sum(len(v) for v in views))
        try:
            self.bytes_sent += send_views(self._sock, [memoryview(header), *views]) - len(header)  # KV bytes
        except OSError as exc:
            raise TransferError(f"KV write to {self.dest.endpoint} failed: {self._refusal() or exc}") from exc

    def _finish_writes(self) -> None:
        """Another rank commits for this push (CP): make sure every write landed before saying done."""
        if self._commit_at_end:
            return  # the commit's own reply is the barrier
        try:
            self._sock.sendall(self._header(SYNC))
            status, message = read_reply(self._sock)
        except (OSError, ConnectionError) as exc:
            raise TransferError(f"KV sync with {self.dest.endpoint} failed: {exc}") from exc
        if status != OK:
            raise TransferError(f"KV receiver refused the push: {message}")

    def _keepalive(self) -> None:
        try:
            self._sock.sendall(self._header(TOUCH))
        except OSError as exc:
            raise TransferError(f"KV receiver {self.dest.endpoint} went away: {self._refusal() or exc}") from exc

    def _refusal(self) -> str | None:
        try:
            self._sock.settimeout(1)
            status, message = read_reply(self._sock)
            return message if status != OK else None
        except (OSError, ConnectionError, struct.error):
            return None

    def _commit(self) -> None:
        try:
            self._sock.sendall(self._header(COMMIT))
            status, message = read_reply(self._sock)
        except (OSError, ConnectionError) as exc:
            raise TransferError(f"KV commit to {self.dest.endpoint} failed: {exc}") from exc
        finally:
            self._close()
        if status != OK:
            raise TransferError(f"KV receiver refused the push: {message}")

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._holds_slot:
            self._holds_slot = False
            self._slot.release()


class TcpSender(KVSender):
    """Opens pushes; at most `connections_per_receiver` of them hold a connection to one receiver at
    a time (the rest queue, keeping their leases alive), so a burst of prompts never floods a decode
    instance's KV port."""

    def __init__(self, kv: KVCache, tls: ssl.SSLContext | None = None, stall_seconds: float = STALL_SECONDS,
                 connections_per_receiver: int = 32):
        self.kv, self.tls, self.stall_seconds = kv, tls, stall_seconds
        self._pools = pool_bytes(kv)
        self._per_receiver = connections_per_receiver
        self._slots: dict[str, threading.Semaphore] = {}
        self._lock = threading.Lock()

    def open(self, dest: Destination) -> KVPush:
        with self._lock:
            slot = self._slots.setdefault(dest.endpoint, threading.Semaphore(self._per_receiver))
        return TcpPush(self.kv, dest, self._pools, self.tls, self.stall_seconds, slot)


def mark_over_tcp(endpoint: str, lease_id: str, token: bytes, marks: list[tuple[int, str, int, int]],
                  commit: bool, tls: ssl.SSLContext | None = None, stall_seconds: float = STALL_SECONDS) -> None:
    """Mooncake's control path: report the blocks written one-sidedly (MARK frames: layer, kind,
    first, count), then commit when asked. A refused mark closes the connection with a reply."""
    with connect(endpoint, tls, stall_seconds) as sock:
        lease = lease_id.encode("ascii")
        for layer, kind, first, count in marks:
            sock.sendall(HEADER.pack(MAGIC, VERSION, MARK, lease, token, layer, KINDS.index(kind), first, count, 0))
        if not commit:
            sock.shutdown(socket.SHUT_WR)  # accepted marks get no reply: EOF; a refusal replies first
            try:
                _, message = read_reply(sock)
            except ConnectionError:
                return
            raise TransferError(f"KV receiver refused the marks: {message}")
        sock.sendall(HEADER.pack(MAGIC, VERSION, COMMIT, lease, token, 0, 0, 0, 0, 0))
        status, message = read_reply(sock)
    if status != OK:
        raise TransferError(f"KV receiver refused the commit: {message}")


def touch_over_tcp(endpoint: str, lease_id: str, token: bytes, tls: ssl.SSLContext | None = None,
                   stall_seconds: float = STALL_SECONDS) -> None:
    """Keep a lease alive from a transport without a connection of its own (Mooncake's keepalive)."""
    try:
        with connect(endpoint, tls, stall_seconds) as sock:
            sock.sendall(HEADER.pack(MAGIC, VERSION, TOUCH, lease_id.encode("ascii"), token, 0, 0, 0, 0, 0))
    except OSError as exc:
        raise TransferError(f"KV receiver {endpoint} went away: {exc}") from exc
