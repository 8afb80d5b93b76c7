"""The deployment description: one typed YAML for a whole pdserve deployment.

The Helm chart's `values.yaml` uses the same keys, so one file drives both

    pdserve up --config deploy.yaml          # locally: router + M prefill + N decode subprocesses
    helm install pdserve helm/pdserve -f deploy.yaml

Sections: `model.path`, `engine` (dtype, indexer numerics, block size, KV transport, drain),
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

from shared.config import EngineConfig
from shared.transfer.tcp import STALL_SECONDS

KUBERNETES_ONLY = {"image", "auth", "lws", "masterPort", "monitoring", "podDisruptionBudget", "resources",
                   "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "replicas", "serviceType",
                   "source", "pvc", "hostPath", "uri", "secretName"}


@dataclass
class ModelSpec:
    path: str = "/models/model"


@dataclass
class EngineSpec:
    dtype: str = "bfloat16"
    indexer_numerics: str = "deepseek"
    block_size: int = 16
    kv_transport: str = "tcp"
    drain_seconds: float = 5.0


@dataclass
class RouterSpec:
    port: int = 50051
    max_concurrent_requests: int = 1024
    max_prompt_bytes: int = 0
    request_timeout: float = 600.0
    policy: str = "sla"
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0


@dataclass
class PrefillSpec:
    instances: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    layer_sharding: str = ""
    port: int = 7002
    max_prefill_tokens: int = EngineConfig.max_num_batched_tokens
    kv_cache_tokens: int = EngineConfig.kv_cache_tokens
    kv_stall_seconds: float = STALL_SECONDS


@dataclass
class DecodeSpec:
    instances: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    layer_sharding: str = ""
    port: int = 7001
    kv_port: int = 7100
    max_num_seqs: int = EngineConfig.max_num_seqs
    kv_cache_tokens: int = EngineConfig.kv_cache_tokens
    lease_seconds: float = 30.0


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
            r = self.router
            return ["--request-timeout", _s(r.request_timeout), "--max-prompt-bytes", _s(r.max_prompt_bytes),
                    "--max-concurrent-requests", _s(r.max_concurrent_requests), "--drain-seconds",
                    _s(e.drain_seconds), "--policy", r.policy, "--ttft-slo-ms", _s(r.ttft_slo_ms),
                    "--tpot-slo-ms", _s(r.tpot_slo_ms)]
        spec = self.prefill if role == "prefill" else self.decode
        out = ["--kv-transport", e.kv_transport, "--dtype", e.dtype, "--indexer-numerics", e.indexer_numerics,
               "--block-size", _s(e.block_size), "--drain-seconds", _s(e.drain_seconds),
               "--kv-cache-tokens", _s(spec.kv_cache_tokens), "--tp", _s(spec.tp), "--ep", _s(spec.ep)]
        if spec.layer_sharding:
            out += ["--layer-sharding", spec.layer_sharding]
        if role == "prefill":
            p = self.prefill
            out += ["--cp", _s(p.cp), "--max-prefill-tokens", _s(p.max_prefill_tokens),
                    "--kv-stall-seconds", _s(p.kv_stall_seconds)]
        else:
            d = self.decode
            out += ["--dp", _s(d.dp), "--kv-port", _s(d.kv_port), "--lease-seconds", _s(d.lease_seconds),
                    "--max-num-seqs", _s(d.max_num_seqs)]
        return out


def _s(value: object) -> str:
    return str(value)


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def _build(cls, data: dict[str, Any], where: str):  # noqa: ANN001, ANN202
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
            want = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)]
            if want is float and isinstance(value, int):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{where}{key}: expected {want.__name__}, got {value!r}")
            values[name] = value
    return cls(**values)
