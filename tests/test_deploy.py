"""One deployment description for `pdserve up --config` and the Helm chart (issue: operations)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from router.deploy import Deployment

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "helm" / "pdserve" / "values.yaml"
SHAPE = {"engine": {"kvTransport": "tcp", "blockSize": 4, "dtype": "float32"},
         "prefill": {"instances": 2, "cp": 2, "maxPrefillTokens": 512, "kvCacheTokens": 4096},
         "decode": {"instances": 2, "dp": 2, "ep": 2, "maxNumSeqs": 64, "leaseSeconds": 20.0, "kvCacheTokens": 4096,
                    "layerSharding": "o_proj"},
         "router": {"maxConcurrentRequests": 64}}


def test_chart_defaults_are_the_deployment_defaults():
    assert Deployment.from_yaml(VALUES) == Deployment()


def test_deployment_defaults_are_the_services_flag_defaults():
    """A default description renders flags that change nothing: the services' own defaults."""
    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args
    from router.server import parse_args as router_args

    dep = Deployment()
    for role, parse in (("router", router_args), ("prefill", prefill_args), ("decode", decode_args)):
        base = ["--model", "m"] + (["--prefill", "p:1", "--decode", "d:1"] if role == "router" else [])
        plain, rendered = vars(parse(base)), vars(parse(base + dep.flags(role)))
        differ = {k for k in plain if plain[k] != rendered[k]} - {"host", "port", "advertise_host", "kv_port"}
        assert not differ, (role, {k: (plain[k], rendered[k]) for k in differ})


def test_unknown_keys_and_wrong_types_name_the_key():
    with pytest.raises(ValueError, match="decode.dpp: unknown key"):
        Deployment.from_dict({"decode": {"dpp": 2}})
    with pytest.raises(ValueError, match="prefill.cp: expected int"):
        Deployment.from_dict({"prefill": {"cp": "two"}})
    assert Deployment.from_dict({"image": {"tag": "x"}, "decode": {"resources": {}}}) == Deployment()  # k8s-only


def test_chart_and_up_render_the_same_service_flags():
    """For one description, the flags `pdserve up --config` passes and the flags the chart renders
    parse to the same service configs (host, ports and credential files aside)."""
    helm = pytest.importorskip("helm_python")
    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args
    from router.server import parse_args as router_args

    dep = Deployment.from_dict(SHAPE)
    rendered = helm.Chart.load(ROOT / "helm" / "pdserve").render(SHAPE, name="d", namespace="n")
    docs = [d for p, t in rendered.items() if not p.endswith(".txt") for d in yaml.safe_load_all(t) if d]
    per_host = {"host", "advertise_host", "port", "metrics_port", "port_file", "model", "prefill", "decode",
                "auth_token_file", "insecure", "tls_cert", "tls_key", "tls_ca"}
    parsers = {"router": router_args, "prefill_service": prefill_args, "decode_service": decode_args}
    seen = set()
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        module = container["command"][-1]
        role = module.removesuffix("_service")
        chart_cfg = parsers[module]([a.replace("$(POD_IP)", "10.0.0.1") for a in container["args"]])
        base = ["--model", "m"] + (["--prefill", "p:1", "--decode", "d:1"] if role == "router" else [])
        up_cfg = parsers[module](base + dep.flags(role))
        for name in vars(chart_cfg):
            if name not in per_host:
                assert getattr(chart_cfg, name) == getattr(up_cfg, name), (role, name)
        seen.add(role)
    assert seen == {"router", "prefill", "decode"}


def test_up_runs_a_deployment_file(served_model, tmp_path):
    """`pdserve up --config` semantics: the description's shape runs locally and serves."""
    from router.cli import cluster_from_deployment
    from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc

    spec = tmp_path / "deploy.yaml"
    spec.write_text(yaml.safe_dump({"engine": {"dtype": "float32", "blockSize": 4},
                                    "decode": {"maxNumSeqs": 8, "kvCacheTokens": 256, "leaseSeconds": 7.0},
                                    "router": {"port": 0, "maxConcurrentRequests": 4}}))
    dep = Deployment.from_yaml(spec)
    with cluster_from_deployment(dep, str(served_model), tmp_path / "logs") as c:
        with c.channel(c.address) as ch:
            msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                prompt_token_ids=[3, 4, 5], sampling_params=generation_pb2.SamplingParams(
                    max_tokens=3, temperature=0.0, ignore_eos=True)), timeout=60))
        assert sum(len(m.token_ids) for m in msgs) == 3
        with c.channel(c.decode_addrs[0]) as ch:
            load = internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=10)
        assert load.total_blocks == 256 // 4  # the description's pool (kvCacheTokens / blockSize)
