"""The deployment description: one typed YAML for a whole pdserve deployment.

The Helm chart's `values.yaml` uses the same keys, so one file drives both

    pdserve up --config deploy.yaml          # locally: router + M prefill + N decode subprocesses
    helm install pdserve helm/pdserve -f deploy.yaml

Sections: `model.path`, `engine` (dtype, indexer numerics, quantization, KV cache dtype, weight offload,
shared weights, block size, KV transport and `mooncake.protocol/devices`, drain),
`router`, `prefill` (M instances with cp/tp/ep), `decode` (N instances with dp/tp/ep/layer
sharding), `tls`, `metrics`. Keys only Kubernetes uses (image, resources, nodeSelector, lws, …) are
accepted and ignored locally; any other key is an error naming it. `flags()` renders exactly the
service flags the chart renders (a test compares the two).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from router.config import RouterConfig
from shared.config import DecodeConfig, PrefillConfig, ServiceConfig, check_bounds, flag, same_as

KUBERNETES_ONLY = {"image", "auth", "lws", "autoscaling", "masterPort", "monitoring", "podDisruptionBudget",
                   "resources", "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "replicas",
                   "serviceType", "source", "pvc", "hostPath", "uri", "secretName", "rdmaResource", "hostNetwork",
                   "apiKeySecret", "profileJson", "gateway"}
SHARED_WEIGHTS_DIR = "/dev/shm/pdserve"  # engine.shareWeights: the chart mounts a memory emptyDir at /dev/shm
_LAYERS = re.compile(r"\d+(-\d+)?")


@dataclass
class ModelSpec:
    path: str = "/models/model"


@dataclass
class MooncakeSpec:
    """engine.mooncake: how the Mooncake transport moves KV (with kvTransport: mooncake). The chart also
    reads rdmaResource (the device-plugin resource each engine pod requests with rdma) and hostNetwork."""

    protocol: str = same_as(ServiceConfig, "mooncake_protocol")  # rdma: the services refuse to start without a NIC
    devices: str = same_as(ServiceConfig, "mooncake_devices")


@dataclass
class EngineSpec:
    """engine: the knobs prefill and decode share; defaults, choices and bounds are the services' own
    (`same_as`), and a test holds the chart's values.yaml to them."""

    dtype: str = same_as(ServiceConfig, "dtype")
    indexer_numerics: str = same_as(ServiceConfig, "indexer_numerics")
    block_size: int = same_as(ServiceConfig, "block_size")
    kv_transport: str = same_as(ServiceConfig, "kv_transport")
    mooncake: MooncakeSpec = field(default_factory=MooncakeSpec)
    drain_seconds: float = same_as(ServiceConfig, "drain_seconds")
    quantization: str = same_as(ServiceConfig, "quantization")
    kv_cache_dtype: str = same_as(ServiceConfig, "kv_cache_dtype")  # one setting: prefill and decode must agree
    offload_layers: str = same_as(ServiceConfig, "offload_layers")
    offload_buffers: int = same_as(ServiceConfig, "offload_buffers")  # rendered only with offload_layers
    share_weights: bool = False  # --share-weights-dir /dev/shm/pdserve (the chart mounts a memory emptyDir)
    share_weights_dir: str = ""  # another directory (implies sharing); "" = none, or the above with share_weights
    speculative: str = same_as(ServiceConfig, "speculative")
    num_speculative_tokens: int = same_as(ServiceConfig, "num_speculative_tokens")
    kv_tier_tokens: int = same_as(ServiceConfig, "kv_tier_tokens")  # both: prefill's prompts, decode's leases
    kv_tier_dir: str | None = same_as(ServiceConfig, "kv_tier_dir")  # rendered only with kv_tier_tokens
    kv_store_master: str | None = same_as(ServiceConfig, "kv_store_master")  # the tier in a Mooncake Store

    def __post_init__(self) -> None:
        check_bounds(self, lambda name: f"engine.{_camel(name)}")
        spec = self.offload_layers.strip()
        if spec and spec.lower() != "all":
            for part in spec.split(","):
                part = part.strip()
                if not _LAYERS.fullmatch(part):
                    raise ValueError(f"engine.offloadLayers: {part!r} is not a layer index or range A-B "
                                     f"(use e.g. '3,5,7', '2-10', 'all')")
                lo, _, hi = part.partition("-")
                if hi and int(lo) > int(hi):
                    raise ValueError(f"engine.offloadLayers: range {part} is empty")
        check_bounds(self.mooncake, lambda name: f"engine.mooncake.{_camel(name)}")
        if self.kv_store_master and not self.kv_tier_tokens:
            raise ValueError("engine.kvStoreMaster: the store holds the second tier: set engine.kvTierTokens too")
        if self.mooncake.protocol == "rdma" and self.kv_transport != "mooncake":
            raise ValueError("engine.mooncake.protocol: rdma needs engine.kvTransport: mooncake")

    @property
    def weights_dir(self) -> str:
        """The --share-weights-dir the services get ("": none)."""
        return self.share_weights_dir or (SHARED_WEIGHTS_DIR if self.share_weights else "")

    def flags(self) -> list[str]:
        """The engine flags prefill and decode both get (the chart's `pdserve.engineArgs`)."""
        out = ["--kv-transport", self.kv_transport, "--dtype", self.dtype, "--indexer-numerics",
               self.indexer_numerics, "--quantization", self.quantization, "--kv-cache-dtype", self.kv_cache_dtype,
               "--block-size", _s(self.block_size), "--drain-seconds", _s(self.drain_seconds)]
        if self.kv_transport == "mooncake":
            out += ["--mooncake-protocol", self.mooncake.protocol, "--mooncake-devices", self.mooncake.devices]
        if self.offload_layers.strip():
            out += ["--offload-layers", self.offload_layers.strip(), "--offload-buffers", _s(self.offload_buffers)]
        if self.weights_dir:
            out += ["--share-weights-dir", self.weights_dir]
        if self.speculative:  # both services: prefill computes the MTP layer's cache, decode drafts
            out += ["--speculative", self.speculative, "--num-speculative-tokens", _s(self.num_speculative_tokens)]
        if self.kv_tier_tokens:
            out += ["--kv-tier-tokens", _s(self.kv_tier_tokens), *(["--kv-tier-dir", self.kv_tier_dir]
                                                                   if self.kv_tier_dir else [])]
            out += ["--kv-store-master", self.kv_store_master] if self.kv_store_master else []
        return out


@dataclass
class RouterSpec:
    """router: the router's flags the chart renders (defaults: RouterConfig's). Two name files: apiKeyFile
    (the HTTP API's keys) and profile (`pdserve profile`'s profile.json) are paths on the machine running
    `pdserve up`; in the cluster the chart takes router.apiKeySecret (a Secret, mounted) and
    router.profileJson (the file's content, in the release's ConfigMap) and renders the mounted paths."""

    port: int = same_as(RouterConfig, "port")
    max_concurrent_requests: int = same_as(RouterConfig, "max_concurrent_requests")
    max_prompt_bytes: int = same_as(RouterConfig, "max_prompt_bytes")
    request_timeout: float = same_as(RouterConfig, "request_timeout")
    drain_seconds: float = same_as(RouterConfig, "drain_seconds")  # the router's own: it holds users' streams
    instance_wait: float = same_as(RouterConfig, "instance_wait")
    policy: str = same_as(RouterConfig, "policy")
    ttft_slo_ms: float = same_as(RouterConfig, "ttft_slo_ms")
    tpot_slo_ms: float = same_as(RouterConfig, "tpot_slo_ms")
    admission_wait_ms: float = same_as(RouterConfig, "admission_wait_ms")
    local_prefill_tokens: int = same_as(RouterConfig, "local_prefill_tokens")
    overflow_prefill_tokens: int = same_as(RouterConfig, "overflow_prefill_tokens")
    no_kv_fetch: bool = same_as(RouterConfig, "no_kv_fetch")
    no_token_bus: bool = same_as(RouterConfig, "no_token_bus")
    migration_limit: int = same_as(RouterConfig, "migration_limit")
    http_port: int | None = same_as(RouterConfig, "http_port")
    kserve_port: int | None = same_as(RouterConfig, "kserve_port")
    api_key_file: str | None = same_as(RouterConfig, "api_key_file")
    served_model_name: str | None = same_as(RouterConfig, "served_model_name")
    chat_max_tokens: int = same_as(RouterConfig, "chat_max_tokens")
    http_max_body_bytes: int = same_as(RouterConfig, "http_max_body_bytes")
    http_max_prompts: int = same_as(RouterConfig, "http_max_prompts")
    profile: str | None = same_as(RouterConfig, "profile")

    def __post_init__(self) -> None:
        check_bounds(self, lambda name: f"router.{_camel(name)}")


@dataclass
class PrefillSpec:
    """prefill: M instances of one shape (service defaults: PrefillConfig's)."""

    instances: int = flag(1, "prefill instances (pdserve up --num-prefill)", bounds=(1, None))
    cp: int = same_as(PrefillConfig, "cp")
    tp: int = same_as(PrefillConfig, "tp")
    ep: int = same_as(PrefillConfig, "ep")
    layer_sharding: str = ""
    port: int = 7002
    max_prefill_tokens: int = same_as(PrefillConfig, "max_prefill_tokens")
    kv_cache_tokens: int = same_as(PrefillConfig, "kv_cache_tokens")
    kv_stall_seconds: float = same_as(PrefillConfig, "kv_stall_seconds")
    no_prefix_cache: bool = same_as(PrefillConfig, "no_prefix_cache")
    no_kv_fetch: bool = same_as(PrefillConfig, "no_kv_fetch")

    def __post_init__(self) -> None:
        check_bounds(self, lambda name: f"prefill.{_camel(name)}")


@dataclass
class DecodeSpec:
    """decode: N instances of one shape (service defaults: DecodeConfig's)."""

    instances: int = flag(1, "decode instances (pdserve up --num-decode)", bounds=(1, None))
    dp: int = same_as(DecodeConfig, "dp")
    tp: int = same_as(DecodeConfig, "tp")
    ep: int = same_as(DecodeConfig, "ep")
    layer_sharding: str = ""
    port: int = 7001
    kv_port: int = 7100
    max_num_seqs: int = same_as(DecodeConfig, "max_num_seqs")
    kv_cache_tokens: int = same_as(DecodeConfig, "kv_cache_tokens")
    lease_seconds: float = same_as(DecodeConfig, "lease_seconds")
    kv_stall_seconds: float = same_as(DecodeConfig, "kv_stall_seconds")
    reserve_wait_seconds: float = same_as(DecodeConfig, "reserve_wait_seconds")
    speculative_max_draft_tokens: int = same_as(DecodeConfig, "speculative_max_draft_tokens")  # with MTP
    enforce_eager: bool = same_as(DecodeConfig, "enforce_eager")
    no_prefix_cache: bool = same_as(DecodeConfig, "no_prefix_cache")

    def __post_init__(self) -> None:
        check_bounds(self, lambda name: f"decode.{_camel(name)}")


@dataclass
class TlsSpec:
    enabled: bool = False


@dataclass
class MetricsSpec:
    port: int = 9400


@dataclass
class Deployment:
    model: ModelSpec = field(default_factory=ModelSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    prefill: PrefillSpec = field(default_factory=PrefillSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)
    tls: TlsSpec = field(default_factory=TlsSpec)
    metrics: MetricsSpec = field(default_factory=MetricsSpec)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Deployment:
        import yaml

        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Deployment:
        return _build(cls, data, "")

    def flags(self, role: str) -> list[str]:
        """The flags of `role` (router, prefill, decode) that the chart renders too, without the
        per-host ones (--host, --advertise-host, --port, --metrics-port, TLS files, --model)."""
        e = self.engine
        if role == "router":
            return self._router_flags()
        spec = self.prefill if role == "prefill" else self.decode
        out = [*e.flags(), "--kv-cache-tokens", _s(spec.kv_cache_tokens), "--tp", _s(spec.tp), "--ep", _s(spec.ep)]
        if spec.layer_sharding:
            out += ["--layer-sharding", spec.layer_sharding]
        if role == "prefill":
            p = self.prefill
            out += ["--cp", _s(p.cp), "--max-prefill-tokens", _s(p.max_prefill_tokens),
                    "--kv-stall-seconds", _s(p.kv_stall_seconds), *(["--no-prefix-cache"] if p.no_prefix_cache else []),
                    *(["--no-kv-fetch"] if p.no_kv_fetch else [])]
        else:
            d = self.decode
            out += ["--dp", _s(d.dp), "--kv-port", _s(d.kv_port), "--lease-seconds", _s(d.lease_seconds),
                    "--max-num-seqs", _s(d.max_num_seqs), "--kv-stall-seconds", _s(d.kv_stall_seconds),
                    "--reserve-wait-seconds", _s(d.reserve_wait_seconds),
                    *(["--no-prefix-cache"] if d.no_prefix_cache else []),
                    *(["--enforce-eager"] if d.enforce_eager else [])]
            if e.speculative:
                out += ["--speculative-max-draft-tokens", _s(d.speculative_max_draft_tokens)]
        return out


    def _router_flags(self) -> list[str]:
        """The router's flags (the chart's router.yaml): its own, and the decode instances' DP ranks
        (--decode-dp: --autoscale plans an instance as that many ranks)."""
        r = self.router
        optional = {"--http-port": r.http_port, "--kserve-port": r.kserve_port,
                    "--api-key-file": r.api_key_file,
                    "--served-model-name": r.served_model_name, "--profile": r.profile}
        return ["--request-timeout", _s(r.request_timeout), "--instance-wait", _s(r.instance_wait),
                "--max-prompt-bytes", _s(r.max_prompt_bytes),
                "--max-concurrent-requests", _s(r.max_concurrent_requests), "--drain-seconds",
                _s(r.drain_seconds), "--policy", r.policy, "--ttft-slo-ms", _s(r.ttft_slo_ms),
                "--tpot-slo-ms", _s(r.tpot_slo_ms), "--admission-wait-ms", _s(r.admission_wait_ms),
                "--local-prefill-tokens", _s(r.local_prefill_tokens),
                "--overflow-prefill-tokens", _s(r.overflow_prefill_tokens), "--migration-limit", _s(r.migration_limit),
                "--chat-max-tokens", _s(r.chat_max_tokens), "--http-max-body-bytes", _s(r.http_max_body_bytes),
                "--http-max-prompts", _s(r.http_max_prompts), "--decode-dp", _s(self.decode.dp),
                *(["--no-kv-fetch"] if r.no_kv_fetch else []), *(["--no-token-bus"] if r.no_token_bus else []),
                *(x for flag, value in optional.items() if value is not None for x in (flag, _s(value)))]


def _s(value: object) -> str:
    return str(value)


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(w.title() for w in rest)


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _build(cls, data: dict[str, Any], where: str):
    """A dataclass from camelCase YAML keys; unknown keys (other than Kubernetes-only ones) are errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'deployment'}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in data.items():
        name = _snake(key)
        if name not in known:
            if key in KUBERNETES_ONLY:
                continue
            raise ValueError(f"{where}{key}: unknown key (known: {', '.join(sorted(known))})")
        f = known[name]
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if hasattr(default, "__dataclass_fields__"):
            values[name] = _build(type(default), value or {}, f"{where}{key}.")
        elif value is None:
            continue
        else:
            want = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type).removesuffix(" | None")]
            if want is float and isinstance(value, int):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{where}{key}: expected {want.__name__}, got {value!r}")
            values[name] = value
    return cls(**values)
