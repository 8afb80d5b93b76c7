"""Every service flag a user needs is reachable from `pdserve up` and from the chart's values (issue 44).

The test walks the flags of the services' configs (RouterConfig, PrefillConfig, DecodeConfig: every
field declared with `flag()`) and sets each to a value other than its default
* through `pdserve up`: its own flag (same name, or the name listed in UP_FLAGS), or the deployment
  description `pdserve up --config FILE` reads;
* through the chart: a key of values.yaml (the section of the service, or `engine` for the flags prefill
  and decode share; CHART_KEYS where the key is named otherwise);
and the service's own parser must read that value back from the arguments `pdserve up` passes and from
the container args the chart renders. A flag set neither way must be in one of the allow-lists below,
with the reason; the ones the issue named must be reachable both ways."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import yaml

from decode_service.server import parse_args as decode_args
from prefill_service.server import parse_args as prefill_args
from router.autoscale import AutoscaleConfig
from router.cli import parser, up_cluster
from router.server import RouterConfig
from router.server import parse_args as router_args
from shared.config import DecodeConfig, PrefillConfig, flag_name

helm = pytest.importorskip("helm_python")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "pdserve"
CONFIGS = {"router": RouterConfig, "prefill": PrefillConfig, "decode": DecodeConfig}
PARSERS = {"router": router_args, "prefill": prefill_args, "decode": decode_args}
BASE = {"router": ["--model", "m", "--prefill", "p:1", "--decode", "d:1"], "prefill": ["--model", "m"],
        "decode": ["--model", "m"]}

# Set by whoever starts a service, for every service, never chosen through these two surfaces by name.
LAUNCHER = {
    "host": "the interface: loopback under `pdserve up`, the pod's IP in the cluster",
    "advertise_host": "what peers dial: the pod's IP in the cluster (--host names it locally)",
    "port": "`pdserve up --port` and router.port for the router; every instance picks its own locally and "
            "gets prefill.port / decode.port in the cluster (test_helm parses them)",
    "port_file": "how `pdserve up` learns the ports its services picked",
    "metrics_port": "a free port per service under `pdserve up`, metrics.port in the cluster",
    "auth_token_file": "the cluster secret: made per start by `pdserve up` (environment), a Secret in the "
                       "cluster (auth.existingSecret or generated)",
    "insecure": "development only: both launchers authenticate every internal call",
    "tls_cert": "`pdserve up --tls` makes a CA and certificates; the chart mounts tls.secretName",
    "tls_key": "as --tls-cert",
    "tls_ca": "as --tls-cert",
    "model": "`pdserve up --model` (or the description's model.path), the chart's model.path",
    "prefill": "the router's instance addresses: the launcher knows them (files, DNS names)",
    "decode": "as --prefill",
}
# Internal tuning a deployment does not need to change (each default fits every deployment).
INTERNAL = {
    "load_interval": "how often the router polls each instance's load (0.25 s)",
    "discovery_interval": "how often the router re-resolves dns: / file: pools (5 s; 1 s under `pdserve up "
                          "--autoscale`, which sets it)",
    "engine_in_process": "a debugging switch: the engine loop in the gRPC process",
    "cpu_threads": "CPU threads per engine, sized from the host's cores (or OMP_NUM_THREADS) by the service",
}
# Flags `pdserve up` sets itself on its one host (the chart's values reach them).
UP_SETS = {
    ("decode", "kv_port"): "one host: every decode instance picks free KV ports (decode.kvPort in the cluster)",
    ("router", "autoscale_prometheus"): "one router: its own counters are all the load (no Prometheus needed)",
    ("router", "autoscale_routers"): "as --autoscale-prometheus",
    ("router", "epp_endpoints"): "one router: the endpoint picker names it (gateway.enabled: the router pods)",
}
# `pdserve up` flags named otherwise than the service's flag: (role, field) → the `pdserve up` option.
UP_FLAGS = {("prefill", "cp"): "--prefill-cp", ("prefill", "tp"): "--prefill-tp", ("prefill", "ep"): "--prefill-ep",
            ("decode", "dp"): "--decode-dp", ("decode", "tp"): "--decode-tp", ("decode", "ep"): "--decode-ep",
            ("router", "decode_dp"): "--decode-dp"}
# values.yaml keys named otherwise than (the service's section or engine).camelCase(field).
CHART_KEYS = {"mooncake_protocol": ("engine", "mooncake", "protocol"),
              "mooncake_devices": ("engine", "mooncake", "devices"),
              "decode_dp": ("decode", "dp"), "autoscale_period": ("autoscaling", "period"),
              "autoscale_window": ("autoscaling", "window"), "autoscale_down_after": ("autoscaling", "downAfter"),
              "autoscale_headroom": ("autoscaling", "headroom"), "autoscale_lead": ("autoscaling", "lead"),
              "autoscale_burst_sigmas": ("autoscaling", "burstSigmas"),
              "autoscale_prometheus": ("autoscaling", "prometheusAddress"),
              "autoscale_routers": ("autoscaling", "routerSelector"), "epp_port": ("gateway", "eppPort")}
# Flags the chart renders from other values: files it mounts (the mounted path), the autoscaler's bounds.
CHART_DERIVED = {"api_key_file": ({"router": {"apiKeySecret": "my-keys"}}, "/etc/pdserve/api-keys/api-keys"),
                 "profile": ({"router": {"profileJson": '{"prefill_base_s": 0.01}'}},
                             "/etc/pdserve/profile/profile.json"),
                 "autoscale": ({"lws": {"enabled": True}, "autoscaling": {"enabled": True, "min": 2, "max": 6}},
                               "2:6"),
                 "epp_endpoints": ({"router": {"httpPort": 8000}, "gateway": {"enabled": True}},
                                   ["dns:demo-pdserve-router-pods:8000"])}
# What else a value needs to be rendered at all (the chart's values / `pdserve up`'s flags).
AUTOSCALING = {"lws": {"enabled": True}, "autoscaling": {"enabled": True}}
CHART_CONTEXT = {"mooncake_protocol": {"engine": {"kvTransport": "mooncake"}},
                 "mooncake_devices": {"engine": {"kvTransport": "mooncake"}},
                 "offload_buffers": {"engine": {"offloadLayers": "3,5"}},
                 "num_speculative_tokens": {"engine": {"speculative": "mtp"}},
                 "speculative_max_draft_tokens": {"engine": {"speculative": "mtp"}},
                 "kv_tier_dir": {"engine": {"kvTierTokens": 4096}},
                 "kv_store_master": {"engine": {"kvTierTokens": 4096}},
                 "epp_port": {"router": {"httpPort": 8000}, "gateway": {"enabled": True}},  # the EPP's Deployment
                 **{name: AUTOSCALING for name in ("autoscale_period", "autoscale_window", "autoscale_down_after",
                                                   "autoscale_headroom", "autoscale_burst_sigmas", "autoscale_lead",
                                                   "autoscale_prometheus", "autoscale_routers")}}
UP_CONTEXT = {"mooncake_protocol": ["--kv-transport", "mooncake"], "mooncake_devices": ["--kv-transport", "mooncake"],
              "offload_buffers": ["--offload-layers", "3,5"], "num_speculative_tokens": ["--speculative", "mtp"],
              "speculative_max_draft_tokens": ["--speculative", "mtp"], "kv_tier_dir": ["--kv-tier-tokens", "4096"],
              "kv_store_master": ["--kv-tier-tokens", "4096"], "epp_port": ["--http-port", "0"],
              **{name: ["--autoscale", "1:3"] for name in ("autoscale_period", "autoscale_window",
                                                           "autoscale_down_after", "autoscale_headroom",
                                                           "autoscale_burst_sigmas", "autoscale_lead")}}
# A value other than the default, where the type alone does not give one.
VALUES = {"autoscale": "2:6", "autoscale_prometheus": "http://prometheus.test:9090", "autoscale_routers": 'job="x"',
          "http_port": 8000, "api_key_file": "/tmp/keys.txt", "served_model_name": "deepseek-v3.2-test",
          "profile": "/tmp/profile.json", "offload_layers": "3,5", "share_weights_dir": "/tmp/weights",
          "mooncake_devices": "mlx5_0", "layer_sharding": ("o_proj",), "speculative": "mtp",
          "kv_tier_dir": "/tmp/kv-tier", "kv_store_master": "mooncake-master.pdserve:50051",
          "epp_endpoints": ("10.0.0.9:8000",)}
ISSUE = {("prefill", "no_prefix_cache"), ("decode", "no_prefix_cache"), ("router", "api_key_file"),
         ("router", "served_model_name"), ("router", "chat_max_tokens")}


def _flags() -> list[tuple[str, object]]:
    return [(role, f) for role, cls in CONFIGS.items() for f in fields(cls) if "help" in f.metadata]


def _value(f) -> object:
    """A value of the flag other than its default (and within its bounds and choices)."""
    if f.name in VALUES:
        return VALUES[f.name]
    default = None if f.default is MISSING else f.default
    if f.metadata.get("choices"):
        return next(c for c in f.metadata["choices"] if c not in (default, ""))
    kind = str(f.type)
    if kind == "bool":
        return not default
    if kind.startswith("int"):
        return (default or 0) + 1
    if kind.startswith("float"):
        return float(default or 0) + 1.0
    raise AssertionError(f"--{f.name}: give it a test value in VALUES")


def _arg(value: object) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _nest(path: tuple[str, ...], value: object) -> dict:
    out: object = list(value) if isinstance(value, tuple) else value
    if path[-1] == "layerSharding":
        out = ",".join(value)
    for key in reversed(path):
        out = {key: out}
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(w.title() for w in rest)


def _keys(role: str, name: str) -> list[tuple[str, ...]]:
    if name in CHART_KEYS:
        return [CHART_KEYS[name]]
    return [(role, _camel(name)), ("engine", _camel(name))]


def _up_reads(role: str, argv: list[str]):
    cluster = up_cluster(["--model", "m", *argv])
    extra = {"router": cluster.extra_router, "prefill": cluster.extra_prefill, "decode": cluster.extra_decode}[role]
    return PARSERS[role](BASE[role] + extra)


def _up_ways(role: str, name: str, value: object, tmp_path: Path) -> list[str]:
    """How `pdserve up` sets the flag to `value`: its own option, the deployment description, or neither."""
    ways = []
    options = {s for a in parser()._subparsers._group_actions[0].choices["up"]._actions for s in a.option_strings}
    option = UP_FLAGS.get((role, name), flag_name(name))
    if option in options:
        argv = [*UP_CONTEXT.get(name, []), option] + ([] if isinstance(value, bool) else [_arg(value)])
        if getattr(_up_reads(role, argv), name) == value:
            ways.append(option)
    for path in _keys(role, name):
        spec = tmp_path / f"{role}-{name}.yaml"
        spec.write_text(yaml.safe_dump(_nest(path, value)))
        try:
            cfg = _up_reads(role, ["--config", str(spec)])
        except ValueError:  # not a key of the description
            continue
        if getattr(cfg, name) == value:
            ways.append("--config " + ".".join(path))
    return ways


def _rendered(values: dict, role: str):
    """The config the service's parser reads from the container args the chart renders for `role`."""
    out = helm.Chart.load(CHART).render(values, name="demo", namespace="ml", is_install=True)
    module = "router" if role == "router" else f"{role}_service"
    for path, text in out.items():
        for doc in yaml.safe_load_all(text) if not path.endswith(".txt") else []:
            if doc and doc["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
                spec = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"] if doc["kind"] == "LeaderWorkerSet" \
                    else doc["spec"]["template"]
                (container,) = spec["spec"]["containers"]
                if container["command"][-1] == module:
                    return PARSERS[role]([a.replace("$(POD_IP)", "10.0.0.1") for a in container["args"]])
    raise AssertionError(f"no {role} container rendered")


def _chart_ways(role: str, name: str, value: object) -> list[str]:
    if name in CHART_DERIVED:
        values, rendered = CHART_DERIVED[name]
        return [",".join(values)] if getattr(_rendered(values, role), name) == rendered else []
    ways = []
    for path in _keys(role, name):
        values = _merge(CHART_CONTEXT.get(name, {}), _nest(path, value))
        try:
            cfg = _rendered(values, role)
        except helm.HelmRenderError:
            continue
        if getattr(cfg, name) == value:
            ways.append(".".join(path))
    return ways


def _in_values_yaml(path: str) -> bool:
    node = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_every_service_flag_is_reachable_from_pdserve_up_and_the_chart(tmp_path):
    unreachable, seen = [], set()
    for role, f in _flags():
        seen.add(f.name)
        if f.name in LAUNCHER or f.name in INTERNAL:
            continue
        value = _value(f)
        if (role, f.name) not in UP_SETS and not _up_ways(role, f.name, value, tmp_path):
            unreachable.append(f"pdserve up cannot set {role} {flag_name(f.name)}")
        ways = _chart_ways(role, f.name, value)
        if not ways:
            unreachable.append(f"the chart's values cannot set {role} {flag_name(f.name)}")
        elif f.name not in CHART_DERIVED:
            assert any(_in_values_yaml(w) for w in ways), f"{role} {flag_name(f.name)}: {ways} not in values.yaml"
    assert not unreachable, "\n".join(unreachable)
    listed = set(LAUNCHER) | set(INTERNAL) | {name for _, name in UP_SETS}
    assert listed <= seen, f"allow-listed flags no service has: {listed - seen}"


def test_the_flags_the_issue_named_are_reachable_both_ways_by_name(tmp_path):
    """--no-prefix-cache (prefill's and decode's), --api-key-file, --served-model-name and --chat-max-tokens
    (the router's): each a `pdserve up` flag of the same name and a chart value."""
    assert not {name for _, name in ISSUE} & (set(LAUNCHER) | set(INTERNAL) | {n for _, n in UP_SETS})
    flags = {(role, f.name): f for role, f in _flags() if (role, f.name) in ISSUE}
    assert set(flags) == ISSUE
    for (role, name), f in flags.items():
        assert flag_name(name) in _up_ways(role, name, _value(f), tmp_path), name
        assert _chart_ways(role, name, _value(f)), name


def test_the_charts_autoscaling_values_are_the_routers_defaults():
    """autoscaling.period / window / downAfter / headroom / burstSigmas in values.yaml are AutoscaleConfig's
    defaults (the chart renders them as the router's --autoscale-* flags)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]
    for key, name in (("period", "autoscale_period"), ("window", "autoscale_window"),
                      ("downAfter", "autoscale_down_after"), ("headroom", "autoscale_headroom"),
                      ("burstSigmas", "autoscale_burst_sigmas")):
        assert values[key] == AutoscaleConfig.__dataclass_fields__[name].default, key
