"""AIPerf (NVIDIA's load tool, `aiperf profile`) as a peer client: its own virtual environment, a Hugging Face
cache entry for a local tokenizer, one replay of a Mooncake-format trace, and the numbers of its JSON export.

AIPerf pins its own dependencies (pandas, transformers, ...), so like the vLLM peer it lives outside the
project's .venv: `aiperf_bin()` creates `$PDSERVE_AIPERF_VENV` (default `~/.cache/pdserve/aiperf-peer`) on first
use. It needs no torch; a constraint pins torch to the local CPU wheel should any dependency ever ask for one.
AIPerf loads a tokenizer by Hugging Face name, and offline (`HF_HUB_OFFLINE=1`) only from a cache entry, so
`hf_tokenizer_env()` writes one (`models--pdserve--NAME/snapshots/<rev>/` + `refs/main`) for a model directory's
tokenizer in a bench-owned folder (`$PDSERVE_AIPERF_HF_HOME`, default `~/.cache/pdserve/aiperf-hf`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

AIPERF_VERSION = "aiperf==0.13.0"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json")


def _cache_dir(env: str, name: str) -> Path:
    return Path(os.environ.get(env, Path.home() / ".cache" / "pdserve" / name))


def aiperf_bin() -> Path:
    """The peer venv's `aiperf` executable, installing AIPerf there on first use (about a minute, once)."""
    venv = _cache_dir("PDSERVE_AIPERF_VENV", "aiperf-peer")
    exe = venv / "bin" / "aiperf"
    if not (venv / ".installed").exists():
        print(f"installing {AIPERF_VERSION} into {venv} (once; about a minute) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        constraints = venv / "constraints.txt"
        constraints.write_text("torch==2.13.0\n")  # never a CUDA build, should a dependency want torch
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraints),
                        AIPERF_VERSION], check=True)
        (venv / ".installed").touch()
    return exe


def hf_tokenizer_env(model_dir: Path) -> tuple[str, dict[str, str]]:
    """(tokenizer name, environment) under which AIPerf loads `model_dir`'s tokenizer offline: a Hugging Face
    cache entry `pdserve/<dir name>` whose revision is the files' hash (rewritten when they change)."""
    home = _cache_dir("PDSERVE_AIPERF_HF_HOME", "aiperf-hf")
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).exists()]
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    rev = digest.hexdigest()
    repo = home / "hub" / f"models--pdserve--{model_dir.resolve().name}"
    snapshot = repo / "snapshots" / rev
    if not snapshot.exists():
        tmp = snapshot.with_name(rev + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in files:
            shutil.copy(f, tmp / f.name)
        tmp.rename(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    return f"pdserve/{model_dir.resolve().name}", env


@dataclass(frozen=True)
class AiperfSummary:
    """What the bench reads from AIPerf's own export (milliseconds; None where AIPerf reported nothing)."""

    requests: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    client_cache_pct: float | None  # the share of prompt tokens the server's usage said were cached
    duration_s: float | None


_TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1000.0, "sec": 1000.0}


def _stat(metrics: dict, tag: str, stat: str) -> float | None:
    """One statistic of one metric, times in milliseconds (AIPerf tags each metric with its unit)."""
    entry = metrics.get(tag)
    if not isinstance(entry, dict) or entry.get(stat) is None:
        return None
    return float(entry[stat]) * _TO_MS.get(str(entry.get("unit", "")), 1.0)


def parse_aiperf_export(data: dict) -> AiperfSummary:
    """`profile_export_aiperf.json` (AIPerf 0.13): one entry per metric tag (time_to_first_token,
    inter_token_latency = TPOT, completed_request_count, ...), each {unit, avg, p50, p90, ...}, and
    `error_summary`, a list of {error_details, count}."""
    completed = _stat(data, "completed_request_count", "avg")
    if completed is None:
        completed = _stat(data, "request_count", "avg")
    errors = sum(int(e.get("count", 0)) for e in data.get("error_summary") or [] if isinstance(e, dict))
    duration_ms = _stat(data, "benchmark_duration", "avg")
    return AiperfSummary(
        requests=int(completed or 0), errors=errors,
        ttft_p50_ms=_stat(data, "time_to_first_token", "p50"),
        ttft_p90_ms=_stat(data, "time_to_first_token", "p90"),
        tpot_p50_ms=_stat(data, "inter_token_latency", "p50"),
        client_cache_pct=_stat(data, "overall_usage_prompt_cache_read_pct", "avg"),
        duration_s=duration_ms / 1000 if duration_ms is not None else None)


def run_aiperf(url: str, model: str, model_dir: Path, trace: Path, block_size: int, artifacts: Path,
               timeout_s: float, schedule_s: float = 0.0, seed: int = 0) -> AiperfSummary:
    """Replay `trace` (Mooncake format, timestamps already at the chosen speed) at its own timestamps against
    the OpenAI-compatible server at `url`: streamed /v1/completions, each request its trace's output length
    (ignore_eos), prompts built by AIPerf from the hash ids at `block_size` tokens per id. `timeout_s`: per
    request; AIPerf itself is given the schedule's length (`schedule_s`) plus that plus 5 minutes."""
    tokenizer, hf_env = hf_tokenizer_env(model_dir)
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    cmd = [str(aiperf_bin()), "profile", "--model", model, "--url", url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", tokenizer, "--input-file", str(trace),
           "--custom-dataset-type", "mooncake_trace", "--fixed-schedule", "--fixed-schedule-auto-offset",
           "--isl-block-size", str(block_size), "--extra-inputs", "ignore_eos:true", "--random-seed", str(seed),
           "--artifact-dir", str(artifacts), "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics",
           "--request-timeout-seconds", str(int(timeout_s))]
    env = {**os.environ, **hf_env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    with open(artifacts / "aiperf.log", "w") as log:
        run = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             timeout=schedule_s + timeout_s + 300)
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if run.returncode != 0 or not exports:
        tail = (artifacts / "aiperf.log").read_text()[-3000:]
        raise RuntimeError(f"aiperf profile exited {run.returncode} (log {artifacts / 'aiperf.log'}):\n{tail}")
    return parse_aiperf_export(json.loads(exports[-1].read_text()))
