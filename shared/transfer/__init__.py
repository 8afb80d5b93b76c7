"""KV transfer: one interface, two backends (built-in TCP, Mooncake Transfer Engine)."""

from __future__ import annotations

from shared.kvcache import KVCache
from shared.transfer.base import Destination, KVPush, KVReceiver, KVSender, TransferError
from shared.transfer.tcp import TcpReceiver, TcpSender

TRANSPORTS = ("tcp", "mooncake")


def make_sender(transport: str, kv: KVCache, host: str = "127.0.0.1", protocol: str = "tcp") -> KVSender:
    if transport == "tcp":
        return TcpSender(kv)
    if transport == "mooncake":
        from shared.transfer.mooncake import MooncakeSender

        return MooncakeSender(kv, host, protocol)
    raise ValueError(f"unknown KV transport {transport!r}; choose from {TRANSPORTS}")


__all__ = ["TRANSPORTS", "Destination", "KVPush", "KVReceiver", "KVSender", "TcpReceiver", "TcpSender",
           "TransferError", "make_sender"]
