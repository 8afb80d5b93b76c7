"""Elastic serving: what a client sees when instances die or drain, and SLA attainment over a load step
with and without autoscaling.

    python bench/elastic.py [--faults] [--load-step] [--streams 24] [--tokens 96] [--base-rate 6]
                            [--step-factor 3] [--scale 1] [--log-dir DIR]

--faults: `pdserve up --num-prefill 2 --num-decode 2` on the demo model; per fault (none, SIGKILL of a
decode instance mid-stream, SIGTERM of a decode instance's front process — it drains —, SIGKILL of a
prefill instance mid-prefill; the victim is the busiest instance of its pool when hit) 24 concurrent
greedy streams of 96 tokens: per stream whole / failed / wrong (tokens differ from an earlier unfaulted
run), TTFT, TPOT and its largest gap between two consecutive messages (the pause its client sees).
Prints the fault matrix; the pauses of the streams the router logged as migrated (found by their
request_id) vs the rest, and vs the same streams unfaulted; the router's migrations by cause, failovers
and pdserve_router_migration_pause_seconds. A prefill failover happens before the first token: it shows
in TTFT, and the router's log does not name its request. The victim is restarted (cluster.restart)
between faults.

--load-step: the same open-loop Poisson load (base rate 20 s, × step factor 40 s, base 40 s) against a
static 1 prefill + 1 decode cluster (A) and against `--autoscale 1:3 --autoscale-period 2
--autoscale-window 4 --autoscale-down-after 8` (B) with a PerfModel (the built-in one, stretched) under
which the router's autoscaler keeps one instance per pool up to 2.4 × the base rate and wants more during
the step. The default 6 req/s (step 18) is what 1 + 1 serves within the SLA here, and then clearly not
(measured on this 2-core machine: 9-12 req/s met it when the machine was otherwise idle, 16 did not).
Prompts follow the Mooncake conversation trace in order: each hash id is one fixed random block of 16
tokens (so repeated ids repeat prefixes), at most 12 blocks, output length min(output_length / 8, 48).
SLA: TTFT ≤ 2 s and TPOT ≤ 200 ms. Prints per 10-s bin the rate, B's pools (desired by the router,
listed by the cluster, alive) and the attainment of A and B; overall attainment and instance-seconds;
saves bench/out/elastic.png. All processes share this machine's cores (an added instance adds no cores).

Without --faults or --load-step both run.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import asyncio
import itertools
import json
import random
import re
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.common import OUT, ROOT, pct, table
from bench.trace_replay import TRACE, TRACE_SOURCE
from router.autoscale import Autoscaler, Bounds, Observation
from router.cli import up_cluster
from router.cluster import Cluster
from router.perf import PerfModel
from router.planner import goodput
from router.supervise import LocalAutoscaler
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc

DEMO = str(ROOT / "models" / "demo-v32")
VOCAB = 4096  # the demo model's; prompts use ids 2 .. VOCAB - 1 (0 and 1 are BOS / EOS)
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.2  # the autoscaler's default targets too


# --- router metrics ----------------------------------------------------------------------------------

def router_metrics(cluster: Cluster) -> dict[str, float]:
    """The router's /metrics samples, `name{labels}` → value."""
    port = cluster.metrics_ports[cluster.address]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix) and v - before.get(k, 0.0)}


def label(key: str, name: str) -> str:
    """The value of label `name` in a sample's key."""
    found = re.search(rf'{name}="([^"]*)"', key)
    return found.group(1) if found else key


def wait_placeable(cluster: Cluster, timeout: float = 60.0) -> bool:
    """Until the router places requests on every instance again (after a restart)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = router_metrics(cluster)
        flags = [v for k, v in m.items() if k.startswith("pdserve_router_instance_placeable{")]
        if len(flags) >= len(cluster.prefill_addrs) + len(cluster.decode_addrs) and all(flags):
            return True
        time.sleep(0.5)
    return False


# --- part 1: faults ----------------------------------------------------------------------------------



@dataclass
class Stream:
    t0: float = 0.0
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per message
    tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.stamps[0][0] - self.t0 if self.stamps else float("nan")

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive messages that carried tokens."""
        return [b[0] - a[0] for a, b in zip(self.stamps, self.stamps[1:])]

    @property
    def tpot(self) -> float:
        """First to last token over the tokens after the first."""
        n = sum(k for _, k in self.stamps)
        return (self.stamps[-1][0] - self.stamps[0][0]) / (n - 1) if n > 1 else float("nan")

    def max_gap_at(self, t: float) -> float:
        """When its largest gap began, in seconds after `t`."""
        gaps = self.gaps
        return self.stamps[gaps.index(max(gaps))][0] - t if gaps else float("nan")

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)


def fault_prompts(streams: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(25, 70))] for _ in range(streams)]


def run_streams(address: str, prompts: list[list[int]], tokens: int, tag: str, fault=None,
                after_tokens: int = 0) -> tuple[list[Stream], float]:
    """Every stream at once, one thread each, stream i labelled `{tag}-{i}` (its request_id, which the
    router's migration log lines name); `fault()` once `after_tokens` tokens have streamed in all.
    → (the streams, when the fault was started: perf_counter)."""
    streams, streamed, lock, t_fault = [Stream() for _ in prompts], [0], threading.Lock(), float("nan")
    sp = generation_pb2.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def one(i: int, s: Stream, prompt: list[int]) -> None:
        req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=sp, request_id=f"{tag}-{i}")
        try:
            with grpc.insecure_channel(address) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                s.t0 = time.perf_counter()
                for msg in stub.Generate(req, timeout=240):
                    if msg.token_ids:
                        s.stamps.append((time.perf_counter(), len(msg.token_ids)))
                        s.tokens += msg.token_ids
                        with lock:
                            streamed[0] += len(msg.token_ids)
        except grpc.RpcError as exc:
            s.error = f"{exc.code().name}: {exc.details()}"

    threads = [threading.Thread(target=one, args=(i, s, p)) for i, (s, p) in enumerate(zip(streams, prompts))]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 120
        while streamed[0] < after_tokens and time.monotonic() < deadline:
            time.sleep(0.002)
        t_fault = time.perf_counter()
        fault()
    for t in threads:
        t.join(300)
    return streams, t_fault


def busiest(cluster: Cluster, pool: str) -> tuple[str, str]:
    """The instance of `pool` holding the most work now (decode: running and waiting requests; prefill: and
    prompt tokens queued), and that work in words."""
    stub_cls = internal_pb2_grpc.DecodeStub if pool == "decode" else internal_pb2_grpc.PrefillStub
    loads = {}
    for address in cluster.decode_addrs if pool == "decode" else cluster.prefill_addrs:
        with cluster.channel(address) as ch:
            r = stub_cls(ch).GetLoad(internal_pb2.LoadRequest(), timeout=5)
        held = f"{r.running + r.waiting} req" + (f", {r.queued_prompt_tokens} tok" if pool == "prefill" else "")
        loads[address] = (held, (r.running + r.waiting) * 10_000 + r.queued_prompt_tokens)
    victim = max(loads, key=lambda a: loads[a][1])
    return victim, loads[victim][0]


def migrated(router_log: Path, tag: str) -> dict[int, list[str]]:
    """Stream → the router's migration lines naming it (`request TAG-i: cause (...); migrating ...`)."""
    out: dict[int, list[str]] = {}
    for line in router_log.read_text(errors="replace").splitlines():
        if (m := re.search(rf"request {re.escape(tag)}-(\d+): ", line)) and "migrating" in line:
            out.setdefault(int(m.group(1)), []).append(line)
    return out


def fmt_ms(values: list[float], q: str) -> str:
    if not values:
        return "-"
    return f"{1e3 * (statistics.median(values) if q == 'median' else max(values)):.0f}"


def gap_at(values: list[float]) -> str:
    """The median start of the largest gaps, in s after the fault ('-' without a fault or streams)."""
    values = [v for v in values if v == v]
    return f"{statistics.median(values):+.1f}" if values else "-"


def faults(log_dir: Path, seed: int, streams_n: int = 24, tokens: int = 96) -> None:
    prompts = fault_prompts(streams_n, seed)
    cluster = up_cluster(["--model", DEMO, "--port", "0", "--num-prefill", "2", "--num-decode", "2"],
                         log_dir=log_dir)
    cluster.extra_router += ["--metrics-port", "0"]
    matrix, pauses, migration_rows, notes = [], [], [], []
    t_start, stamp = time.monotonic(), time.strftime("%H%M%S")
    with cluster:
        print(f"faults: 2 prefill {cluster.prefill_addrs} + 2 decode {cluster.decode_addrs}, router "
              f"{cluster.address}; logs in {log_dir}", flush=True)
        run_streams(cluster.address, prompts, tokens, f"warmup{stamp}")
        reference, _ = run_streams(cluster.address, prompts, tokens, f"reference{stamp}")  # unfaulted: tokens, timing
        bad = [i for i, s in enumerate(reference) if s.error or len(s.tokens) != tokens]
        if bad:
            print(f"WARNING: the reference run lost streams {bad}: {[reference[i].error for i in bad]}", flush=True)
        ref_ttft_max = max(s.ttft for s in reference if s.error is None)
        hits: dict[str, tuple[str, str, float]] = {}  # fault → (victim, the work it held, seconds to exit)

        def kill(name: str, pool: str) -> None:
            victim, running = busiest(cluster, pool)
            cluster.process(victim).kill()
            hits[name] = (victim, running, 0.0)

        def drain(name: str, pool: str) -> None:
            victim, running = busiest(cluster, pool)
            proc, t = cluster.process(victim), time.monotonic()  # the instance's front process
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            hits[name] = (victim, running, time.monotonic() - t)

        cases = [("none", None, None, 0),
                 ("SIGKILL decode mid-stream", "decode", kill, streams_n * tokens // 3),
                 ("SIGTERM decode (drain)", "decode", drain, streams_n * tokens // 3),
                 ("SIGKILL prefill mid-prefill", "prefill", kill, 1)]
        for n, (name, pool, hit, after) in enumerate(cases):
            if not wait_placeable(cluster):
                notes.append(f"{name}: not every instance was placeable within 60 s before the run")
            before, tag = router_metrics(cluster), f"f{n}t{stamp}"
            print(f"{name} ...", flush=True)
            streams, t_fault = run_streams(cluster.address, prompts, tokens, tag,
                                  (lambda h=hit, a=name, p=pool: h(a, p)) if hit else None, after)
            time.sleep(0.5)  # the router's last observations and log lines land
            after_m = router_metrics(cluster)
            moved_streams = migrated(log_dir / "router.log", tag)
            whole = [i for i, s in enumerate(streams) if s.error is None and len(s.tokens) == tokens]
            failed = [i for i in range(streams_n) if i not in whole]
            wrong = [i for i in whole if streams[i].tokens != reference[i].tokens]
            matrix.append([name, len(whole), len(failed), len(wrong)])
            for i in failed:
                notes.append(f"{name}: stream {i} failed after {len(streams[i].tokens)} tokens: {streams[i].error}; "
                             f"router: {moved_streams.get(i, ['no migration line'])}")
            for i in wrong:
                first = next((j for j, (a, b) in enumerate(zip(streams[i].tokens, reference[i].tokens)) if a != b),
                             min(len(streams[i].tokens), len(reference[i].tokens)))
                notes.append(f"{name}: stream {i} differs from the unfaulted run from token {first} on; router: "
                             f"{moved_streams.get(i, ['no migration line'])}")
            mig = [streams[i] for i in whole if i in moved_streams]
            rest = [streams[i] for i in whole if i not in moved_streams]
            mig_ref = [reference[i] for i in whole if i in moved_streams]
            done = [streams[i] for i in whole]
            moved = delta(after_m, before, "pdserve_router_migrations_total")
            failovers = delta(after_m, before, "pdserve_router_failovers_total")
            p_sum = after_m.get("pdserve_router_migration_pause_seconds_sum", 0.0) - before.get(
                "pdserve_router_migration_pause_seconds_sum", 0.0)
            p_count = after_m.get("pdserve_router_migration_pause_seconds_count", 0.0) - before.get(
                "pdserve_router_migration_pause_seconds_count", 0.0)
            victim, running, _ = hits.get(name, ("-", "-", 0.0))
            migration_rows.append([name, victim, running,
                                   ", ".join(f"{label(k, 'cause')} {v:.0f}" for k, v in moved.items()) or "-",
                                   ", ".join(f"{label(k, 'pool')} {v:.0f}" for k, v in failovers.items()) or "-",
                                   f"{p_count:.0f}", f"{1e3 * p_sum / p_count:.0f}" if p_count else "-"])
            pauses.append([name, len(mig), fmt_ms([s.max_gap for s in mig], "median"),
                           fmt_ms([s.max_gap for s in mig], "max"), fmt_ms([s.max_gap for s in mig_ref], "median"),
                           fmt_ms([s.max_gap for s in rest], "median"), fmt_ms([s.max_gap for s in rest], "max"),
                           fmt_ms([s.ttft for s in done], "median"), fmt_ms([s.ttft for s in done], "max"),
                           sum(s.ttft > ref_ttft_max for s in done), fmt_ms([s.tpot for s in done], "median"),
                           gap_at([s.max_gap_at(t_fault) for s in mig]), gap_at([s.max_gap_at(t_fault) for s in rest])])
            if pool is not None:
                t = time.monotonic()
                cluster.restart(victim)
                print(f"  restarted {victim} in {time.monotonic() - t:.1f} s", flush=True)
    print(f"\nfault matrix: {streams_n} concurrent greedy streams × {tokens} tokens, 2 prefill + 2 decode, demo model "
          f"({time.monotonic() - t_start:.0f} s in all); wrong = whole but not equal to an earlier unfaulted run")
    print(table(["fault", "whole", "failed", "wrong"], matrix))
    print("\npauses seen by the clients (ms): 'migrated' = streams the router logged as migrated (by request_id); "
          "gap = a stream's largest gap between consecutive messages; 'unfaulted' = the same streams in the "
          f"unfaulted run; TTFT > ref = streams slower to their first token than any in the unfaulted run "
          f"({1e3 * ref_ttft_max:.0f} ms); TPOT = first to last token per stream, median over streams; gap at = when "
          "the largest gaps began (median, s after the fault)")
    print(table(["fault", "migrated", "gap p50", "gap max", "unfaulted p50", "rest gap p50", "rest gap max",
                 "TTFT p50", "TTFT max", "TTFT > ref", "TPOT p50", "gap at", "rest gap at"], pauses))
    print("\nrouter: the victim (the busiest of its pool when hit) and the work it held (requests running + waiting; "
          "prefill: prompt tokens queued), "
          "migrations by cause, "
          "failovers by pool, pdserve_router_migration_pause_seconds (count, mean ms)")
    print(table(["fault", "victim", "held", "migrations", "failovers", "pauses", "pause mean ms"],
                migration_rows))
    for name, (victim, _, seconds) in hits.items():
        if seconds:
            print(f"{name}: {victim} exited {seconds:.1f} s after SIGTERM")
    for note in notes:
        print("NOTE:", note)


# --- part 2: load step -------------------------------------------------------------------------------

PHASES = ((20.0, 1.0), (40.0, None), (40.0, 1.0))  # (seconds, rate factor; None: the step factor) at --scale 1
BLOCK, MAX_BLOCKS, MAX_OUTPUT = 16, 12, 48


@dataclass
class Arrival:
    t: float  # seconds after the start
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    arrival: float
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None

    @property
    def met(self) -> bool:
        return self.error is None and self.ttft is not None and self.ttft <= TTFT_SLO_S and (self.tpot or 0.0) \
            <= TPOT_SLO_S


def rate_at(t: float, base: float, factor: float, phases=PHASES) -> float:
    end = 0.0
    for seconds, f in phases:
        end += seconds
        if t < end:
            return base * (factor if f is None else f)
    return 0.0


def trace_requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    """The trace's first `n` requests in order: each hash id a fixed random block of BLOCK tokens."""
    if not TRACE.is_file():
        raise SystemExit(f"{TRACE}: no such file (the repository ships it; it is {TRACE_SOURCE})")
    out = []
    with open(TRACE) as f:
        for line in f:
            if len(out) == n:
                break
            r = json.loads(line)
            prompt = []
            for h in r["hash_ids"][:MAX_BLOCKS]:
                rng = random.Random(seed * 1_000_003 + h)
                prompt += [rng.randrange(2, VOCAB) for _ in range(BLOCK)]
            out.append((prompt, max(1, min(r["output_length"] // 8, MAX_OUTPUT))))
    return out


def schedule(base: float, factor: float, seed: int, phases=PHASES) -> list[Arrival]:
    """Poisson arrivals at the piecewise rate (thinning), prompts in trace order."""
    rng, peak, horizon = random.Random(seed), base * max(factor, 1.0), sum(s for s, _ in phases)
    times, t = [], 0.0
    while (t := t + rng.expovariate(peak)) < horizon:
        if rng.random() < rate_at(t, base, factor, phases) / peak:
            times.append(t)
    reqs = trace_requests(len(times), seed)
    return [Arrival(t, p, m) for t, (p, m) in zip(times, reqs)]


async def open_loop(address: str, arrivals: list[Arrival]) -> list[Result]:
    results = [Result(a.t) for a in arrivals]
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(a: Arrival, r: Result) -> None:
            sp = generation_pb2.SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            req = generation_pb2.GenerateRequest(prompt_token_ids=a.prompt, sampling_params=sp)
            t0, first, last, n = time.perf_counter(), None, None, 0
            try:
                async for msg in stub.Generate(req, timeout=180):
                    if msg.token_ids:
                        last = time.perf_counter()
                        first = first or last
                        n += len(msg.token_ids)
            except grpc.aio.AioRpcError as exc:
                r.error = f"{exc.code().name}: {exc.details()}"
                return
            if first is None:
                r.error = "no token"
                return
            r.ttft, r.tpot = first - t0, (last - first) / max(n - 1, 1)

        tasks, start = [], time.perf_counter()
        for a, r in zip(arrivals, results):
            await asyncio.sleep(max(0.0, start + a.t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(a, r)))
        await asyncio.gather(*tasks)
    return results


ONE_INSTANCE_UP_TO = 2.4  # × the base rate: the observed rate up to which B's profile fits one instance per pool


def slow_profile(base: float, arrivals: list[Arrival], headroom: float = 1.3) -> PerfModel:
    """The built-in PerfModel with prefill and decode stretched, each so that the autoscaler keeps one
    instance of its pool up to an observed ONE_INSTANCE_UP_TO × `base` req/s of this workload (the base
    rate fits 1 + 1 with Poisson noise to spare, the step needs more of each)."""
    isl = statistics.mean(len(a.prompt) for a in arrivals)
    osl = statistics.mean(a.max_tokens for a in arrivals)

    def capacity_of_one(perf: PerfModel, pool: str) -> float:
        c = Autoscaler(perf, TTFT_SLO_S, TPOT_SLO_S, Bounds(1, 3), Bounds(1, 3), headroom=headroom)
        return goodput(lambda r: getattr(c.needed(Observation(r, isl, osl)), pool) == 1, 1000.0)

    def stretch(pool: str) -> float:
        lo, hi = -3.0, 4.0  # log10 of the factor; capacity falls as it grows
        for _ in range(40):
            mid = (lo + hi) / 2
            perf = PerfModel().scaled(10 ** mid if pool == "prefill" else 1.0, 10 ** mid if pool == "decode" else 1.0)
            lo, hi = (mid, hi) if capacity_of_one(perf, pool) > ONE_INSTANCE_UP_TO * base else (lo, mid)
        return 10 ** hi

    return PerfModel().scaled(stretch("prefill"), stretch("decode"))


@dataclass
class Sizes:
    """The pools once a second: listed (what the router is told), alive (their processes still running),
    and what the router's autoscaler wants (pdserve_router_desired_instances; 0 without autoscaling)."""

    t: float
    listed: tuple[int, int]
    alive: tuple[int, int]
    desired: tuple[int, int]


def run_load(cluster: Cluster, arrivals: list[Arrival], autoscale: bool) -> dict:
    sizes: list[Sizes] = []
    crashes: list[str] = []  # exceptions that ended a thread (the autoscaling loop's)
    hook = threading.excepthook

    def record(exc: threading.ExceptHookArgs) -> None:
        crashes.append(f"t={time.perf_counter() - t0:.0f}s thread {exc.thread.name if exc.thread else '?'}: "
                       f"{exc.exc_type.__name__}: {exc.exc_value}")
        hook(exc)

    with cluster:
        scaler = LocalAutoscaler(cluster).start() if autoscale else None
        stop, t0 = threading.Event(), time.perf_counter()
        threading.excepthook = record

        def alive(addrs: list[str]) -> int:
            n = 0
            for a in list(addrs):
                try:
                    n += cluster.process(a).poll() is None
                except KeyError:  # listed before the cluster recorded its process
                    n += 1
            return n

        def poll() -> None:
            while True:
                want = (0, 0)
                if scaler is not None:
                    try:
                        d = scaler.desired()
                        want = (d.prefill, d.decode) if d else want
                    except OSError:
                        pass
                sizes.append(Sizes(time.perf_counter() - t0, (len(cluster.prefill_addrs), len(cluster.decode_addrs)),
                                   (alive(cluster.prefill_addrs), alive(cluster.decode_addrs)), want))
                if stop.wait(1.0):
                    return

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            results = asyncio.run(open_loop(cluster.address, arrivals))
            end = time.perf_counter() - t0
        finally:
            stop.set()
            poller.join(5)
            if scaler is not None:
                scaler.stop()
            threading.excepthook = hook
    return {"results": results, "sizes": sizes, "end": end, "crashes": crashes}


def instance_seconds(sizes: list[Sizes], end: float, which: str) -> float:
    """∫ (prefill + decode) dt over the once-a-second samples, up to `end`."""
    total = 0.0
    for s, nxt in zip(sizes, [*(x.t for x in sizes[1:]), end]):
        total += sum(getattr(s, which)) * max(0.0, min(nxt, end) - s.t)
    return total


def attainment(results: list[Result]) -> float:
    return sum(r.met for r in results) / len(results) if results else float("nan")


def load_step(log_dir: Path, base: float, factor: float, seed: int, scale: float = 1.0) -> None:
    phases, bin_s = tuple((seconds * scale, f) for seconds, f in PHASES), 10.0 * scale
    arrivals = schedule(base, factor, seed, phases)
    profile = slow_profile(base, arrivals)
    profile_path = Path(tempfile.mkdtemp(prefix="elastic-profile-")) / "profile.json"
    profile.save(profile_path)
    isl = statistics.mean(len(a.prompt) for a in arrivals)
    osl = statistics.mean(a.max_tokens for a in arrivals)
    print(f"load step: {len(arrivals)} requests, base {base:g} req/s, × {factor:g} for 40 s; prompt {isl:.0f} tokens "
          f"mean (max {max(len(a.prompt) for a in arrivals)}), output {osl:.0f} mean; profile for B: {profile_path} "
          f"(prefill ×{profile.prefill_per_token_s / PerfModel().prefill_per_token_s:.1f}, decode "
          f"×{profile.decode_base_s / PerfModel().decode_base_s:.1f} of the built-in model: one instance each up to "
          f"{ONE_INSTANCE_UP_TO * base:g} req/s observed)", flush=True)
    runs = {}
    for name, argv in (("A", ["--num-prefill", "1", "--num-decode", "1"]),
                       ("B", ["--autoscale", "1:3", "--autoscale-period", "2", "--autoscale-window", "4",
                              "--autoscale-down-after", "8", "--profile", str(profile_path)])):
        cluster = up_cluster(["--model", DEMO, "--port", "0", *argv], log_dir=log_dir / name)
        print(f"run {name}: pdserve up {' '.join(argv)} (logs in {log_dir / name}) ...", flush=True)
        runs[name] = run_load(cluster, arrivals, autoscale=name == "B")
        r = runs[name]["results"]
        print(f"  {len(r)} requests in {runs[name]['end']:.0f} s, {sum(x.error is not None for x in r)} failed, "
              f"attainment {attainment(r):.0%}", flush=True)

    horizon = sum(s for s, _ in phases)
    bins = [(i * bin_s, (i + 1) * bin_s) for i in range(round(horizon / bin_s))]
    rows, series = [], {"A": [], "B": []}

    def most(samples: list[Sizes], which: str) -> str:
        return f"{max(getattr(s, which)[0] for s in samples)}+{max(getattr(s, which)[1] for s in samples)}"

    for lo, hi in bins:
        per = {k: [x for x in v["results"] if lo <= x.arrival < hi] for k, v in runs.items()}
        in_bin = [s for s in runs["B"]["sizes"] if lo <= s.t < hi] or runs["B"]["sizes"][-1:]
        for k in series:
            series[k].append(100 * attainment(per[k]))
        rows.append([f"{lo:.0f}-{hi:.0f}", f"{len(per['A']) / bin_s:.1f}", most(in_bin, "desired"),
                     most(in_bin, "listed"), most(in_bin, "alive"),
                     f"{1e3 * pct([x.ttft for x in per['A'] if x.ttft is not None], 0.9):.0f}",
                     f"{1e3 * pct([x.ttft for x in per['B'] if x.ttft is not None], 0.9):.0f}",
                     f"{100 * attainment(per['A']):.0f}%", f"{100 * attainment(per['B']):.0f}%"])
    print(f"\nload step: SLA TTFT ≤ {TTFT_SLO_S:g} s and TPOT ≤ {1e3 * TPOT_SLO_S:.0f} ms per request (a failed one "
          f"misses), by arrival time; A = static 1+1, B = --autoscale 1:3; B's pools as prefill+decode (the most in "
          "the bin): desired by the router, listed by the cluster, alive (processes running)")
    print(table(["arrivals s", "req/s", "B desired", "B listed", "B alive", "TTFT p90 A ms", "TTFT p90 B ms",
                 "attain A", "attain B"], rows))
    step = (phases[0][0], phases[0][0] + phases[1][0])
    summary = []
    for k, v in runs.items():
        res = v["results"]
        during = [x for x in res if step[0] <= x.arrival < step[1]]
        listed, alive = (instance_seconds(v["sizes"], v["end"], which) for which in ("listed", "alive"))
        summary.append([k, f"{100 * attainment(res):.0f}%", f"{100 * attainment(during):.0f}%",
                        sum(x.error is not None for x in res), f"{v['end']:.0f}", f"{listed:.0f}", f"{alive:.0f}",
                        f"{listed / v['end']:.2f}"])
    print("\n" + table(["run", "attain all", "attain step", "failed", "run s", "instance-s listed", "instance-s alive",
                        "mean listed"], summary))
    for k, v in runs.items():
        errors = sorted({x.error for x in v["results"] if x.error})
        if errors:
            print(f"NOTE: run {k}: {len(errors)} kinds of error, e.g. {errors[:3]}")
        for crash in v["crashes"]:
            print(f"NOTE: run {k}: a thread died: {crash}")
        dead = [s for s in v["sizes"] if s.alive != s.listed]
        if dead:
            print(f"NOTE: run {k}: listed instances whose process had exited in {len(dead)} of {len(v['sizes'])} "
                  f"samples, first at t={dead[0].t:.0f}s (listed {dead[0].listed}, alive {dead[0].alive})")
    path = plot(OUT / "elastic.png", arrivals, runs, bins, series, base, factor, phases)
    print(f"plot: {path}")


def plot(path: Path, arrivals: list[Arrival], runs: dict, bins: list[tuple[float, float]], series: dict,
         base: float, factor: float, phases) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    width = bins[0][1] - bins[0][0]
    mids = [(lo + hi) / 2 for lo, hi in bins]
    edges = [0.0, *itertools.accumulate(s for s, _ in phases)]
    top.stairs([rate_at(t, base, factor, phases) for t in edges[:-1]], edges, label="offered", color="gray")
    top.bar(mids, [sum(lo <= a.t < hi for a in arrivals) / width for lo, hi in bins], width * 0.9, alpha=0.4,
            label="arrivals")
    top.set_ylabel("requests / s")
    top.set_title("load step: rate, B's pools, SLA attainment (TTFT ≤ 2 s, TPOT ≤ 200 ms)")
    top.legend(fontsize=8)
    sizes = runs["B"]["sizes"]
    ts = [s.t for s in sizes]
    for i, pool in enumerate(("prefill", "decode")):
        color = f"C{i}"
        mid.step(ts, [s.listed[i] + 0.03 * (2 * i - 1) for s in sizes], where="post", color=color,
                 label=f"B {pool} listed")
        mid.step(ts, [s.alive[i] + 0.03 * (2 * i - 1) for s in sizes], where="post", color=color, linestyle="--",
                 linewidth=2.5, alpha=0.5, label=f"B {pool} alive")
        mid.step(ts, [s.desired[i] + 0.03 * (2 * i - 1) for s in sizes], where="post", color=color, linestyle=":",
                 label=f"B {pool} desired")
    mid.axhline(1, color="gray", linewidth=0.8, label="A: 1 + 1")
    mid.set_ylabel("instances")
    mid.set_ylim(0, 5)
    mid.legend(fontsize=7, ncol=4, loc="upper right")
    for i, (k, values) in enumerate(series.items()):
        bottom.bar([m + (i - 0.5) * width * 0.4 for m in mids], values, width * 0.4, label=k)
    bottom.set_ylabel("attainment %")
    bottom.set_xlabel("arrival time (s)")
    bottom.set_ylim(0, 105)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", action="store_true", help="the fault matrix (2 prefill + 2 decode)")
    p.add_argument("--load-step", action="store_true", help="SLA attainment over a load step, static vs autoscaled")
    p.add_argument("--base-rate", type=float, default=6.0, help="requests / s before and after the step")
    p.add_argument("--step-factor", type=float, default=3.0)
    p.add_argument("--streams", type=int, default=24, help="--faults: concurrent streams")
    p.add_argument("--tokens", type=int, default=96, help="--faults: tokens per stream")
    p.add_argument("--scale", type=float, default=1.0, help="--load-step: phase lengths × this (20 s, 40 s, 40 s at 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="the services' logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    both = not (args.faults or args.load_step)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="elastic-logs-"))
    if args.faults or both:
        faults(log_dir / "faults", args.seed, args.streams, args.tokens)
    if args.load_step or both:
        load_step(log_dir / "load-step", args.base_rate, args.step_factor, args.seed, args.scale)


if __name__ == "__main__":
    main()
