"""Every benchmark runs as the README writes it (`python bench/X.py`, from any folder) in a tiny mode,
so none can break silently. Their numbers are not checked here: benchmarks measure, tests don't."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.hostload import wait_quiet

ROOT = Path(__file__).resolve().parents[1]
TINY_ARGS = {
    "engine_throughput": ["--batches", "1,2", "--prompt-len", "8", "--new-tokens", "2", "--dtype", "float32"],
    "serving": ["--streams", "1,2", "--prompt-len", "8", "--max-tokens", "2", "--long-prompt", "32",
                "--dtype", "float32", "--quiet-below", "0"],  # no 2 s idle probe per measurement
    "parallel": ["--prompt-len", "64", "--decode-requests", "2", "--decode-tokens", "2", "--repeat", "1"],
    "transfer": ["--tokens", "64", "--repeat", "1"],
    "real_shapes": ["--contexts", "64", "--chunk", "64", "--decode-batch", "1", "--kv-cache-dtype", "int8",
                    "--sampler-rows", "8"],
    "quant": ["--batches", "1,2", "--prompt-len", "8", "--new-tokens", "2", "--repeat", "1"],
    "speculative": ["--random-mtp", "--batches", "1", "--k", "1,2", "--prompt-len", "8", "--new-tokens", "4",
                    "--rounds", "1", "--dtype", "float32"],
    "selective": ["--background", "2", "--probes", "2", "--prefill-load", "0", "--warmup", "0.5"],
    "sla_router": ["--decode", "1", "--requests", "3", "--isl", "8", "--osl", "2", "--loads", "1", "--quick-profile"],
    "trace_replay": ["--trace", str(ROOT / "tests" / "data" / "mooncake_conversation_first_2min.jsonl"), "--minutes",
                     "2", "--max-m", "3", "--max-n", "1", "--jobs", "1", "--goal", "0.9"],
    "trace_bound": ["--trace", str(ROOT / "tests" / "data" / "mooncake_conversation_first_2min.jsonl"), "--minutes",
                    "2", "--scales", "1", "--segments", "60", "--jobs", "1", "--goal", "0.9"],
    "indexer": ["--heads", "4", "--contexts", "128", "--queries", "2", "--repeat", "2"],
    "step_profile": ["--batches", "1,2", "--prompt-len", "8", "--steps", "2", "--dtype", "float32"],
    "grpc_streams": ["--streams", "2", "--steps", "4", "--step-ms", "1", "--rounds", "1"],
    "c8": ["--contexts", "64", "--batch", "1", "--tail", "4", "--new-tokens", "2", "--repeat", "1",
           "--index-topk", "32"],
    "cold_start": ["--starts", "1", "--rounds", "2", "--streams", "1", "--prompt-len", "4", "--max-tokens", "2",
                   "--model", str(ROOT / "models" / "tiny-v32")],
    "block_size": ["--sizes", "4,8", "--batch", "2", "--context", "16", "--engine-rounds", "2", "--prompt-len", "8",
                   "--new-tokens", "2"],
}
# Benches whose smallest run still starts several clusters or a peer's server (minutes each): run by hand.
BY_HAND = {"elastic", "structured", "profile_router", "hostload",
           "kv_reuse",  # AIPerf from its own venv; its pure parts: tests/test_kv_reuse_bench.py
           "elastic_replay",  # AIPerf too; its pure parts and `pdserve profile --router`: tests/test_elastic_replay.py
           "fleet_faults",  # run by tests/test_migration.py, through its functions, on every fault
           "token_bus"}  # two clusters; the bus and --no-token-bus themselves: tests/test_token_bus.py


def test_every_bench_has_a_smoke_run():
    assert {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__", "common"} == set(TINY_ARGS) | BY_HAND


@pytest.mark.parametrize("name", sorted(TINY_ARGS))
def test_bench_runs_as_documented(name, tmp_path):
    env = {**os.environ, "PDSERVE_BENCH_OUT": str(tmp_path / "out")}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *TINY_ARGS[name]], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| " in run.stdout  # printed its table
    assert list((tmp_path / "out").glob("*.png")), "saved no plot"


def test_engine_throughput_rounds_never_repeat_a_prompt(monkeypatch, tmp_path):
    """A round on prompts pdserve saw before would read their KV from its prefix cache (vLLM's CPU MLA has
    none): every round draws its own."""
    import bench.engine_throughput as bench

    seen: list[tuple[tuple[int, ...], ...]] = []

    def record(llm, prompts, new_tokens):
        seen.append(tuple(map(tuple, prompts)))
        return 1.0

    monkeypatch.setenv("PDSERVE_BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(bench, "OUT", tmp_path)
    monkeypatch.setattr(bench, "run_pdserve", record)
    bench.main(["--batches", "2,3", "--rounds", "3", "--prompt-len", "8", "--new-tokens", "2", "--dtype", "float32",
                "--peer", "none"])
    runs = seen[1:]  # the first call is the warm-up's
    assert len(runs) == 6 and len(set(runs)) == 6
    assert {len(r) for r in runs} == {2, 3}


def test_wait_quiet_returns_the_foreign_load_once_under_the_threshold_or_at_its_deadline():
    """The serving bench's idle probe (its smoke run above skips it: --quiet-below 0)."""
    t0 = time.monotonic()
    assert 0.0 <= wait_quiet(threshold=1e6, timeout=10, window=0.05) < 1e6  # under at once: one window
    assert time.monotonic() - t0 < 5
    t0 = time.monotonic()
    assert wait_quiet(threshold=0.0, timeout=0.3, window=0.05) >= 0.0  # never under 0 cores: waits out its timeout
    assert time.monotonic() - t0 >= 0.3
