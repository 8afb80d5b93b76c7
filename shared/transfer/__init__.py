"""KV transfer: one interface, two backends (built-in TCP, Mooncake Transfer Engine)."""

from __future__ import annotations

import ssl

from shared.kvcache import KVCache
from shared.transfer.base import Destination, KVPush, KVReceiver, KVSender, TransferError
from shared.transfer.mooncake import MooncakeSender
from shared.transfer.tcp import STALL_SECONDS, TcpReceiver, TcpSender

TRANSPORTS = ("tcp", "mooncake")


def make_sender(transport: str, kv: KVCache, host: str = "127.0.0.1", protocol: str = "tcp",
                tls: ssl.SSLContext | None = None, stall_seconds: float = STALL_SECONDS,
                device_name: str = "") -> KVSender:
    """A sender of `transport`; `protocol` and `device_name` are Mooncake's (tcp, or rdma over those NICs);
    `tls` secures the TCP data or control channel, `stall_seconds` bounds how long a push may make no
    progress."""
    if transport == "tcp":
        return TcpSender(kv, tls, stall_seconds)
    if transport == "mooncake":
        return MooncakeSender(kv, host, protocol, device_name, tls=tls, stall_seconds=stall_seconds)
    raise ValueError(f"unknown KV transport {transport!r}; choose from {TRANSPORTS}")


__all__ = ["TRANSPORTS", "Destination", "KVPush", "KVReceiver", "KVSender", "TcpReceiver", "TcpSender",
           "TransferError", "make_sender"]
