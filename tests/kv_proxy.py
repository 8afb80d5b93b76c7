"""A loopback TCP proxy in front of a decode KV receiver, for fault injection in tests."""

from __future__ import annotations

import random
import socket
import threading


class KVProxy:
    """A TCP proxy on 127.0.0.2:port → 127.0.0.1:port (decode's KV receiver), which forwards, stalls
    (accepts and reads nothing) or drops (resets the connection after a few bytes). With
    `drop_fraction`, forwarding drops that share of connections at random (injected transport errors)."""

    def __init__(self, port: int, drop_fraction: float = 0.0, seed: int = 0):
        self.mode = "forward"
        self.drop_fraction, self.random = drop_fraction, random.Random(seed)
        self.dropped = 0
        self.target = ("127.0.0.1", port)
        self.sock = socket.create_server(("127.0.0.2", port))
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "stall":
                self.held.append(conn)  # never read: the pusher's buffers fill, or its commit gets no answer
                continue
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        if self.mode == "drop" or self.random.random() < self.drop_fraction:
            self.dropped += 1
            conn.recv(64)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()  # RST
            return
        up = socket.create_connection(self.target)

        def copy(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(1 << 16):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=copy, args=(up, conn), daemon=True).start()
        copy(conn, up)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()
