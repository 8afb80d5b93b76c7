"""Built-in TCP transport (the embedded default).

Framed writes go straight from the source pool's block memory (scatter-gather `sendmsg`) into the
destination pool's block memory (`recv_into`): no pickling, no staging copies. Each frame names a
lease and carries its token; a frame for an unknown or expired lease, or with a bad token, is
refused and the connection closed. A COMMIT frame ends a push and is acknowledged once every
layer of every cache kind has arrived.

Frame header (network order): magic "PDKV", version, type (1 WRITE, 2 COMMIT), lease id (32 ascii),
token (16), layer (u16), kind (u8: 0 mla, 1 index), first block (u32), block count (u32),
payload bytes (u64). A WRITE payload is `count` whole blocks of that layer and kind.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import torch

from shared.kvcache import KVCache
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.transfer.base import Destination, KVPush, KVReceiver, KVSender, TransferError, block_bytes, pool_of

MAGIC, VERSION = b"PDKV", 1
WRITE, COMMIT = 1, 2
KINDS = ("mla", "index")
HEADER = struct.Struct("!4sBB32s16sHBIIQ")
OK, REFUSED = 0, 1
CONNECT_TIMEOUT = 5.0


def byte_rows(kv: KVCache, kind: str) -> np.ndarray:
    """The pool of one kind as writable bytes [layers, blocks, block_bytes], sharing memory."""
    pool = pool_of(kv, kind)
    return pool.view(torch.uint8).numpy().reshape(pool.shape[0], pool.shape[1], -1)


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
                 advertise_host: str | None = None):
        self.kv, self.leases = kv, leases
        self._rows = {kind: byte_rows(kv, kind) for kind in KINDS if pool_of_or_none(kv, kind) is not None}
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"{advertise_host or host}:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()

    def destination(self, lease) -> Destination:  # noqa: ANN001
        return Destination("tcp", self.endpoint, lease.lease_id, lease.token, list(lease.blocks),
                           self.kv.layout.describe())

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
            threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    try:
                        raw = _recv_exact(conn, HEADER.size)
                    except ConnectionError:
                        return
                    magic, version, ftype, lease_id, token, layer, kind_id, first, count, nbytes = HEADER.unpack(raw)
                    if magic != MAGIC or version != VERSION:
                        return self._refuse(conn, "bad frame magic/version")
                    try:
                        lease = self.leases.check(lease_id.decode("ascii"), token)
                    except LeaseError as exc:
                        return self._refuse(conn, str(exc))
                    if ftype == WRITE:
                        error = self._receive_blocks(conn, lease, layer, kind_id, first, count, nbytes)
                        if error:
                            return self._refuse(conn, error)
                    elif ftype == COMMIT:
                        done = self.leases.commit(lease)
                        self._reply(conn, OK if done else REFUSED,
                                    "" if done else f"commit with {len(lease.received)} layer caches received")
                    else:
                        return self._refuse(conn, f"unknown frame type {ftype}")
            except (ConnectionError, OSError):
                return

    def _receive_blocks(self, conn: socket.socket, lease, layer: int, kind_id: int, first: int,  # noqa: ANN001
                        count: int, nbytes: int) -> str | None:
        kind = KINDS[kind_id] if kind_id < len(KINDS) else "?"
        rows = self._rows.get(kind)
        per_block = block_bytes(self.kv.layout, kind) if rows is not None else 0
        if rows is None or layer >= self.kv.layout.num_layers:
            return f"no cache for layer {layer} kind {kind}"
        if first + count > len(lease.blocks) or nbytes != count * per_block:
            return f"write of blocks [{first}, {first + count}) / {nbytes} bytes does not fit the lease"
        for view in block_runs(rows, layer, lease.blocks[first : first + count]):
            _recv_exact_into(conn, view)
        self.leases.mark_received(lease, layer, kind)
        return None

    @staticmethod
    def _reply(conn: socket.socket, status: int, message: str) -> None:
        data = message.encode()[:65535]
        conn.sendall(struct.pack("!BH", status, len(data)) + data)

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


class TcpPush(KVPush):
    def __init__(self, kv: KVCache, dest: Destination, rows: dict[str, np.ndarray]):
        self._rows = rows
        self._sock: socket.socket | None = None
        self._lease = dest.lease_id.encode("ascii")
        super().__init__(kv, dest)

    def _connect(self) -> None:
        try:
            self._sock = socket.create_connection(split_endpoint(self.dest.endpoint), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            raise TransferError(f"KV receiver {self.dest.endpoint} unreachable: {exc}") from exc
        self._sock.settimeout(60)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _header(self, ftype: int, layer: int = 0, kind: int = 0, first: int = 0, count: int = 0,
                nbytes: int = 0) -> bytes:
        return HEADER.pack(MAGIC, VERSION, ftype, self._lease, self.dest.token, layer, kind, first, count, nbytes)

    def _write(self, layer: int, kind: str, src_blocks: list[int], first: int) -> None:
        rows = self._rows[kind]
        views = block_runs(rows, layer, src_blocks)
        header = self._header(WRITE, layer, KINDS.index(kind), first, len(src_blocks), sum(len(v) for v in views))
        try:
            self.bytes_sent += send_views(self._sock, [memoryview(header), *views])
        except OSError as exc:
            raise TransferError(f"KV write to {self.dest.endpoint} failed: {self._refusal() or exc}") from exc

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


class TcpSender(KVSender):
    def __init__(self, kv: KVCache):
        self.kv = kv
        self._rows = {kind: byte_rows(kv, kind) for kind in KINDS if pool_of_or_none(kv, kind) is not None}

    def open(self, dest: Destination) -> KVPush:
        return TcpPush(self.kv, dest, self._rows)


def commit_over_tcp(endpoint: str, lease_id: str, token: bytes, marks: list[tuple[int, str]]) -> None:
    """Mooncake's control path: report the layers written one-sidedly, then commit."""
    with socket.create_connection(split_endpoint(endpoint), timeout=CONNECT_TIMEOUT) as sock:
        sock.settimeout(30)
        lease = lease_id.encode("ascii")
        for layer, kind in marks:  # zero-length WRITE frames = "this layer landed by RDMA"
            sock.sendall(HEADER.pack(MAGIC, VERSION, WRITE, lease, token, layer, KINDS.index(kind), 0, 0, 0))
        sock.sendall(HEADER.pack(MAGIC, VERSION, COMMIT, lease, token, 0, 0, 0, 0, 0))
        status, message = read_reply(sock)
    if status != OK:
        raise TransferError(f"KV receiver refused the commit: {message}")
