"""Elastic pools: the controller (router.autoscale) sizes M and N with the planner's model and hysteresis,
and `pdserve up --autoscale`'s loop starts instances and drains them while requests run: a load step
(rate × 3, then back) grows both pools and shrinks them again, and no request fails. Several routers size
the pools for the sum of their load (their counters summed by Prometheus), and a decode instance of D DP
ranks is planned as D ranks."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from router.autoscale import (
    COUNTERS,
    Autoscaler,
    Bounds,
    FleetLoad,
    Observation,
    Target,
    observe,
    prometheus_query,
    read_counters,
)
from router.cli import up_cluster
from router.perf import PerfModel
from router.planner import TraceRequest, simulate_trace
from router.server import parse_args as router_args
from router.supervise import LocalAutoscaler
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers import random_prompts, wait_for

# A model of a slow machine, so that the step needs a second instance of each kind: 1 req/s of 64 → 32
# tokens fits one prefill and one decode instance under TTFT 1 s / TPOT 80 ms, 3 req/s needs two of each.
SLOW = PerfModel(decode_base_s=0.04, decode_per_seq_s=0.004, prefill_per_token_s=3e-3)


def controller(down_after_s: float = 8.0, hi: int = 3, ranks: int = 1) -> Autoscaler:
    return Autoscaler(SLOW, 1.0, 0.08, Bounds(1, hi), Bounds(1, hi), down_after_s=down_after_s, ranks=ranks,
                      window_s=2.0, headroom=1.3)  # the decision at t sees t - 2 .. t; SLOW is sized for +30 %


def test_controller_grows_at_once_and_shrinks_after_a_low_window():
    c, size = controller(down_after_s=10), Target(1, 1)
    assert c.needed(Observation(1.0, 64, 32)) == Target(1, 1) and c.needed(Observation(3.0, 64, 32)) == Target(2, 2)
    sizes = []
    for t in range(0, 60, 2):
        size = c.decide(t, Observation(3.0 if 10 <= t < 20 else 1.0, 64, 32), size)
        sizes.append(size)
    assert sizes[4] == Target(1, 1) and sizes[5] == Target(2, 2)  # up at the first window that needs it
    down = next(i for i, s in enumerate(sizes) if i > 5 and s == Target(1, 1))
    assert 2 * down - 18 >= 10  # not before a whole window of low load (the decision at t covers t - 2 .. t)
    assert sizes[-1] == Target(1, 1)


def test_observation_from_router_counters():
    samples = {("pdserve_router_arrivals_total", ()): 30.0, ("pdserve_router_e2e_seconds_count", ()): 28.0,
               ("pdserve_tokens_total", (("kind", "prompt"), ("service", "router"))): 1920.0,
               ("pdserve_tokens_total", (("kind", "output"), ("service", "router"))): 896.0,
               ("pdserve_tokens_total", (("kind", "cached_prompt"), ("service", "router"))): 960.0}
    zero = read_counters(lambda name, labels: None)
    obs = observe(zero, read_counters(lambda name, labels: samples.get((name, tuple(sorted(labels.items()))))), 10.0)
    assert obs == Observation(3.0, 64.0, 32.0, 32.0)


def test_prefill_is_sized_on_the_tokens_it_computes():
    """Prompts half found in prefill's prefix cache need the prefill of half-length prompts, and the decode of
    whole ones (their KV is sent and held whole)."""
    c = controller()
    cached = c.needed(Observation(3.0, 128, 32, mean_cached_prompt_tokens=64))
    assert cached.prefill == c.needed(Observation(3.0, 64, 32)).prefill < c.needed(Observation(3.0, 128, 32)).prefill
    assert cached.decode == c.needed(Observation(3.0, 128, 32)).decode


# The router's controller under its default targets (TTFT 2 s, TPOT 200 ms) with a model of a slow machine:
# 0.5 req/s of 64 → 32 tokens fits one instance of each kind, 2 req/s needs more (3 decode, 2 prefill).
SLOW_ROUTER = PerfModel(decode_base_s=0.1, decode_per_seq_s=0.01, prefill_per_token_s=6e-3)
# The load step (seconds from the first request): 2 req/s inside, 0.5 outside. With a 4 s window and a 4 s hold
# before each shrink the pools are back to (1, 1) some 15 s after it (with an 8 s hold: 25-30 s).
STEP_S = (6.0, 20.0)


def test_load_step_grows_and_shrinks_the_pools_without_losing_a_request(tmp_path):
    """pdserve up --autoscale 1:3: the router decides, the cluster starts and drains instances."""
    SLOW_ROUTER.save(tmp_path / "profile.json")
    cluster = up_cluster(["--model", "models/demo-v32", "--port", "0", "--autoscale", "1:3", "--autoscale-period",
                          "2", "--autoscale-window", "4", "--autoscale-down-after", "4", "--profile",
                          str(tmp_path / "profile.json")], log_dir=tmp_path / "logs")
    assert cluster.elastic
    prompts = random_prompts(400, [64], 4000, seed=9)
    results: list[tuple[float, float | None, str | None]] = []  # (arrival, TTFT, error)
    with cluster:
        scaler = LocalAutoscaler(cluster).start()
        try:
            rng, threads, t0 = random.Random(1), [], time.monotonic()
            sp = generation_pb2.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

            def one(prompt: list[int], arrival: float) -> None:
                try:
                    with grpc.insecure_channel(cluster.address) as ch:
                        first = None
                        for _ in generation_pb2_grpc.GenerationStub(ch).Generate(
                                generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=sp),
                                timeout=120):
                            first = first or time.monotonic() - arrival
                    results.append((arrival - t0, first, None))
                except grpc.RpcError as exc:
                    results.append((arrival - t0, None, f"{exc.code().name}: {exc.details()}"))

            def rate(t: float) -> float:
                return 2.0 if STEP_S[0] <= t < STEP_S[1] else 0.5

            i = 0
            while (now := time.monotonic() - t0) < 70 and i < len(prompts):
                threads.append(threading.Thread(target=one, args=(prompts[i], time.monotonic())))
                threads[-1].start()
                i += 1
                time.sleep(rng.expovariate(rate(now)))
                if now > STEP_S[1] + 8 and scaler.sizes() == Target(1, 1):
                    break
            for t in threads:
                t.join(120)
            assert wait_for(lambda: scaler.sizes() == Target(1, 1), timeout=60)
        finally:
            scaler.stop()
    errors = [e for _, _, e in results if e]
    assert not errors and len(results) == i
    peak = max((s.prefill + s.decode for _, s in scaler.history), default=2)
    assert peak >= 3, scaler.history  # the pools grew during the step
    in_step = [ttft for arrival, ttft, _ in results if STEP_S[0] <= arrival < STEP_S[1]]
    print(f"\n{len(results)} requests, none failed; sizes {[(round(t - t0), s) for t, s in scaler.history]}; "
          f"TTFT ≤ 2 s for {sum(t <= 2.0 for t in in_step) / max(len(in_step), 1):.0%} of those sent during the step")


# --- several routers ---------------------------------------------------------------------------------------

WINDOW_S = 120.0


def _router_series(namespace: str, pod: str, rate: float) -> list[tuple[str, dict[str, str], float]]:
    """What Prometheus holds of one router that served `rate` req/s of 64 → 32 tokens over the window:
    (metric, labels, increase over the window) per counter of COUNTERS."""
    n = rate * WINDOW_S
    per = {"arrivals": n, "prompt_tokens": 64 * n, "cached_prompt_tokens": 0.0, "output_tokens": 32 * n,
           "completed": n}
    return [(name, {**labels, "namespace": namespace, "pod": pod}, per[key])
            for key, (name, labels) in COUNTERS.items()]


class FakePrometheus:
    """Prometheus' instant-query API over fixed series, for the one query shape the fleet sends:
    sum(increase(NAME{MATCHERS}[Ws])) (= and =~ matchers; no series matched: an empty vector)."""

    QUERY = re.compile(r"sum\(increase\((\w+)\{(.*)\}\[(\d+)s\]\)\)")
    MATCHER = re.compile(r'(\w+)(=~|=)"((?:[^"\\]|\\.)*)"')

    def __init__(self, series: list[tuple[str, dict[str, str], float]]):
        self.series, self.queries = series, []

    def value(self, promql: str) -> float | None:
        self.queries.append(promql)
        name, matchers, window = self.QUERY.fullmatch(promql).groups()
        assert float(window) == WINDOW_S
        wanted = self.MATCHER.findall(matchers)
        hits = [v for n, labels, v in self.series if n == name and all(
            re.fullmatch(want, labels.get(k, "")) if op == "=~" else labels.get(k) == want for k, op, want in wanted)]
        return sum(hits) if hits else None

    def serve(self) -> ThreadingHTTPServer:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                url = urllib.parse.urlparse(self.path)
                assert url.path == "/api/v1/query"
                value = fake.value(urllib.parse.parse_qs(url.query)["query"][0])
                result = [] if value is None else [{"metric": {}, "value": [time.time(), str(value)]}]
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


def test_several_routers_size_the_pools_for_the_sum_of_their_load():
    """Three routers of the release at 2 req/s each (and one of another release at 50 req/s): each alone
    needs (1, 1) and the old KEDA query's max of their decisions sized the pools for one third of the load;
    adding their decisions would say (3, 3). With the fleet's load (their counters summed by Prometheus,
    read over HTTP as the router reads it) every router decides what one router seeing all 6 req/s decides."""
    selector = 'namespace="ml",pod=~"demo-pdserve-router-.+"'
    series = [x for pod in ("demo-pdserve-router-a1", "demo-pdserve-router-b2", "demo-pdserve-router-c3")
              for x in _router_series("ml", pod, 2.0)] + _router_series("other", "demo-pdserve-router-zz", 50.0)
    prometheus = FakePrometheus(series)
    server = prometheus.serve()
    try:
        fleet = FleetLoad(prometheus_query(f"http://127.0.0.1:{server.server_port}"), selector, WINDOW_S, 5.0,
                          background=False)
        whole = fleet.refresh()
    finally:
        server.shutdown()
    assert whole == Observation(6.0, 64.0, 32.0, 0.0)
    assert all(selector in q and f"[{WINDOW_S:.0f}s]" in q for q in prometheus.queries)
    one = Observation(2.0, 64, 32)
    alone = [controller().decide(0.0, one, Target(1, 1)) for _ in range(3)]
    assert alone == [Target(1, 1)] * 3  # what each router decided on its own counters
    everything = controller(hi=8).decide(0.0, Observation(6.0, 64, 32), Target(1, 1))
    assert everything == Target(2, 3)  # one router that saw all the load
    routers = [Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 8), Bounds(1, 8), fleet=fleet) for _ in range(3)]
    assert [r.decide(0.0, one, Target(1, 1)) for r in routers] == [everything] * 3


def test_a_router_that_cannot_read_the_fleet_decides_on_its_own_load():
    """Prometheus unreachable (or no router of the selector scraped yet): the router's own counters, a lower
    bound of the fleet's load, so the largest decision KEDA takes is the best one available."""
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fleet = FleetLoad(prometheus_query(f"http://127.0.0.1:{port}", timeout=2.0), "", WINDOW_S, 5.0,
                      background=False)
    assert fleet.refresh() is None
    own = Observation(3.0, 64, 32)
    assert fleet.observation(own) is own
    empty = FleetLoad(FakePrometheus([]).value, 'namespace="ml"', WINDOW_S, 5.0, background=False)
    assert empty.refresh() is None and empty.observation(own) is own


def test_the_router_reads_the_fleet_on_a_thread_of_its_own():
    """The decision loop never waits on Prometheus: the first decision uses the router's own load, the
    next ones the fleet's, read in the background every period."""
    prometheus = FakePrometheus(_router_series("ml", "r-1", 2.0) + _router_series("ml", "r-2", 1.0))
    fleet = FleetLoad(prometheus.value, 'namespace="ml"', WINDOW_S, 0.2)
    own = Observation(2.0, 64, 32)
    first = fleet.observation(own)
    assert wait_for(lambda: fleet.observation(own) == Observation(3.0, 64.0, 32.0, 0.0), timeout=10)
    assert first is own or first == Observation(3.0, 64.0, 32.0, 0.0)


def test_the_router_flags_build_the_fleet_and_the_dp_ranks():
    base = ["--model", "m", "--prefill", "p:1", "--decode", "d:1", "--autoscale", "1:8"]
    plain = router_args(base).autoscaler(SLOW)
    assert plain.fleet is None and plain.ranks == 1
    cfg = router_args([*base, "--decode-dp", "4", "--autoscale-prometheus", "http://prom:9090",
                       "--autoscale-routers", 'namespace="ml"', "--autoscale-window", "60"])
    scaler = cfg.autoscaler(SLOW)
    assert scaler.ranks == 4 and scaler.fleet is not None
    assert scaler.fleet.selector == 'namespace="ml"' and scaler.fleet.window_s == 60.0
    assert all('namespace="ml"' in q and "[60s]" in q for q in scaler.fleet.queries().values())


def test_dp_decode_instances_are_planned_and_replayed_with_their_ranks():
    """A decode instance of D ranks serves D ranks' batches: at 8 req/s the controller wants 4 one-rank
    decode instances, 2 of two ranks, 1 of four. The trace replay steps the ranks in lock-step: one instance
    of 2 ranks serves what one of 1 rank cannot, and the autoscaler planning ranks asks for fewer instances."""
    load = Observation(8.0, 64, 32)
    assert [controller(hi=8, ranks=d).needed(load).decode for d in (1, 2, 4)] == [4, 2, 1]
    flat = PerfModel(prefill_base_s=0.1, prefill_per_token_s=0.0, decode_base_s=0.01, decode_per_seq_s=0.002,
                     decode_per_context_token_s=0.0, transfer_bytes_per_s=1e15)
    rng, reqs, t = random.Random(0), [], 0.0
    while (t := t + rng.expovariate(4.0)) < 60:
        reqs.append(TraceRequest(t, 16, 100))
    one_rank = simulate_trace(flat, reqs, Target(1, 1), ttft_s=2.0, tpot_s=0.025)
    two_ranks = simulate_trace(flat, reqs, Target(1, 1), ttft_s=2.0, tpot_s=0.025, ranks=2)
    assert one_rank.attainment < 0.7 and two_ranks.attainment > 0.9
    peaks = {}
    for d in (1, 2):
        scaler = Autoscaler(flat, 2.0, 0.025, Bounds(1, 4), Bounds(1, 4), headroom=1.0, ranks=d, window_s=2.0)
        replay = simulate_trace(flat, reqs, scaler, ttft_s=2.0, tpot_s=0.025, period=2.0, startup_s=0.0, ranks=d)
        assert replay.attainment > 0.95
        peaks[d] = max(n for _, _, n in replay.sizes)
    assert peaks[2] < peaks[1]


def test_forecast_follows_a_trend_and_learns_its_margin():
    """Holt's trend through the windows' midpoints extrapolates a steady ramp; the margin is what the forecasts
    missed by: back to 1 on a steady ramp once the trend has it (the first, wrong forecasts forgotten), above 1
    once the load jumps past what the forecasts said."""
    from router.forecast import LoadForecast

    f = LoadForecast(window_s=20.0)
    for t in range(20, 1000, 5):  # arrivals / s = 0.01 × time: a window's mean is its middle's rate
        rate = 0.01 * (t - 10)
        f.observe(float(t), Observation(rate, 100, 10))
        ahead = f.ahead(float(t), 60.0, Observation(rate, 100, 10))
    assert f.margin.value < 1.02 and abs(ahead.rate - 0.01 * (995 + 60)) < 0.3
    for t in range(1000, 1200, 5):  # a step up no trend foresaw
        f.observe(float(t), Observation(20.0, 100, 10))
        f.ahead(float(t), 60.0, Observation(20.0, 100, 10))
    assert f.margin.value > 1.2


def test_planning_ahead_grows_a_boot_time_before_the_load_needs_it():
    """On a ramp, the controller with lead_s = the boot time asks for the second instances before the reactive
    one does (once they serve, the load needs them)."""
    def first_growth(lead_s: float) -> float:
        c = Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 3), Bounds(1, 3), headroom=1.0, lead_s=lead_s, window_s=20.0)
        size = Target(1, 1)
        for t in range(20, 600, 5):
            size = c.decide(float(t), Observation(0.5 + 0.005 * (t - 10), 64, 32), size)
            if size != Target(1, 1):
                return float(t)
        return float("inf")

    reactive, ahead = first_growth(0.0), first_growth(60.0)
    assert ahead < reactive < float("inf") and reactive - ahead >= 30


def test_a_pool_shrinks_to_what_the_hold_time_needed_and_a_window_just_begun_decides_nothing():
    """After a spike, a low window brings both pools down to what it needed at once (the previous
    controller drained one instance per hold time); a decision on a few seconds of counts keeps the sizes."""
    c = Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 8), Bounds(1, 8), down_after_s=10.0, window_s=20.0)
    assert c.decide(0.0, Observation(30.0, 64, 32, seconds=2.0), Target(1, 1)) == Target(1, 1)
    size = c.decide(5.0, Observation(12.0, 64, 32, seconds=20.0), Target(1, 1))
    assert size.prefill >= 3 and size.decode >= 3
    for t in range(10, 40, 5):
        size = c.decide(float(t), Observation(1.0, 64, 32, seconds=20.0), size)
    assert size == Target(1, 1)
    one_by_one = Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 8), Bounds(1, 8), down_after_s=10.0, window_s=20.0,
                            down_to_most=False)
    size = one_by_one.decide(5.0, Observation(12.0, 64, 32, seconds=20.0), Target(1, 1))
    for t in range(10, 40, 5):
        size = one_by_one.decide(float(t), Observation(1.0, 64, 32, seconds=20.0), size)
    assert size != Target(1, 1)  # still draining, one instance per hold time


def test_the_burst_margin_is_the_arrivals_noise_and_shrinks_as_the_fleet_grows():
    """The load seen is sized with burst_sigmas standard deviations of its arrival count on top (× (1 + z/√k)
    for k arrivals): 9 arrivals are planned as twice their rate, 900 as 1.1 times; counts of no known span
    (an observation without seconds) get the headroom alone; 16 times the load, a quarter of the margin."""
    shipped = Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 64), Bounds(1, 64), window_s=20.0)
    assert (shipped.headroom, shipped.burst_sigmas) == (1.0, 3.5)
    c = Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 64), Bounds(1, 64), window_s=20.0, burst_sigmas=3.0)
    assert c.margin(Observation(0.45, 64, 32, seconds=20.0)) == 2.0
    assert abs(c.margin(Observation(45.0, 64, 32, seconds=20.0)) - 1.1) < 1e-12
    assert c.margin(Observation(45.0, 64, 32)) == 1.0
    plain = Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 64), Bounds(1, 64), window_s=20.0, burst_sigmas=0.0)
    for rate in (0.45, 3.0, 45.0):
        seen = Observation(rate, 64, 32, seconds=20.0)
        assert c.needed(seen) == plain.needed(Observation(rate * c.margin(seen), 64, 32))
    small, large = (c.margin(Observation(r, 64, 32, seconds=20.0)) - 1.0 for r in (1.0, 16.0))
    assert abs(large - small / 4) < 1e-12  # 16x the load: a quarter of the margin


def test_pdserve_up_refuses_bad_autoscale_knobs_before_starting_anything():
    """A negative or NaN burst margin (NaN passes every `<` bound) is one line naming the flag, exit 2, and
    nothing started (no traceback from a router that died on it)."""
    import subprocess
    import sys

    for value, why in (("-1", "expected at least 0.0"), ("nan", "expected a number")):
        done = subprocess.run([sys.executable, "-m", "router.cli", "up", "--autoscale", "1:3",
                               "--autoscale-burst-sigmas", value, "--port", "0"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and f"--autoscale-burst-sigmas: {why}" in done.stderr, done.stderr
        assert "starting" not in done.stdout and "Traceback" not in done.stderr
