"""One deployment description for `pdserve up --config` and the Helm chart (issue: operations)."""

from __future__ import annotations

import subprocess
import sys
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
ENGINE = {"quantization": "w8a8", "kvCacheDtype": "int8", "offloadLayers": "2-10,12", "offloadBuffers": 3,
          "shareWeights": True, "speculative": "mtp", "numSpeculativeTokens": 2}


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


def test_mooncake_protocol_and_devices_render_into_both_services():
    """engine.mooncake.protocol/devices reach prefill and decode with the Mooncake transport (the chart-only
    keys rdmaResource / hostNetwork are accepted); rdma over the tcp transport is refused naming the key."""
    dep = Deployment.from_dict({"engine": RDMA})
    for role in ("prefill", "decode"):
        flags = dep.flags(role)
        assert _flag(flags, "--mooncake-protocol") == "rdma" and _flag(flags, "--mooncake-devices") == "mlx5_0,mlx5_1"
    assert "--mooncake-protocol" not in Deployment().flags("decode")  # tcp transport: nothing to say
    with pytest.raises(ValueError, match="engine.mooncake.protocol: rdma needs engine.kvTransport: mooncake"):
        Deployment.from_dict({"engine": {"mooncake": {"protocol": "rdma"}}})
    with pytest.raises(ValueError, match="engine.mooncake.protocol: expected one of tcp, rdma, got 'ib'"):
        Deployment.from_dict({"engine": {"kvTransport": "mooncake", "mooncake": {"protocol": "ib"}}})


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def test_engine_quantization_offload_and_shared_weights_render_into_both_services():
    dep = Deployment.from_dict({"engine": ENGINE})
    for role in ("prefill", "decode"):
        flags = dep.flags(role)
        assert _flag(flags, "--quantization") == "w8a8" and _flag(flags, "--kv-cache-dtype") == "int8", role
        assert _flag(flags, "--offload-layers") == "2-10,12" and _flag(flags, "--offload-buffers") == "3", role
        assert _flag(flags, "--share-weights-dir") == "/dev/shm/pdserve", role
        assert _flag(flags, "--speculative") == "mtp" and _flag(flags, "--num-speculative-tokens") == "2", role
    assert _flag(dep.flags("decode"), "--speculative-max-draft-tokens") == "16"  # decode's own, its default
    assert "--speculative-max-draft-tokens" not in dep.flags("prefill")
    capped = Deployment.from_dict({"engine": ENGINE, "decode": {"speculativeMaxDraftTokens": 0}})
    assert _flag(capped.flags("decode"), "--speculative-max-draft-tokens") == "0"
    with pytest.raises(ValueError, match="speculativeMaxDraftTokens"):
        Deployment.from_dict({"decode": {"speculativeMaxDraftTokens": -1}})
    assert "--quantization" not in dep.flags("router")
    assert "--speculative" not in Deployment().flags("decode")
    explicit = Deployment.from_dict({"engine": {"shareWeightsDir": "/tmp/w"}})  # a directory implies sharing
    assert _flag(explicit.flags("decode"), "--share-weights-dir") == "/tmp/w"


def test_engine_defaults_render_no_offload_and_no_shared_weights():
    for role in ("prefill", "decode"):
        flags = Deployment().flags(role)
        assert _flag(flags, "--quantization") == "auto" and _flag(flags, "--kv-cache-dtype") == "auto"
        assert not {"--offload-layers", "--offload-buffers", "--share-weights-dir"} & set(flags)
    # offloadBuffers alone changes nothing: it is rendered only with offloadLayers
    assert "--offload-buffers" not in Deployment.from_dict({"engine": {"offloadBuffers": 4}}).flags("decode")


@pytest.mark.parametrize(("engine", "message"), [
    ({"quantization": "fp4"}, "engine.quantization: expected one of auto, none, w8a8"),
    ({"kvCacheDtype": "fp8"}, "engine.kvCacheDtype: expected one of auto, int8, got 'fp8'"),
    ({"dtype": "half"}, "engine.dtype: expected one of"),
    ({"offloadLayers": "3-x"}, "engine.offloadLayers: '3-x' is not a layer index or range"),
    ({"offloadLayers": "10-2"}, "engine.offloadLayers: range 10-2 is empty"),
    ({"offloadLayers": 5}, "engine.offloadLayers: expected str"),
    ({"offloadBuffers": 0}, "engine.offloadBuffers: expected at least 1, got 0"),
    ({"offloadBuffers": "2"}, "engine.offloadBuffers: expected int"),
    ({"shareWeights": "yes"}, "engine.shareWeights: expected bool"),
    ({"shareWeightsDirectory": "/x"}, "engine.shareWeightsDirectory: unknown key"),
    ({"speculative": "eagle"}, "engine.speculative: expected one of , mtp, got 'eagle'"),
    ({"speculative": "mtp", "numSpeculativeTokens": 4}, "engine.numSpeculativeTokens: expected 1..3, got 4"),
])
def test_invalid_engine_values_name_the_key(engine, message):
    with pytest.raises(ValueError, match=message):
        Deployment.from_dict({"engine": engine})


def test_up_passes_engine_values_to_prefill_and_decode():
    """`pdserve up` (flags or --config): both services of the local cluster get the same engine flags."""
    from router.cluster import cluster_from_deployment

    c = cluster_from_deployment(Deployment.from_dict({"engine": ENGINE}), "m")
    assert (c.quantization, c.kv_cache_dtype, c.offload_layers, c.offload_buffers, c.share_weights_dir) == (
        "w8a8", "int8", "2-10,12", 3, "/dev/shm/pdserve")
    for extra in (c.extra_prefill, c.extra_decode):
        assert _flag(extra, "--quantization") == "w8a8" and _flag(extra, "--kv-cache-dtype") == "int8"
        assert _flag(extra, "--offload-layers") == "2-10,12" and _flag(extra, "--share-weights-dir")
        assert _flag(extra, "--speculative") == "mtp" and _flag(extra, "--num-speculative-tokens") == "2"


RDMA = {"kvTransport": "mooncake", "mooncake": {"protocol": "rdma", "devices": "mlx5_0,mlx5_1",
                                                 "rdmaResource": "rdma/hca", "hostNetwork": True}}


ROUTER_AND_CACHES = {**SHAPE, "router": {**SHAPE["router"], "servedModelName": "dsv32", "chatMaxTokens": 512,
                                          "httpPort": 8000},
                     "prefill": {**SHAPE["prefill"], "noPrefixCache": True},
                     "decode": {**SHAPE["decode"], "kvStallSeconds": 2.5, "reserveWaitSeconds": 0.0}}


@pytest.mark.parametrize("shape", [SHAPE, {**SHAPE, "engine": {**SHAPE["engine"], **ENGINE}},
                                   {**SHAPE, "engine": {**SHAPE["engine"], **RDMA}}, ROUTER_AND_CACHES],
                         ids=["shape", "w8a8-c8-offload-shared", "mooncake-rdma", "router-and-caches"])
def test_chart_and_up_render_the_same_service_flags(shape):
    """For one description, the flags `pdserve up --config` passes and the flags the chart renders
    parse to the same service configs (host, ports and credential files aside)."""
    helm = pytest.importorskip("helm_python")
    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args
    from router.server import parse_args as router_args

    dep = Deployment.from_dict(shape)
    rendered = helm.Chart.load(ROOT / "helm" / "pdserve").render(shape, name="d", namespace="n")
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
    from router.cluster import cluster_from_deployment
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


@pytest.mark.parametrize(("flags", "why"), [
    (["--num-prefill", "0"], "prefill.instances: expected at least 1, got 0"),
    (["--num-decode", "-1"], "decode.instances: expected at least 1, got -1"),
    (["--prefill-cp", "0"], "prefill.cp: expected at least 1, got 0"),
    (["--decode-dp", "0"], "decode.dp: expected at least 1, got 0"),
    (["--decode-ep", "0"], "decode.ep: expected at least 1, got 0")])
def test_pdserve_up_refuses_an_empty_pool_or_rank_count_before_starting_anything(flags, why):
    """(Before: the services started, then one exited and `pdserve up` ended in a traceback.)"""
    done = subprocess.run([sys.executable, "-m", "router.cli", "up", *flags, "--port", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and f"error: {why}" in done.stderr, done.stderr
    assert "starting" not in done.stdout and "Traceback" not in done.stderr
