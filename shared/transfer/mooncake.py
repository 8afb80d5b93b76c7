"""Mooncake Transfer Engine transport: one-sided writes (`--mooncake-protocol rdma` over the NICs of
`--mooncake-devices` on clusters, checked at start by shared.transfer.rdma; `tcp` here and in tests).

Both sides run a Mooncake TransferEngine in P2PHANDSHAKE mode (no metadata server). The prefill side
registers its whole pools (sources: only read). The decode side registers, per lease, only the
lease's blocks (one region per layer, cache kind and run of consecutive blocks) and unregisters them
when the lease is claimed, released or expires: a one-sided write can land only in a live lease's
blocks (RDMA NICs enforce the registered region), and a released lease's blocks are no longer
writable before they are reused. The decode side's descriptor carries its Mooncake session id and
the per-layer base addresses of its pools; the prefill side writes each block straight to
`base[layer] + block * block_bytes`. Mooncake has no completion notice to the target, so after the
writes the pusher reports the written layers and commits over the decode side's TCP control
endpoint (the built-in receiver), exactly like a TCP push.

Needs `pip install mooncake-transfer-engine-non-cuda` and the system libraries libibverbs1 and
librdmacm1 (`make` installs both).
"""

from __future__ import annotations

import ssl
import threading

from shared.kvcache import KVCache
from shared.transfer.base import (
    Destination,
    KVPush,
    KVReceiver,
    KVSender,
    TransferError,
    block_bytes,
    cache_kinds,
    pool_of,
)
from shared.transfer.rdma import mooncake_device_names
from shared.transfer.tcp import STALL_SECONDS, TcpReceiver, mark_over_tcp, touch_over_tcp


def mooncake_available() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401 - the import is the probe
    except Exception:  # missing wheel or system libraries
        return False
    return True


class _Engine:
    """A TransferEngine with the KV pools registered."""

    def __init__(self, kv: KVCache, host: str, protocol: str, device_name: str = "", register_pools: bool = True):
        try:
            from mooncake.engine import TransferEngine
        except Exception as exc:
            raise TransferError(f"Mooncake transfer engine unavailable: {exc}") from exc
        device_name = mooncake_device_names("mooncake", protocol, device_name)  # "auto" → the NICs found
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise TransferError(f"Mooncake initialize({host}, P2PHANDSHAKE, {protocol}, {device_name!r}) failed")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.kv = kv
        self.pools = [kv.mla] + ([kv.index] if kv.index is not None else []) if register_pools else []
        for pool in self.pools:
            if self.engine.register_memory(pool.data_ptr(), pool.numel() * pool.element_size()) != 0:
                raise TransferError("Mooncake register_memory failed")
        self._regions: dict[str, list[int]] = {}  # lease id → registered region addresses
        self._lock = threading.Lock()

    def lease_regions(self, blocks: list[int]) -> list[tuple[int, int]]:
        """(address, bytes) of every run of consecutive blocks, per layer and cache kind."""
        out = []
        for kind in cache_kinds(self.kv.layout):
            nbytes = block_bytes(self.kv.layout, kind)
            for base in self.layer_bases(kind):
                start = 0
                for i in range(1, len(blocks) + 1):
                    if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                        out.append((base + blocks[start] * nbytes, (i - start) * nbytes))
                        start = i
        return out

    def register_lease(self, lease_id: str, blocks: list[int]) -> None:
        addrs = []
        try:
            for addr, size in self.lease_regions(blocks):
                if self.engine.register_memory(addr, size) != 0:
                    raise TransferError("Mooncake register_memory failed")
                addrs.append(addr)
        except BaseException:
            for addr in addrs:
                self.engine.unregister_memory(addr)
            raise
        with self._lock:
            self._regions[lease_id] = addrs

    @property
    def registered(self) -> set[str]:
        with self._lock:
            return set(self._regions)

    def unregister_lease(self, lease_id: str) -> None:
        with self._lock:
            addrs = self._regions.pop(lease_id, [])
        for addr in addrs:
            self.engine.unregister_memory(addr)

    def layer_bases(self, kind: str) -> list[int]:
        pool = pool_of(self.kv, kind)
        stride = pool.stride(0) * pool.element_size()
        return [pool.data_ptr() + layer * stride for layer in range(pool.shape[0])]

    def close(self) -> None:
        for pool in self.pools:
            self.engine.unregister_memory(pool.data_ptr())
        for lease_id in list(self._regions):
            self.unregister_lease(lease_id)


class MooncakeReceiver(KVReceiver):
    transport = "mooncake"

    def __init__(self, kv: KVCache, control: TcpReceiver, host: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = ""):
        self.kv, self.control = kv, control
        control.accept_marks = True  # its control channel takes MARK frames for one-sided writes
        self._engine = _Engine(kv, host, protocol, device_name, register_pools=False)
        control.leases.on_end.append(lambda lease: self._engine.unregister_lease(lease.lease_id))

    def destination(self, lease) -> Destination:
        """Registers the lease's blocks (only they are writable, until the lease ends)."""
        if lease.lease_id in self.control.leases and lease.lease_id not in self._engine.registered:
            self._engine.register_lease(lease.lease_id, list(lease.blocks[lease.reused:]))  # the rest: read-only
        return Destination("mooncake", self._engine.session_id, lease.lease_id, lease.token, list(lease.blocks),
                           self.kv.layout.describe(), mla_base=self._engine.layer_bases("mla"),
                           index_base=self._engine.layer_bases("index") if self.kv.index is not None else [],
                           control_endpoint=self.control.endpoint, reused_blocks=lease.reused)

    def close(self) -> None:
        self._engine.close()


class MooncakePush(KVPush):
    def __init__(self, kv: KVCache, dest: Destination, engine: _Engine, tls: ssl.SSLContext | None = None,
                 stall_seconds: float = STALL_SECONDS):
        self._engine, self._tls, self._stall = engine, tls, stall_seconds
        self._marks: list[tuple[int, str, int, int]] = []  # (layer, kind, first, count) written one-sidedly
        super().__init__(kv, dest)

    def _connect(self) -> None:
        pass  # P2P handshake happens on the first transfer

    def _write(self, layer: int, kind: str, src_blocks: list[int], first: int) -> None:
        nbytes = block_bytes(self.kv.layout, kind)
        src_base = self._engine.layer_bases(kind)[layer]
        dst_base = (self.dest.mla_base if kind == "mla" else self.dest.index_base)[layer]
        dst_blocks = self.dest.block_ids[first : first + len(src_blocks)]
        rc = self._engine.engine.batch_transfer_sync_write(
            self.dest.endpoint,
            [src_base + b * nbytes for b in src_blocks],
            [dst_base + b * nbytes for b in dst_blocks],
            [nbytes] * len(src_blocks),
        )
        if rc != 0:
            raise TransferError(f"Mooncake write to {self.dest.endpoint} failed (rc={rc})")
        self.bytes_sent += nbytes * len(src_blocks)
        self._marks.append((layer, kind, first, len(src_blocks)))

    def _finish_writes(self) -> None:
        """Report this rank's one-sided writes (a CP group's commit comes from rank 0 afterwards)."""
        marks, self._marks = self._marks, []
        if marks:
            self._control(marks, commit=False)

    def _commit(self) -> None:
        self._control([], commit=True)

    def _keepalive(self) -> None:
        touch_over_tcp(self.dest.control_endpoint, self.dest.lease_id, self.dest.token, self._tls, self._stall)

    def _control(self, marks: list[tuple[int, str, int, int]], commit: bool) -> None:
        mark_over_tcp(self.dest.control_endpoint, self.dest.lease_id, self.dest.token, marks, commit,
                      self._tls, self._stall)


class MooncakeSender(KVSender):
    def __init__(self, kv: KVCache, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 tls: ssl.SSLContext | None = None, stall_seconds: float = STALL_SECONDS):
        self.kv, self.tls, self.stall_seconds = kv, tls, stall_seconds
        self._engine = _Engine(kv, host, protocol, device_name)

    def open(self, dest: Destination) -> KVPush:
        return MooncakePush(self.kv, dest, self._engine, self.tls, self.stall_seconds)

    def close(self) -> None:
        self._engine.close()
