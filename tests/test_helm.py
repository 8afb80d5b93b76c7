"""The Helm chart (issue: operations), rendered and linted with Helm's own Go code (helm-python-sdk,
no helm binary or cluster here): every rendered object validates strictly against the Kubernetes
1.30 schemas, the container args of every service parse with that service's own argument parser,
and the ranks of every instance add up to its parallel shape (no drift between chart and CLI)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from router.deploy import Deployment
from router.perf import PerfModel
from router.server import parse_args as router_args
from shared.config import ServiceConfig, knob_choices

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[1] / "helm" / "pdserve"
KUBE = "1.30.0"
CASES = {
    "defaults": {},
    "M2-N4-cp2-dp4-ep4": {"prefill": {"instances": 2, "cp": 2}, "decode": {"instances": 4, "dp": 4, "ep": 4,
                                                                           "layerSharding": "o_proj,q_b_proj"}},
    "tls-monitoring-mooncake": {"tls": {"enabled": True, "secretName": "pdserve-tls"}, "monitoring": {"enabled": True},
                                "engine": {"kvTransport": "mooncake"}, "auth": {"existingSecret": "my-token"},
                                "model": {"source": "uri", "uri": {"url": "https://example.com/m.tar"}}},
    "lws-tp2": {"lws": {"enabled": True}, "prefill": {"tp": 2}, "decode": {"tp": 2}},
    "mooncake-rdma-hostnet": {"engine": {"kvTransport": "mooncake",
                                         "mooncake": {"protocol": "rdma", "hostNetwork": True}},
                              "decode": {"dp": 2, "resources": {"limits": {"nvidia.com/gpu": 8}}}},
    "w8a8-c8-offload-shared": {"engine": {"quantization": "w8a8", "kvCacheDtype": "int8", "offloadLayers": "2-10",
                                          "offloadBuffers": 3, "shareWeights": True},
                               "decode": {"dp": 2}},
    "http-keys-profile-no-prefix-cache": {"router": {"replicas": 2, "httpPort": 8000, "apiKeySecret": "keys",
                                                     "profileJson": "{}", "servedModelName": "dsv32",
                                                     "chatMaxTokens": 512},
                                          "prefill": {"noPrefixCache": True}},
    "gateway-kserve": {"router": {"httpPort": 8000, "kservePort": 8001}, "gateway": {"enabled": True,
                                                                                   "gatewayNamespace": "infra"}},
}
CUSTOM = {"PodMonitor", "LeaderWorkerSet", "InferencePool", "HTTPRoute"}  # CRDs, not in the core schemas
CRDS = Path(__file__).resolve().parent / "data" / "crds"  # the Gateway API's and its inference extension's
CRD_SCHEMAS = {"InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
               "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml"}


def _crd_schema(kind: str, api_version: str) -> dict:
    """The vendored CRD's OpenAPI v3 schema for `api_version` (tests/data/crds)."""
    crd = yaml.safe_load((CRDS / CRD_SCHEMAS[kind]).read_text())
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


def _render(values: dict) -> list[dict]:
    out = helm.Chart.load(CHART).render(values, name="demo", namespace="ml", is_install=True)
    return [doc for path, text in out.items() if not path.endswith(".txt")
            for doc in yaml.safe_load_all(text) if doc]


def _containers(doc: dict) -> list[dict]:
    if doc["kind"] == "LeaderWorkerSet":
        return doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    return doc["spec"]["template"]["spec"]["containers"]


def _args(container: dict) -> list[str]:
    return [a.replace("$(POD_IP)", "10.1.2.3") for a in container["args"]]


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{KUBE}")
    assert not report["errors"] and all(m["severity"] < 2 for m in report["messages"]), report


@pytest.mark.parametrize("name", list(CASES))
def test_rendered_objects_validate_and_args_parse(name):
    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args
    from router.server import parse_args as router_args

    values = helm.Chart.load(CHART).merge_values(CASES[name])
    docs = _render(CASES[name])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    assert ("Secret" in kinds) == (not values["auth"]["existingSecret"])
    assert ("PodMonitor" in kinds) == values["monitoring"]["enabled"]
    for doc in docs:
        if doc["kind"] not in CUSTOM:
            kubernetes_validate.validate(doc, KUBE, strict=True)
        elif doc["kind"] in CRD_SCHEMAS:  # the extension's and the Gateway API's own schemas
            jsonschema.Draft7Validator(_crd_schema(doc["kind"], doc["apiVersion"])).validate(doc)
        elif doc["kind"] == "LeaderWorkerSet":  # no CRD schema offline: its pod template is a core one
            lwt = doc["spec"]["leaderWorkerTemplate"]
            assert set(lwt) <= {"size", "restartPolicy", "workerTemplate", "leaderTemplate"}
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": lwt["workerTemplate"]}, KUBE, strict=True)
        else:  # PodMonitor: the fields the Prometheus operator reads
            assert set(doc["spec"]) == {"selector", "podMetricsEndpoints"}
            assert doc["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    parsers = {"router": router_args, "prefill_service": prefill_args, "decode_service": decode_args}
    instances = {"prefill": 0, "decode": 0}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
            continue
        (container,) = _containers(doc)
        module = container["command"][-1]
        cfg = parsers[module](_args(container))  # the service's own parser accepts every rendered flag
        if module == "router":
            assert len(cfg.prefill) == values["prefill"]["instances"]
            assert len(cfg.decode) == values["decode"]["instances"]
            assert {a.rpartition(":")[0] for a in cfg.prefill + cfg.decode} <= services
            continue
        role = module.removesuffix("_service")
        instances[role] += 1
        spec = values[role]
        assert cfg.world == (spec["cp"] if role == "prefill" else spec["dp"]) * spec["tp"]
        ranks = (doc["spec"]["leaderWorkerTemplate"]["size"] if doc["kind"] == "LeaderWorkerSet"
                 else doc["spec"]["replicas"])
        assert ranks == cfg.world  # one pod per rank
        env = {e["name"] for e in container["env"]}
        assert ({"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= env) == (cfg.world > 1)
        assert cfg.kv_transport == values["engine"]["kvTransport"] and cfg.host == "10.1.2.3"
        assert cfg.public_host == "10.1.2.3"  # peers reach the pod address, never loopback
        if values["tls"]["enabled"]:
            assert cfg.tls_ca == "/etc/pdserve/tls/ca.crt"
            assert "exec" in container["readinessProbe"]  # the kubelet's gRPC probe cannot do mTLS
        else:
            assert container["readinessProbe"]["grpc"]["port"] == spec["port"]
            # liveness is not readiness: a pod waiting for its peers, or draining, is not restarted
            assert container["livenessProbe"]["grpc"] == {"port": spec["port"], "service": "pdserve.liveness"}
            assert "service" not in container["readinessProbe"]["grpc"]
    assert instances == {"prefill": values["prefill"]["instances"], "decode": values["decode"]["instances"]}


def test_probe_command_is_the_package_module(served_model, tmp_path):
    """The TLS probe the chart renders is a real command: it reports SERVING for a live service."""
    import subprocess
    import sys

    from router.cluster import Cluster

    with Cluster(str(served_model), dtype="float32", tls=True, log_dir=tmp_path / "logs") as c:
        ok = subprocess.run([sys.executable, "-m", "shared.rpc.probe", c.decode_addrs[0], *c.certs.flags()],
                            capture_output=True, text=True, timeout=60)
        alive = subprocess.run([sys.executable, "-m", "shared.rpc.probe", c.decode_addrs[0], *c.certs.flags(),
                                "--service", "pdserve.liveness"], capture_output=True, text=True, timeout=60)
        plain = subprocess.run([sys.executable, "-m", "shared.rpc.probe", c.decode_addrs[0]],
                               capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    assert alive.returncode == 0 and "SERVING" in alive.stdout  # the liveness probe's service
    assert plain.returncode == 1  # no certificate: the decode port refuses the handshake


def _engine_pods(docs: list[dict]) -> dict[str, list[dict]]:
    """role → the pod specs of its instances (StatefulSet or LeaderWorkerSet)."""
    pods: dict[str, list[dict]] = {"prefill": [], "decode": []}
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            spec = doc["spec"]["template"]["spec"]
        elif doc["kind"] in CRD_SCHEMAS:  # the extension's and the Gateway API's own schemas
            jsonschema.Draft7Validator(_crd_schema(doc["kind"], doc["apiVersion"])).validate(doc)
        elif doc["kind"] == "LeaderWorkerSet":
            spec = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        else:
            continue
        (container,) = spec["containers"]
        pods[container["command"][-1].removesuffix("_service")].append(spec)
    return pods


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("lws", [False, True])
def test_engine_quantization_offload_and_shared_weights_render_into_both_services(lws):
    """engine.quantization / kvCacheDtype / offloadLayers / offloadBuffers / shareWeights reach prefill and
    decode alike (one KV cache dtype for both: they must agree), and shareWeights mounts a memory emptyDir
    at /dev/shm for --share-weights-dir /dev/shm/pdserve."""
    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args

    values = {"engine": {"quantization": "w8a8", "kvCacheDtype": "int8", "offloadLayers": "3,5,7",
                         "offloadBuffers": 3, "shareWeights": True},
              "prefill": {"instances": 2}, "decode": {"instances": 2, "dp": 2}, "lws": {"enabled": lws}}
    pods = _engine_pods(_render(values))
    assert len(pods["prefill"]) == 2 and len(pods["decode"]) == 2
    parsers = {"prefill": prefill_args, "decode": decode_args}
    kv_dtypes = set()
    for role, specs in pods.items():
        for spec in specs:
            (container,) = spec["containers"]
            args = _args(container)
            assert _flag(args, "--quantization") == "w8a8"
            assert _flag(args, "--kv-cache-dtype") == "int8"
            assert _flag(args, "--offload-layers") == "3,5,7" and _flag(args, "--offload-buffers") == "3"
            assert _flag(args, "--share-weights-dir") == "/dev/shm/pdserve"
            cfg = parsers[role](args)
            assert (cfg.quantization, cfg.offload_layers, cfg.offload_buffers) == ("w8a8", "3,5,7", 3)
            assert cfg.share_weights_dir == "/dev/shm/pdserve"
            kv_dtypes.add(cfg.kv_cache_dtype)
            assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
            assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert kv_dtypes == {"int8"}  # prefill and decode agree

    router = next(d for d in _render(values) if d["kind"] == "Deployment")
    assert all(v["name"] != "shm" for v in router["spec"]["template"]["spec"]["volumes"])  # engines only


def test_engine_defaults_render_no_offload_and_no_shared_weights():
    for role, specs in _engine_pods(_render({})).items():
        for spec in specs:
            (container,) = spec["containers"]
            args = _args(container)
            assert _flag(args, "--quantization") == "auto" and _flag(args, "--kv-cache-dtype") == "auto", role
            assert not {"--offload-layers", "--offload-buffers", "--share-weights-dir"} & set(args), role
            assert all(v["name"] != "shm" for v in spec["volumes"]), role


def test_share_weights_dir_overrides_the_shm_default():
    values = {"engine": {"shareWeightsDir": "/var/lib/pdserve/weights"}}
    for specs in _engine_pods(_render(values)).values():
        for spec in specs:
            (container,) = spec["containers"]
            assert _flag(_args(container), "--share-weights-dir") == "/var/lib/pdserve/weights"
            assert all(v["name"] != "shm" for v in spec["volumes"])  # a directory of the user's own


def test_chart_choices_are_the_services_choices():
    """Every value the services accept renders; the chart's lists are the flags' choices (no drift)."""
    for key, name in (("quantization", "quantization"), ("kvCacheDtype", "kv_cache_dtype")):
        for value in knob_choices(ServiceConfig, name):
            pods = _engine_pods(_render({"engine": {key: value}}))
            flag = "--" + name.replace("_", "-")
            assert {_flag(_args(s["containers"][0]), flag) for specs in pods.values() for s in specs} == {value}
        choices = ", ".join(knob_choices(ServiceConfig, name))
        with pytest.raises(helm.HelmRenderError, match=rf"engine.{key}: expected one of {choices}, got \"bogus\""):
            _render({"engine": {key: "bogus"}})


def test_speculative_renders_into_both_services():
    """engine.speculative: mtp with numSpeculativeTokens reaches prefill (the MTP layer's cache) and decode, and
    decode.speculativeMaxDraftTokens reaches decode (only with speculative set)."""
    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args

    parsers = {"prefill": prefill_args, "decode": decode_args}
    values = {"engine": {"speculative": "mtp", "numSpeculativeTokens": 3}, "decode": {"speculativeMaxDraftTokens": 5}}
    for role, specs in _engine_pods(_render(values)).items():
        for spec in specs:
            cfg = parsers[role](_args(spec["containers"][0]))
            assert (cfg.speculative, cfg.num_speculative_tokens) == ("mtp", 3), role
            if role == "decode":
                assert cfg.speculative_max_draft_tokens == 5
    for specs in _engine_pods(_render({})).values():
        assert all("--speculative" not in " ".join(_args(s["containers"][0])) for s in specs)


@pytest.mark.parametrize(("engine", "message"), [
    ({"offloadLayers": "3-x"}, r"engine.offloadLayers: \"3-x\" is not a layer list"),
    ({"offloadLayers": "all", "offloadBuffers": 0}, "engine.offloadBuffers: expected a positive integer, got 0"),
    ({"offloadLayers": "1", "offloadBuffers": 1.5}, "engine.offloadBuffers: expected a positive integer, got 1.5"),
    ({"speculative": "eagle"}, r"engine.speculative: expected one of mtp, got \"eagle\""),
    ({"speculative": "mtp", "numSpeculativeTokens": 4}, "engine.numSpeculativeTokens: expected 1..3, got 4"),
    ({"speculative": "mtp", "numSpeculativeTokens": 1.5}, "engine.numSpeculativeTokens: expected 1..3, got 1.5"),
    ({"kvStoreMaster": "master:50051"}, "engine.kvStoreMaster: the store holds the second tier"),
])
def test_invalid_engine_values_fail_naming_the_key(engine, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        _render({"engine": engine})


def test_mooncake_rdma_pods_request_the_device_and_may_lock_memory():
    """engine.mooncake.protocol rdma: every prefill/decode rank pod requests the documented RDMA resource
    (beside its own limits), gets IPC_LOCK as root (memory registration pins the pool) and, when asked, the
    host network; its services get --mooncake-protocol rdma --mooncake-devices. The router pod gets none of
    it, and neither does any pod under the default tcp transport."""
    from decode_service.server import parse_args as decode_args

    rdma = {"kvTransport": "mooncake", "mooncake": {"protocol": "rdma", "devices": "mlx5_0", "hostNetwork": True}}
    pods = _engine_pods(_render({"engine": rdma, "decode": {"resources": {"limits": {"nvidia.com/gpu": 8}}}}))
    for role, specs in pods.items():
        for spec in specs:
            (c,) = spec["containers"]
            assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1, role
            assert c["securityContext"] == {"runAsUser": 0, "capabilities": {"add": ["IPC_LOCK"]}}
            assert spec["hostNetwork"] and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            assert _flag(_args(c), "--mooncake-protocol") == "rdma"
            assert _flag(_args(c), "--mooncake-devices") == "mlx5_0"
    assert pods["decode"][0]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert decode_args(_args(pods["decode"][0]["containers"][0])).mooncake_protocol == "rdma"
    router = next(d for d in _render({"engine": rdma}) if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "hostNetwork" not in router and "securityContext" not in router["containers"][0]
    for specs in _engine_pods(_render({})).values():
        for spec in specs:
            assert "hostNetwork" not in spec and "securityContext" not in spec["containers"][0]
            assert "--mooncake-protocol" not in _args(spec["containers"][0])


@pytest.mark.parametrize(("engine", "message"), [
    ({"mooncake": {"protocol": "rdma"}}, "engine.mooncake.protocol: rdma needs engine.kvTransport: mooncake"),
    ({"kvTransport": "mooncake", "mooncake": {"protocol": "ib"}},
     r"engine.mooncake.protocol: expected one of tcp, rdma, got \"ib\""),
    ({"kvTransport": "nixl"}, r"engine.kvTransport: expected one of tcp, mooncake, got \"nixl\""),
])
def test_invalid_transport_values_fail_naming_the_key(engine, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        _render({"engine": engine})


def test_http_port_renders_the_flag_a_container_port_and_a_service_port():
    docs = _render({"router": {"httpPort": 8000}})
    router = next(d for d in docs if d["kind"] == "Deployment")
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args = _args(container)
    assert _flag(args, "--http-port") == "8000"
    assert router_args([*args, "--model", "m", "--prefill", "a", "--decode", "b"]).http_port == 8000
    assert {"name": "http", "containerPort": 8000} in container["ports"]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-router"))
    assert any(p["name"] == "http" and p["port"] == 8000 for p in service["spec"]["ports"])
    assert Deployment.from_dict({"router": {"httpPort": 8000}}).flags("router")[-2:] == ["--http-port", "8000"]
    default = next(d for d in _render({}) if d["kind"] == "Deployment")
    assert "--http-port" not in _args(default["spec"]["template"]["spec"]["containers"][0])


def test_autoscaling_renders_one_leaderworkerset_per_pool_scaled_by_keda_to_the_routers_decision():
    """autoscaling.enabled: each pool one LeaderWorkerSet (its groups the instances), found by the router
    through the leaders' headless Service, sized by a KEDA ScaledObject to pdserve_router_desired_instances;
    rolling updates surge before they drain; PodDisruptionBudgets hold one disruption at a time."""
    values = {"lws": {"enabled": True}, "autoscaling": {"enabled": True, "min": 1, "max": 5},
              "prefill": {"instances": 2}, "decode": {"instances": 3, "dp": 2}}
    docs = _render(values)
    pools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "LeaderWorkerSet"}
    assert {n: d["spec"]["replicas"] for n, d in pools.items()} == {"demo-pdserve-prefill": 2, "demo-pdserve-decode": 3}
    assert all(d["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] == 0
               for d in pools.values())
    for doc in pools.values():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]}, KUBE,
                                     strict=True)
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == set(pools)
    for name, doc in scaled.items():
        pool = name.rsplit("-", 1)[1]
        assert (doc["spec"]["minReplicaCount"], doc["spec"]["maxReplicaCount"]) == (1, 5)
        trigger = doc["spec"]["triggers"][0]
        assert trigger["type"] == "prometheus" and f'pool="{pool}"' in trigger["metadata"]["query"]
        assert "pdserve_router_desired_instances" in trigger["metadata"]["query"]
    router = next(d for d in docs if d["kind"] == "Deployment")
    assert router["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    cfg = router_args(_args(router["spec"]["template"]["spec"]["containers"][0]))
    assert cfg.autoscale == "1:5" and cfg.prefill[0].startswith("dns:demo-pdserve-prefill-leaders:")
    assert cfg.decode[0].startswith("dns:demo-pdserve-decode-leaders:")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for pool in ("prefill", "decode"):
        leaders = services[f"demo-pdserve-{pool}-leaders"]
        kubernetes_validate.validate(leaders, KUBE, strict=True)
        assert leaders["spec"]["clusterIP"] == "None"
        assert leaders["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"} >= {
        "demo-pdserve-prefill", "demo-pdserve-decode"}
    with pytest.raises(helm.HelmRenderError, match="autoscaling.enabled needs lws.enabled"):
        _render({"autoscaling": {"enabled": True}})


def test_several_routers_decide_on_the_load_of_all_of_them_and_keda_takes_their_decision():
    """With autoscaling every router reads the fleet's load from the Prometheus KEDA reads (its counters
    summed over the release's routers, --autoscale-routers) and plans decode instances of decode.dp ranks;
    KEDA's query selects the same routers' decisions (max: they agree). The autoscaler's knobs are values."""
    values = {"lws": {"enabled": True}, "router": {"replicas": 3}, "decode": {"dp": 4},
              "autoscaling": {"enabled": True, "prometheusAddress": "http://prom.monitoring:9090", "period": 10,
                              "window": 300, "downAfter": 60, "headroom": 1.5, "burstSigmas": 2}}
    docs = _render(values)
    router = next(d for d in docs if d["kind"] == "Deployment")
    assert router["spec"]["replicas"] == 3
    cfg = router_args(_args(router["spec"]["template"]["spec"]["containers"][0]))
    selector = 'namespace="ml",pod=~"demo-pdserve-router-.+"'
    assert (cfg.autoscale_prometheus, cfg.autoscale_routers, cfg.decode_dp) == ("http://prom.monitoring:9090",
                                                                                  selector, 4)
    assert (cfg.autoscale_period, cfg.autoscale_window, cfg.autoscale_down_after, cfg.autoscale_headroom,
            cfg.autoscale_burst_sigmas) == (10.0, 300.0, 60.0, 1.5, 2.0)
    scaler = cfg.autoscaler(PerfModel())
    assert scaler.ranks == 4 and scaler.fleet is not None and scaler.burst_sigmas == 2.0
    assert all(selector in q and "[300s]" in q for q in scaler.fleet.queries().values())
    for doc in (d for d in docs if d["kind"] == "ScaledObject"):
        pool = doc["spec"]["scaleTargetRef"]["name"].rsplit("-", 1)[1]
        trigger = doc["spec"]["triggers"][0]["metadata"]
        assert trigger["serverAddress"] == "http://prom.monitoring:9090"
        assert trigger["query"] == f'max(pdserve_router_desired_instances{{pool="{pool}",{selector}}})'
    own = _render(_merge_values(values, {"autoscaling": {"routerSelector": 'job="pdserve"'}}))
    cfg = router_args(_args(next(d for d in own if d["kind"] == "Deployment")["spec"]["template"]["spec"]
                            ["containers"][0]))
    assert cfg.autoscale_routers == 'job="pdserve"'
    assert all('{pool="prefill",job="pdserve"}' in d["spec"]["triggers"][0]["metadata"]["query"]
               for d in own if d["kind"] == "ScaledObject" and d["metadata"]["name"].endswith("prefill"))


def _merge_values(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge_values(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_the_http_api_keys_come_from_a_mounted_secret():
    """router.apiKeySecret: the Secret's key api-keys mounted read-only into the router pods and named by
    --api-key-file; without it the HTTP API is open and the release notes say so; a local path
    (router.apiKeyFile, for `pdserve up --config`) is refused in the cluster, naming the value to use."""
    docs = _render({"router": {"httpPort": 8000, "apiKeySecret": "pdserve-api-keys"}})
    spec = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    path = _flag(_args(container), "--api-key-file")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert (mount["mountPath"], mount["readOnly"]) == ("/etc/pdserve/api-keys", True)
    volume = next(v for v in spec["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "pdserve-api-keys", "items": [{"key": "api-keys", "path": "api-keys"}]}
    assert path == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    notes = helm.Chart.load(CHART).render({"router": {"httpPort": 8000}}, name="demo", namespace="ml")
    assert "WARNING: no API keys" in next(t for p, t in notes.items() if p.endswith("NOTES.txt"))
    open_api = next(d for d in _render({"router": {"httpPort": 8000}}) if d["kind"] == "Deployment")
    assert "--api-key-file" not in _args(open_api["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(helm.HelmRenderError, match="router.apiKeyFile is a path .* set router.apiKeySecret"):
        _render({"router": {"apiKeyFile": "/home/me/keys.txt"}})


def test_a_profile_rides_in_the_releases_configmap_and_restarts_the_routers_when_it_changes():
    profile = '{"prefill_base_s": 0.01, "decode_base_s": 0.02}'
    docs = _render({"router": {"profileJson": profile}})
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert config["data"]["profile.json"] == profile
    assert "profileJson" not in config["data"]["deployment.yaml"]  # the description names no content twice
    template = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert router_args(_args(container)).profile == "/etc/pdserve/profile/profile.json"
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "profile")
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    other = next(d for d in _render({"router": {"profileJson": "{}"}}) if d["kind"] == "Deployment")
    assert other["spec"]["template"]["metadata"]["annotations"]["checksum/profile"] != \
        template["metadata"]["annotations"]["checksum/profile"]
    with pytest.raises(helm.HelmRenderError, match="router.profile is a path .* set router.profileJson"):
        _render({"router": {"profile": "/home/me/profile.json"}})


def test_no_prefix_cache_renders_into_prefill_only():
    from prefill_service.server import parse_args as prefill_args

    pods = _engine_pods(_render({"prefill": {"noPrefixCache": True}}))
    assert prefill_args(_args(pods["prefill"][0]["containers"][0])).no_prefix_cache
    assert "--no-prefix-cache" not in _args(pods["decode"][0]["containers"][0])
    assert all("--no-prefix-cache" not in _args(s["containers"][0]) for s in _engine_pods(_render({}))["prefill"])


def test_gateway_resources_on_and_off():
    """gateway.enabled renders the InferencePool over the router pods' HTTP port, its endpoint picker (a router
    with --epp-port naming the router pods) and an HTTPRoute to the pool; off, none of them; without the HTTP API
    the render fails naming router.httpPort."""
    assert not {"InferencePool", "HTTPRoute"} & {d["kind"] for d in _render({})}
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _render(CASES["gateway-kserve"])}
    pool = docs["InferencePool", "demo-pdserve"]["spec"]
    assert pool["targetPorts"] == [{"number": 8000}]
    assert pool["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    epp_service = docs["Service", pool["endpointPickerRef"]["name"]]
    assert epp_service["spec"]["ports"][0]["port"] == pool["endpointPickerRef"]["port"]["number"] == 9002
    (epp,) = _containers(docs["Deployment", "demo-pdserve-epp"])
    cfg = router_args(_args(epp))
    assert cfg.epp_port == 9002 and cfg.epp_endpoints == ["dns:demo-pdserve-router-pods:8000"]
    assert docs["Service", "demo-pdserve-router-pods"]["spec"]["clusterIP"] == "None"
    route = docs["HTTPRoute", "demo-pdserve"]["spec"]
    assert route["parentRefs"][0] == {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                      "name": "inference-gateway", "namespace": "infra"}
    assert route["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": "demo-pdserve"}]
    (router,) = _containers(docs["Deployment", "demo-pdserve-router"])
    assert router_args(_args(router)).kserve_port == 8001 and "--epp-port" not in router["args"]
    assert {"name": "kserve", "port": 8001, "targetPort": "kserve", "appProtocol": "grpc"} in \
        docs["Service", "demo-pdserve-router"]["spec"]["ports"]
    with pytest.raises(Exception, match="router.httpPort"):
        _render({"gateway": {"enabled": True}})
    bad = {"router": {"httpPort": 8000}, "gateway": {"enabled": True, "failureMode": "Sometimes"}}
    with pytest.raises(Exception, match="gateway.failureMode"):
        _render(bad)
