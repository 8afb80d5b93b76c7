"""The live elastic replay's pieces: `pdserve profile --router` (the command) through `pdserve up` writes the
served curves and the shared-core interference the simulation uses, and refuses bad prompt lengths; the bench
reads AIPerf's per-record export (TTFT, TPOT, a 429 apart from a failure), the pools' boot times from the router's
gauges, and a process tree's CPU time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.elastic_replay import Sample, boot_seconds, per_request, refused, tree_cpu_seconds
from bench.fleet_faults import UpProcess
from router.perf import PerfModel


def test_pdserve_profile_through_a_running_router(tmp_path):
    up = UpProcess(["--port", "0", "--num-prefill", "1", "--num-decode", "1"], tmp_path / "logs").start()
    try:
        cmd = [sys.executable, "-m", "router.cli", "profile", "--router", up.grpc_address]
        bad = subprocess.run([*cmd, "--prompt-lengths", "16,x"], capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "--prompt-lengths" in bad.stderr
        few = subprocess.run([*cmd, "--prompt-lengths", "16,64"], capture_output=True, text=True, timeout=60)
        assert few.returncode != 0 and "three" in few.stderr
        out = tmp_path / "profile.json"
        done = subprocess.run([*cmd, "--prompt-lengths", "16,64,128", "--out", str(out)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        up.stop()
    assert "interference:" in done.stdout and "TTFT   128 tokens" in done.stdout
    perf = PerfModel.load(out)
    assert perf.prefill_seconds(128) > 0 and perf.decode_step_seconds(4, 512) > 0
    assert perf.prefill_interference >= 0 and perf.decode_interference >= 0


def test_aiperf_records_become_outcomes(tmp_path):
    ok = {"metadata": {"request_start_ns": 2_000_000_000}, "metrics": {
        "time_to_first_token": {"value": 250.0, "unit": "ms"}, "inter_token_latency": {"value": 8.0, "unit": "ms"}}}
    shed = {"metadata": {"request_start_ns": 1_500_000_000}, "metrics": {},
            "error": {"code": 429, "type": "Too Many Requests", "message": "no pair meets the SLA"}}
    broken = {"metadata": {"request_start_ns": 3_000_000_000}, "metrics": {}, "error": {"code": 500}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile_export.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (ok, shed, broken)))
    outcomes, first = per_request(tmp_path)
    assert first == pytest.approx(1.5)
    assert (outcomes[0].ttft, outcomes[0].tpot, outcomes[0].error) == (pytest.approx(0.25), pytest.approx(0.008), None)
    assert [refused(o) for o in outcomes] == [False, True, False] and outcomes[2].error is not None


def test_boot_time_is_from_a_pool_asked_to_grow_to_its_instance_up():
    samples = [Sample(0.0, (1, 1), (1, 1)), Sample(1.0, (2, 1), (1, 1)), Sample(2.0, (2, 1), (1, 1)),
               Sample(9.0, (2, 1), (2, 1)), Sample(20.0, (2, 2), (2, 1)), Sample(25.0, (2, 2), (2, 2)),
               Sample(30.0, (3, 2), (2, 2)), Sample(31.0, (2, 2), (2, 2))]  # the last one given up before it booted
    assert boot_seconds(samples) == pytest.approx(6.5)  # median of 8 s and 5 s
    assert boot_seconds(samples[:1]) is None


def test_a_process_trees_cpu_time_counts_its_children():
    """A live child's CPU seconds count (a booting instance's processes are alive while it boots)."""
    before = tree_cpu_seconds(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.process_time()\nwhile "
                              "time.process_time() - t < 0.5: pass\nprint('burnt', flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burnt"
        assert tree_cpu_seconds(os.getpid()) >= before + 0.45
    finally:
        child.kill()
        child.wait()
