"""Live, small: `pdserve up --autoscale` under an AIPerf replay of a compressed window of the Mooncake
conversation trace, against what the planner's simulation predicts for the same window at this machine's
measured speeds (the same autoscaler, the same performance model).

    python bench/elastic_replay.py [--start-s 900] [--duration-s 600] [--speed 3] [--autoscale 1:3]
                                   [--ttft-ms 2000] [--tpot-ms 200] [--period 2] [--window 20] [--down-after 30]
                                   [--model models/demo-v32] [--profile PATH] [--log-dir DIR]

1. Calibrate (skipped with --profile): `pdserve up` with one prefill and one decode instance, and `pdserve profile
   --router` through it: the served prefill curve (on prompts up to the window's longest) and decode curve and the
   interference of engines sharing this machine's cores, as profile.json.
2. Live: `pdserve up --autoscale A:B --profile profile.json --ttft-slo-ms --tpot-slo-ms --http-port 0` (the
   command, as a user runs it), AIPerf (`aiperf profile`, bench/peers/aiperf.py) replaying the window at its own
   timestamps (fixed schedule, streamed /v1/completions, prompts built from the hash ids at 16 tokens a block,
   outputs cut to --max-output). The router's /metrics is read once a second: the pools' desired sizes and the
   instances up. Per request TTFT and TPOT come from AIPerf's per-record export; a request meets the SLA when both
   are within the targets (a failed or missing request misses).
3. Simulated: router.planner.simulate_trace over the same requests (prompt and output lengths as sent, 16-token
   prefix blocks, each prefill instance's cache its KV pool) with the same profile (its interference terms model
   the shared cores), the same autoscaler knobs, and a boot measured: its time in (2), from a pool's desired size
   rising to its new instance up, and its CPU seconds (one instance started alone before (2)), so a booting
   instance counts as that share of a busy engine.
Prints both runs side by side (the goal: attainment within 3 points) and saves
bench/out/elastic_replay.png (pool sizes over time, live and simulated) and .json.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.common import OUT, ROOT, pct, table
from bench.fleet_faults import UpProcess
from bench.kv_reuse import load_trace as load_window_trace
from bench.kv_reuse import select_window, write_window
from bench.peers.aiperf import run_aiperf
from bench.trace_replay import TRACE
from router.autoscale import AUTOSCALE_TPOT_MS, AUTOSCALE_TTFT_MS, Autoscaler, Bounds
from router.perf import PerfModel
from router.planner import TraceRequest, simulate_trace

BLOCK = 16  # prompt tokens per trace hash id (the trace's are 512)


@dataclass
class Sample:
    """The router's view once a second: the pools' desired sizes and the instances whose health says SERVING."""

    t: float
    desired: tuple[int, int]
    up: tuple[int, int]


def calibrate(model: str, log_dir: Path, longest: int) -> Path:
    """profile.json of this machine: `pdserve profile --router` through `pdserve up` (1 prefill + 1 decode), its
    prefill curve fitted on prompts up to the window's `longest`."""
    out = log_dir / "profile.json"
    up = UpProcess(["--model", model, "--num-prefill", "1", "--num-decode", "1", "--port", "0"], log_dir / "calibrate")
    up.start()
    try:
        exe = Path(_sys.executable).with_name("pdserve")
        lengths = sorted({16, 64, 256, max(17, longest // 2), longest})
        subprocess.run([str(exe), "profile", "--router", up.grpc_address, "--out", str(out), "--prompt-lengths",
                        ",".join(map(str, lengths))], check=True, cwd=ROOT)
    finally:
        up.stop()
    return out


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process `root` and its descendants (Linux /proc)."""
    tick, stats = os.sysconf("SC_CLK_TCK"), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, (ppid, _) in stats.items() if ppid in tree} - tree
        tree, grew = tree | more, bool(more)
    return sum(stats[pid][1] for pid in tree if pid in stats)


def boot_cpu_seconds(model: str) -> float:
    """CPU seconds one instance's boot takes (a prefill service started alone, until its CPU time stops growing):
    what a booting instance takes from the cores the serving ones share."""
    proc = subprocess.Popen([_sys.executable, "-m", "prefill_service", "--model", model, "--port", "0", "--insecure"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        seen, still = 0.0, 0
        for _ in range(240):
            time.sleep(0.5)
            now = tree_cpu_seconds(proc.pid)
            still = still + 1 if now - seen < 0.05 else 0
            seen = now
            if still >= 6:
                break
        return seen
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def read_sizes(metrics_url: str) -> tuple[tuple[int, int], tuple[int, int]]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    desired = dict(re.findall(r'^pdserve_router_desired_instances\{pool="(\w+)"\} ([0-9.]+)$', text, re.M))
    up = re.findall(r'^pdserve_router_instance_up\{[^}]*pool="(\w+)"[^}]*\} ([0-9.]+)$', text, re.M)
    count = {pool: sum(float(v) > 0 for p, v in up if p == pool) for pool in ("prefill", "decode")}
    return ((round(float(desired.get("prefill", 0))), round(float(desired.get("decode", 0)))),
            (count["prefill"], count["decode"]))


def poll(metrics_url: str, t0: float, stop: threading.Event, out: list[Sample]) -> None:
    while not stop.wait(1.0):
        try:
            desired, up = read_sizes(metrics_url)
        except OSError:
            continue
        out.append(Sample(time.monotonic() - t0, desired, up))


def boot_seconds(samples: list[Sample]) -> float | None:
    """Median time from a pool's desired size rising to that many of its instances up."""
    waits = []
    for before, s in zip(samples, samples[1:]):
        for k in (0, 1):
            if s.desired[k] > before.desired[k] and s.up[k] < s.desired[k]:  # asked to grow: until up or given up
                end = next((x for x in samples if x.t >= s.t and (x.up[k] >= s.desired[k]
                                                                  or x.desired[k] < s.desired[k])), None)
                if end is not None and end.up[k] >= s.desired[k]:
                    waits.append(end.t - s.t)
    return statistics.median(waits) if waits else None


@dataclass
class Outcome:
    """One request as its client saw it (seconds; None: no token)."""

    ttft: float | None
    tpot: float | None
    error: str | None = None


def per_request(artifacts: Path) -> tuple[list[Outcome], float | None]:
    """AIPerf's per-record export (profile_export.jsonl): each request's TTFT and inter-token latency, or its error;
    and when (wall clock, s) the first request was sent."""
    out, sent = [], []
    for path in sorted(artifacts.rglob("profile_export.jsonl"))[-1:]:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if start_ns := (rec.get("metadata") or {}).get("request_start_ns"):
                sent.append(start_ns / 1e9)
            metrics, err = rec.get("metrics") or {}, rec.get("error")
            ttft = (metrics.get("time_to_first_token") or {}).get("value")
            itl = (metrics.get("inter_token_latency") or {}).get("value")
            out.append(Outcome(ttft / 1e3 if ttft is not None else None, itl / 1e3 if itl is not None else 0.0,
                               str(err)[:200] if err else (None if ttft is not None else "no token")))
    return out, min(sent, default=None)


def refused(o: Outcome) -> bool:
    """A 429 from the router's SLA admission (load shed by design, not a failure of the pools)."""
    return o.error is not None and "'code': 429" in o.error


def changes(sizes: list[tuple[float, int, int]]) -> int:
    return sum(1 for a, b in zip(sizes, sizes[1:]) if a[1:] != b[1:])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/demo-v32")
    p.add_argument("--start-s", type=float, default=900.0, help="window start, trace seconds")
    p.add_argument("--duration-s", type=float, default=600.0, help="window length, trace seconds")
    p.add_argument("--speed", type=float, default=3.0, help="replay speed factor (the window's rate × this)")
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--autoscale", default="1:3")
    p.add_argument("--ttft-ms", type=float, default=AUTOSCALE_TTFT_MS)
    p.add_argument("--tpot-ms", type=float, default=AUTOSCALE_TPOT_MS)
    p.add_argument("--admission", action="store_true",
                   help="give the router the targets (--ttft-slo-ms / --tpot-slo-ms): it refuses (429) what it "
                        "predicts will miss them; without it the router refuses nothing and its autoscaler sizes "
                        "for its default targets, which --ttft-ms / --tpot-ms must then be")
    p.add_argument("--period", type=float, default=2.0, help="--autoscale-period")
    p.add_argument("--window", type=float, default=20.0, help="--autoscale-window")
    p.add_argument("--down-after", type=float, default=30.0, help="--autoscale-down-after")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="per instance (its prefix cache too)")
    p.add_argument("--profile", default=None, help="profile.json to use (default: measure one first)")
    p.add_argument("--log-dir", default=None)
    a = p.parse_args(argv)
    if not a.admission and (a.ttft_ms, a.tpot_ms) != (AUTOSCALE_TTFT_MS, AUTOSCALE_TPOT_MS):
        p.error(f"without --admission the router sizes for TTFT {AUTOSCALE_TTFT_MS:g} ms / TPOT {AUTOSCALE_TPOT_MS:g} "
                "ms: other targets need --admission")
    return a


def live_run(a: argparse.Namespace, profile: Path, trace_file: Path, span: float, log_dir: Path
             ) -> tuple[list[Outcome], list[Sample]]:
    """The window through `pdserve up --autoscale` and AIPerf: each request's outcome, the pools once a second."""
    knobs = ["--autoscale-period", str(a.period), "--autoscale-window", str(a.window), "--autoscale-down-after",
             str(a.down_after)]
    targets = ["--ttft-slo-ms", str(a.ttft_ms), "--tpot-slo-ms", str(a.tpot_ms)] if a.admission else []
    up = UpProcess(["--model", a.model, "--port", "0", "--http-port", "0", "--autoscale", a.autoscale, *knobs,
                    "--profile", str(profile), *targets, "--kv-cache-tokens", str(a.kv_cache_tokens)],
                   log_dir / "live")
    up.start()
    samples: list[Sample] = []
    stop, t0, wall0 = threading.Event(), time.monotonic(), time.time()
    poller = threading.Thread(target=poll, args=(up.metrics["router"], t0, stop, samples), daemon=True)
    poller.start()
    try:
        run_aiperf(up.http_url.removesuffix("/v1"), up.model, Path(a.model), trace_file, BLOCK, log_dir / "aiperf",
                   timeout_s=600.0, schedule_s=span)
        time.sleep(a.down_after + a.window)  # the pools shrink back once the load is gone
    finally:
        stop.set()
        poller.join(5)
        up.stop()
    outcomes, first = per_request(log_dir / "aiperf")
    shift = (first - wall0) if first is not None else 0.0  # the window's time 0: AIPerf's first request
    return outcomes, [Sample(s.t - shift, s.desired, s.up) for s in samples]


def report(a: argparse.Namespace, sent: int, live: list[Outcome], samples: list[Sample], sim, boot: float | None,
           span: float) -> None:
    """Live and simulated side by side, the JSON and the plot."""
    ttft_s, tpot_s = a.ttft_ms / 1e3, a.tpot_ms / 1e3
    met = sum(1 for o in live if o.error is None and o.ttft is not None and o.ttft <= ttft_s and o.tpot <= tpot_s)
    ok = [o for o in live if o.ttft is not None]
    live_sizes = [(s.t, *s.desired) for s in samples]
    rows = [["requests", sent, len(sim.met)],
            ["refused (429: no pair meets the targets)", sum(refused(o) for o in live), sim.rejected],
            ["failed (any other error, or never answered)",
             sum(o.error is not None and not refused(o) for o in live) + sent - len(live), "-"],
            ["SLA attainment %", round(100 * met / sent, 1), round(100 * sim.attainment, 1)],
            ["TTFT p90 s", round(pct([o.ttft for o in ok], 0.9), 2), round(sim.quantile("ttft", 0.9), 2)],
            ["TPOT p90 ms", round(1e3 * pct([o.tpot for o in ok], 0.9), 1), round(1e3 * sim.quantile("tpot", 0.9), 1)],
            ["most instances (P+D)", f"{max((s[1] for s in live_sizes), default=0)}+"
                                     f"{max((s[2] for s in live_sizes), default=0)}",
             f"{max(m for _, m, _ in sim.sizes)}+{max(n for _, _, n in sim.sizes)}"],
            ["pool changes", changes(live_sizes), changes(sim.sizes)]]
    print(f"\n{a.autoscale} autoscaled, SLA TTFT <= {a.ttft_ms:g} ms, TPOT <= {a.tpot_ms:g} ms; boot time measured "
          f"{'-' if boot is None else round(boot, 1)} s")
    print(table(["", "live (pdserve up + AIPerf)", "simulated (same window, profile, autoscaler)"], rows))
    print(f"attainment gap: {abs(100 * met / sent - 100 * sim.attainment):.1f} points (goal: within 3)")
    (OUT / "elastic_replay.json").write_text(json.dumps({"rows": rows, "live_sizes": live_sizes,
                                                         "sim_sizes": sim.sizes, "boot_s": boot}))
    plot(OUT / "elastic_replay.png", live_sizes, sim.sizes, span)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="elastic-replay-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    window = select_window(load_window_trace(TRACE), a.start_s, a.duration_s, a.speed, BLOCK, 1024, a.max_output)
    trace_file = write_window(window, log_dir / "window.jsonl")
    span = window.requests[-1].timestamp_ms / 1e3
    print(f"window: {len(window.requests)} requests over {span:.0f} s ({len(window.requests) / span:.2f} req/s), "
          f"prompts {statistics.mean(r.input_length for r in window.requests):.0f} tokens mean, outputs "
          f"{statistics.mean(r.output_length for r in window.requests):.0f}; logs in {log_dir}", flush=True)
    longest = max(r.input_length for r in window.requests)
    profile = Path(a.profile) if a.profile else calibrate(a.model, log_dir, longest)
    perf = PerfModel.load(profile)
    print(f"profile {profile}: prefill {perf.prefill_base_s * 1e3:.1f} ms + {perf.prefill_per_token_s * 1e6:.1f} "
          f"µs/token, decode {perf.decode_base_s * 1e3:.1f} ms + {perf.decode_per_seq_s * 1e3:.2f} ms/seq, "
          f"interference {perf.prefill_interference:.2f} / {perf.decode_interference:.2f}", flush=True)
    boot_cpu = boot_cpu_seconds(a.model)
    live, samples = live_run(a, profile, trace_file, span, log_dir)
    boot = boot_seconds(samples) or 15.0
    print(f"an instance boots in {boot:.1f} s (live, desired to up) on {boot_cpu:.1f} CPU seconds", flush=True)
    requests = [TraceRequest(r.timestamp_ms / 1e3, r.input_length, r.output_length, r.hash_ids)
                for r in window.requests]
    bounds = Bounds.parse(a.autoscale)
    scaler = Autoscaler(perf, a.ttft_ms / 1e3, a.tpot_ms / 1e3, bounds, bounds, window_s=a.window,
                        down_after_s=a.down_after)
    sim = simulate_trace(perf, requests, scaler, a.ttft_ms / 1e3, a.tpot_ms / 1e3, period=a.period, window=a.window,
                         startup_s=boot, boot_busy=min(1.0, boot_cpu / boot), observe_cached=True, block_tokens=BLOCK,
                         prefix_cache_blocks=a.kv_cache_tokens // BLOCK, decode_kv_tokens=a.kv_cache_tokens,
                         admission=a.admission)
    report(a, len(window.requests), live, samples, sim, boot, span)


def plot(path: Path, live: list[tuple[float, int, int]], sim: list[tuple[float, int, int]], span: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for sizes, style, name in ((live, "-", "live"), (sim, "--", "simulated")):
        if sizes:
            ts = [t for t, _, _ in sizes] + [span]
            for k, pool in ((1, "prefill"), (2, "decode")):
                ax.step(ts, [s[k] for s in sizes] + [sizes[-1][k]], style, where="post", label=f"{name} {pool}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("instances")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
