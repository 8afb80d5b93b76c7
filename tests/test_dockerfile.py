"""The container image recipe (not built here: no container runtime). Every path it copies exists,
the packages it installs are the project's, and the chart's commands are modules it contains."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _instructions() -> list[tuple[str, list[str]]]:
    lines, buf = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        buf += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            op, _, rest = buf.strip().partition(" ")
            lines.append((op.upper(), shlex.split(rest)))
            buf = ""
    return lines


def test_dockerfile_copies_what_exists_and_installs_the_package():
    steps = _instructions()
    assert steps[0][0] == "ARG" and any(op == "FROM" for op, _ in steps)
    copies = [args for op, args in steps if op == "COPY"]
    for args in copies:
        for src in args[:-1]:
            assert (ROOT / src).exists(), src
    copied = {Path(src).parts[0] for args in copies for src in args[:-1]}
    assert {"shared", "prefill_service", "decode_service", "router", "proto", "pyproject.toml"} <= copied
    runs = " ".join(" ".join(args) for op, args in steps if op == "RUN")
    assert "torch==2.13.0" in runs and "libibverbs1" in runs and "librdmacm1" in runs
    assert runs.index("torch==2.13.0") < runs.index('pip install .[')  # the CPU torch first
    # the CPU attention kernel is compiled on the node, as the service user, into a writable cache
    assert "gcc" in runs and "libc6-dev" in runs
    # the Mooncake wheel is a build argument (one per accelerator), the CPU one by default
    args = dict(a.partition("=")[::2] for op, a_list in steps if op == "ARG" for a in a_list)
    assert args["MOONCAKE_WHEEL"] == "mooncake-transfer-engine-non-cuda"
    assert 'pip install "${MOONCAKE_WHEEL}"' in runs or "pip install ${MOONCAKE_WHEEL}" in runs
    envs = " ".join(" ".join(args) for op, args in steps if op == "ENV")
    assert "PDSERVE_KERNEL_CACHE=/tmp/" in envs


def test_chart_commands_are_modules_of_the_image():
    """Every command the chart runs (services and the TLS probe) is a module of the copied packages."""
    import pytest
    import yaml

    helm = pytest.importorskip("helm_python")
    values = {"tls": {"enabled": True, "secretName": "t"}, "prefill": {"cp": 2}}
    rendered = helm.Chart.load(ROOT / "helm" / "pdserve").render(values, name="d", namespace="n")
    modules = set()
    for path, text in rendered.items():
        for doc in (d for d in yaml.safe_load_all(text) if d) if not path.endswith(".txt") else ():
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                modules.add(c["command"][c["command"].index("-m") + 1])
                probe = " ".join(c["readinessProbe"]["exec"]["command"])
                modules.add(probe.split("python -m ")[1].split()[0])
    assert modules == {"router", "prefill_service", "decode_service", "shared.rpc.probe"}
    for module in modules:
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module
