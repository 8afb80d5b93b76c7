"""Mooncake Store as the cluster-wide KV tier: the second tier's records (shared.kvcache.tier) kept in a
Mooncake distributed store that every instance of the same model reads, instead of one process's files.

Each rank is a store client: it mounts a segment of `--kv-tier-tokens` worth of records into the store's
pool (its share of the cluster's capacity) and puts the records it spills; any rank of any instance finds a
prompt's blocks by name and reads them back, so a prefix one instance computed is a tier hit on every other
one, across restarts of the writer (until the store's master evicts it, or the writer's segment leaves with
its process). A `mooncake_master` (`pdserve up --kv-store-master auto` starts one) keeps the metadata;
clients meet through P2PHANDSHAKE, so no metadata server is needed.

Names are `pdserve/<namespace>/<block key>`: the namespace is a digest of the checkpoint and the KV layout
(`store_namespace`), so two models, or one model under two layouts, never read each other's records; the
block key already carries the tenant's salt. Records are the tier's own (magic, layout, length, SHA-256 of
the payload), validated on every read: a record altered in the store is dropped, never served.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from shared.config import EngineConfig
from shared.kvcache import KVLayout
from shared.transfer.base import TransferError
from shared.transfer.rdma import mooncake_device_names

SAMPLE_BYTES = 1 << 20  # of each weight file's head and tail in the namespace digest
MIN_LOCAL_BUFFER = 16 << 20


def store_namespace(model_dir: str, layout: dict[str, object]) -> str:
    """A digest naming what a record depends on: the checkpoint (its config, each weight file's name, size,
    safetensors header and first and last MiB of tensor data: two checkpoints of one architecture differ
    there) and the KV layout description (dtypes, widths, block size)."""
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode())
    root = Path(model_dir)
    config = root / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:24]


class MooncakeStore:
    """A tier store (shared.kvcache.tier.TierStore) over a Mooncake distributed store; `shared`: records
    outlive this process and other processes read them, so evicting one from this rank's index only forgets
    it (the master evicts under memory pressure)."""

    shared = True

    def __init__(self, master: str, namespace: str, segment_bytes: int, record_bytes: int, host: str = "127.0.0.1",
                 protocol: str = "tcp"):
        try:
            from mooncake.store import MooncakeDistributedStore
        except Exception as exc:  # missing wheel or system libraries
            raise TransferError(f"Mooncake Store unavailable: {exc}") from exc
        devices = mooncake_device_names("kv_store", protocol, "auto") if protocol == "rdma" else ""
        self._store = MooncakeDistributedStore()
        local_buffer = max(MIN_LOCAL_BUFFER, 4 * record_bytes)
        rc = self._store.setup(host, "P2PHANDSHAKE", max(segment_bytes, MIN_LOCAL_BUFFER), local_buffer, protocol,
                               devices, master)
        if rc != 0:
            raise TransferError(f"kv_store_master: Mooncake Store setup against {master!r} failed ({rc})")
        self.prefix = f"pdserve/{namespace}/"
        self._closed = False

    def name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def put(self, key: bytes, record: bytes, payload: torch.Tensor) -> str:
        name = self.name(key)
        if self._store.is_exist(name) != 1:  # another rank spilled the same block: its record serves
            rc = self._store.put_parts(name, record, memoryview(payload.numpy()))
            if rc != 0 and self._store.is_exist(name) != 1:
                raise OSError(f"Mooncake Store put of {name} failed ({rc})")
        return name

    def find(self, keys: list[bytes]) -> list[str]:
        """The names of the leading run of `keys` the store holds (one round trip to the master)."""
        names = [self.name(k) for k in keys]
        found: list[str] = []
        for name, present in zip(names, self._store.batch_is_exist(names) if names else []):
            if present != 1:
                break
            found.append(name)
        return found

    def get(self, handle: object) -> torch.Tensor | None:
        data = self._store.get(str(handle))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None

    def delete(self, handle: object) -> None:
        """A record found corrupt: remove it for every reader (forced: a reader's lease must not keep it)."""
        self._store.remove(str(handle), True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.close()


def shared_tier_store(config: EngineConfig, layout: KVLayout) -> MooncakeStore | None:
    """The cluster-wide store an engine's second tier keeps its records in (`kv_store_master`), None for
    the tier's own process-private store. This rank mounts its tier's size into the store's pool."""
    if not config.kv_store_master:
        return None
    record_bytes = layout.bytes_per_token() * layout.block_size + 4096  # + the header (magic, key, layout, digest)
    segment = -(-config.kv_tier_tokens // layout.block_size) * record_bytes
    return MooncakeStore(config.kv_store_master, store_namespace(config.model, layout.describe()), segment,
                         record_bytes, config.kv_store_host, config.kv_store_protocol)
