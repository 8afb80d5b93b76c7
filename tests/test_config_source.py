"""One config source: every knob is declared once, on its config dataclass (shared/config/, the
router's RouterConfig), and everything else is derived from or checked against that declaration:
the services' parsers, `pdserve up`, the deployment description and the chart's values.yaml."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router.cli import parser as pdserve_parser
from router.deploy import KUBERNETES_ONLY, Deployment, EngineSpec, _camel
from router.server import RouterConfig
from shared.config import DecodeConfig, EngineConfig, PrefillConfig, ServiceConfig, knob_default, parse_flags

ROOT = Path(__file__).resolve().parents[1]
VALUES = yaml.safe_load((ROOT / "helm/pdserve/values.yaml").read_text())


def _spec_pairs(spec: type, values: dict, where: str) -> list[tuple[str, object, object]]:
    """(values.yaml key, its value, the dataclass default) for every field of `spec`, recursively."""
    out = []
    for f in dataclasses.fields(spec):
        key = _camel(f.name)
        assert key in values, f"values.yaml has no {where}{key} (the deployment description declares it)"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += _spec_pairs(type(default), values[key], f"{where}{key}.")
        else:
            out.append((f"{where}{key}", values[key], default))
    return out


def test_values_yaml_agrees_with_the_dataclasses():
    """Every key of the deployment description is in values.yaml with the dataclasses' default, and
    every values.yaml key of those sections is either declared or Kubernetes-only."""
    pairs = []
    for section in dataclasses.fields(Deployment):
        spec = section.default_factory  # type: ignore[misc]
        pairs += _spec_pairs(spec, VALUES[section.name], f"{section.name}.")
        known = {_camel(f.name) for f in dataclasses.fields(spec)}
        stray = set(VALUES[section.name]) - known - KUBERNETES_ONLY
        assert not stray, f"values.yaml {section.name}: keys no dataclass declares: {sorted(stray)}"
    wrong = [(key, value, default) for key, value, default in pairs
             if value != default and not (isinstance(default, float) and value == int(default))]
    assert not wrong, f"values.yaml disagrees with the dataclasses (key, values.yaml, default): {wrong}"
    assert len(pairs) > 30


@pytest.mark.parametrize("name", ["dtype", "indexer_numerics", "quantization", "kv_cache_dtype", "offload_layers",
                                  "offload_buffers", "speculative", "num_speculative_tokens", "block_size",
                                  "kv_cache_tokens"])
def test_every_front_takes_the_engine_default(name):
    """The engine's default is the services', `pdserve up`'s, the deployment's and the chart's."""
    engine = knob_default(EngineConfig, name)
    assert knob_default(PrefillConfig, name) == knob_default(DecodeConfig, name) == engine
    up = pdserve_parser().parse_args(["up"])
    if hasattr(up, name):
        assert getattr(up, name) == engine
    if name in {f.name for f in dataclasses.fields(EngineSpec)}:
        assert knob_default(EngineSpec, name) == engine == VALUES["engine"][_camel(name)]
    assert getattr(parse_flags(ServiceConfig, argparse.ArgumentParser(), ["--model", "m"]), name) == engine


def test_up_block_size_reaches_both_services_and_refuses_zero():
    """`pdserve up --block-size N` renders `--block-size N` for prefill and decode alike (they must agree: the
    pushed blocks are the decode pool's); 0 is refused before anything starts, naming the field."""
    from router.cli import deployment_from_args

    deployment = deployment_from_args(pdserve_parser().parse_args(["up", "--model", "m", "--block-size", "16"]))
    for role in ("prefill", "decode"):
        flags = deployment.flags(role)
        assert flags[flags.index("--block-size") + 1] == "16"
    run = subprocess.run([str(Path(sys.executable).with_name("pdserve")), "up", "--model", "m", "--port", "0",
                          "--block-size", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "engine.blockSize" in run.stderr, run.stderr[-500:]


# Deployment keys that share a service flag's name but are deliberately another default, with why.
DEPLOYMENT_OWN = {
    "share_weights_dir": "the deployment's \"\" pairs with engine.shareWeights (the chart's memory emptyDir)",
    "layer_sharding": "YAML holds the comma-separated string the flag parses",
    "kv_port": "a pod has a fixed KV port (7100, named in the chart's Service); a local service takes a free one",
}


def _literal_defaults(path: Path) -> list[tuple[str, int]]:
    """Class-body annotated fields with a literal default, named like an engine, service or router knob."""
    knobs = {f.name for cls in (EngineConfig, PrefillConfig, DecodeConfig, RouterConfig)
             for f in dataclasses.fields(cls)} - {"model", "port", "host"} - set(DEPLOYMENT_OWN)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and item.target.id in knobs and isinstance(item.value, ast.Constant)):
                    out.append((item.target.id, item.lineno))
    return out


def test_no_knob_default_is_written_twice():
    """The fronts that render service flags (the deployment description, `pdserve up`'s Cluster, the
    services' own configs) write no knob's default as a literal: they re-declare it with `same_as`."""
    fronts = [ROOT / "router/deploy.py", ROOT / "router/cli.py", ROOT / "router/cluster.py",
              *sorted((ROOT / "prefill_service").glob("*.py")), *sorted((ROOT / "decode_service").glob("*.py"))]
    offenders = [f"{path.relative_to(ROOT)}:{line} {name}" for path in fronts
                 for name, line in _literal_defaults(path)]
    assert not offenders, f"knob defaults written outside their config dataclass: {offenders}"
def test_a_bad_value_is_refused_in_the_same_words_everywhere():
    """The bounds are declared once: the engine, the deployment description and `pdserve up` refuse
    num_speculative_tokens 4 naming the knob."""
    with pytest.raises(ValueError, match="num_speculative_tokens: expected 1..3, got 4"):
        EngineConfig("m", speculative="mtp", num_speculative_tokens=4)
    with pytest.raises(ValueError, match="engine.numSpeculativeTokens: expected 1..3, got 4"):
        Deployment.from_dict({"engine": {"speculative": "mtp", "numSpeculativeTokens": 4}})
    with pytest.raises(ValueError, match="--local-prefill-tokens: expected at least 0, got -1"):
        RouterConfig(model="m", prefill=["a"], decode=["b"], local_prefill_tokens=-1)
