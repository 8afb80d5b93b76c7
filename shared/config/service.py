"""The services' flags: what every gRPC process takes (EndpointConfig), every engine-backed service
(ServiceConfig) and each service's own (PrefillConfig, DecodeConfig)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from shared.config.engine import EngineConfig, ParallelConfig
from shared.config.knobs import REQUIRED, add_flags, check_bounds, flag, flag_name, knob_default, same_as


@dataclass(kw_only=True)
class EndpointConfig:
    """What every pdserve process that serves gRPC takes: address, metrics, drain, authentication."""

    host: str = flag("127.0.0.1", "interface to bind")
    port: int = flag(0, "gRPC port (0 = pick a free one, reported with --port-file)")
    port_file: str | None = flag(None, "write the bound gRPC port here once serving")
    metrics_port: int | None = flag(None, "serve Prometheus /metrics on this port (0: a free one, reported in "
                                          "PORT_FILE.metrics)")
    drain_seconds: float = flag(5.0, "on SIGTERM: in-flight requests get this long to finish, then the process exits")
    auth_token_file: str | None = flag(None, "file holding the cluster's shared secret (default: "
                                             "$PDSERVE_CLUSTER_TOKEN)")
    insecure: bool = flag(False, "no cluster secret on internal calls (development only)")
    tls_cert: str | None = flag(None, "PEM certificate of this process (mutual TLS on every hop)")
    tls_key: str | None = flag(None, "PEM private key of --tls-cert")
    tls_ca: str | None = flag(None, "PEM certificate of the cluster CA: peers must present one it signed")


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """--tls-cert / --tls-key / --tls-ca, as every service takes them (for clients and probes)."""
    add_flags(p, EndpointConfig, only=("tls_cert", "tls_key", "tls_ca"))


@dataclass(kw_only=True)
class ServiceConfig(EndpointConfig):
    """The flags every engine-backed service takes (the deployment renders exactly these)."""

    model: str = flag(REQUIRED, "checkpoint directory (HF layout)")
    kv_transport: str = flag("tcp", "KV transfer engine", choices=("tcp", "mooncake"))
    mooncake_protocol: str = flag("tcp", "with --kv-transport mooncake: rdma (one-sided writes over RDMA NICs; "
                                         "the service refuses to start without one) or tcp",
                                  choices=("tcp", "rdma"))
    mooncake_devices: str = flag("auto", "RDMA NICs for --mooncake-protocol rdma: names (mlx5_0,mlx5_1) or auto "
                                         "(every device under /sys/class/infiniband with an active port)")
    dtype: str = same_as(EngineConfig, "dtype")
    indexer_numerics: str = same_as(EngineConfig, "indexer_numerics")
    quantization: str = same_as(EngineConfig, "quantization")
    kv_cache_dtype: str = same_as(EngineConfig, "kv_cache_dtype")
    offload_layers: str = same_as(EngineConfig, "offload_layers")
    offload_buffers: int = same_as(EngineConfig, "offload_buffers")
    speculative: str = same_as(EngineConfig, "speculative")
    num_speculative_tokens: int = same_as(EngineConfig, "num_speculative_tokens")
    share_weights_dir: str | None = same_as(EngineConfig, "share_weights_dir")
    block_size: int = same_as(EngineConfig, "block_size")
    kv_cache_tokens: int = same_as(EngineConfig, "kv_cache_tokens")
    kv_tier_tokens: int = same_as(EngineConfig, "kv_tier_tokens")
    kv_tier_dir: str | None = same_as(EngineConfig, "kv_tier_dir")
    kv_store_master: str | None = same_as(EngineConfig, "kv_store_master")
    no_prefix_cache: bool = flag(False, "no prefix cache: prefill recomputes every prompt, decode gets every block "
                                        "pushed")
    ep: int = flag(1, "expert-parallel ranks (divides the instance's ranks)", bounds=(1, None))
    tp: int = flag(1, "local TP ranks for o_proj / lm_head / embedding", bounds=(1, None))
    cp: int = 1  # prefill instances (their own flag)
    dp: int = 1  # decode instances (their own flag)
    layer_sharding: tuple[str, ...] = flag((), "o_proj,q_b_proj: layer i's weight lives on rank i %% K")
    advertise_host: str | None = flag(None, "address peers reach this instance at (needed with --host 0.0.0.0)")
    engine_in_process: bool = flag(False, "run the engine loop in the gRPC process (default: its own process, "
                                          "so handlers and the engine never share a GIL)")
    cpu_threads: int = flag(0, "CPU threads of the instance's engine ranks on this host, shared out among them (0: "
                               "OMP_NUM_THREADS if set, else the usable cores less one, left to the front ends)",
                            bounds=(0, None))

    @property
    def public_host(self) -> str:
        """The host peers reach this instance at (KV endpoints, Mooncake): --advertise-host, or --host
        when that names one interface (a wildcard bind names none)."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError("--host binds every interface: give --advertise-host, the address peers use")
        return self.host

    @property
    def world(self) -> int:
        """Ranks in the instance (cp, dp and tp exclude each other beyond 1)."""
        return self.cp * self.dp * self.tp

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(world=self.world, cp=self.cp, dp=self.dp, tp=self.tp, ep=self.ep,
                              layer_sharding=self.layer_sharding)

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The engine this service runs: its own flags where the names agree, then `overrides`."""
        names = {f.name for f in fields(EngineConfig)}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        if self.kv_store_master:  # the store's clients meet at the address peers reach this instance at
            values.update(kv_store_host=self.public_host, kv_store_protocol=self.mooncake_protocol)
        return EngineConfig(**{**values, **overrides})

    def __post_init__(self) -> None:
        check_bounds(self, flag_name)


@dataclass(kw_only=True)
class PrefillConfig(ServiceConfig):
    """The prefill service's flags."""

    cp: int = flag(1, "context-parallel ranks", bounds=(1, None))
    max_prefill_tokens: int = flag(knob_default(EngineConfig, "max_num_batched_tokens"),
                                   "prompt tokens computed per engine step (chunked prefill; several prompts batch "
                                   "up to it)", bounds=(1, None))
    no_kv_fetch: bool = flag(False, "never pull a prompt's cached prefix from another prefill instance (one-rank "
                                    "instances fetch, and serve fetches of what they cache)")
    kv_stall_seconds: float = flag(1.5, "a KV push that makes no progress this long fails (the request gets "
                                        "UNAVAILABLE)")

    def engine_config(self, **overrides: object) -> EngineConfig:
        return super().engine_config(max_num_batched_tokens=self.max_prefill_tokens,
                                     enable_prefix_caching=not self.no_prefix_cache, **overrides)


@dataclass(kw_only=True)
class DecodeConfig(ServiceConfig):
    """The decode service's flags."""

    dp: int = flag(1, "attention data-parallel ranks", bounds=(1, None))
    speculative_max_draft_tokens: int = same_as(EngineConfig, "speculative_max_draft_tokens")
    enforce_eager: bool = same_as(EngineConfig, "enforce_eager")
    kv_port: int = flag(0, "TCP KV receiver port of rank 0, rank r uses +r (0 = free)")
    lease_seconds: float = flag(30.0, "unused reservations expire after this")
    kv_stall_seconds: float = flag(3.0, "a KV write being received that gets no byte this long is dropped and its "
                                        "reservation's blocks freed at once (a write whose reservation is released "
                                        "meanwhile is dropped at once)", bounds=(0.1, None))
    reserve_wait_seconds: float = flag(5.0, "a reservation that finds the KV pool full waits up to this long for "
                                            "blocks to free (within its caller's deadline) before it is refused "
                                            "with RESOURCE_EXHAUSTED (0: refused at once)", bounds=(0.0, None))
    max_num_seqs: int = same_as(EngineConfig, "max_num_seqs")
