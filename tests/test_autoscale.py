"""Elastic pools: the controller (router.autoscale) sizes M and N with the planner's model and hysteresis,
and `pdserve up --autoscale`'s loop starts instances and drains them while requests run: a load step
(rate × 3, then back) grows both pools and shrinks them again, and no request fails."""

from __future__ import annotations

import random
import threading
import time

import grpc

from router.autoscale import Autoscaler, Bounds, Observation, Target, observe, read_counters
from router.cli import LocalAutoscaler, up_cluster
from router.perf import PerfModel
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers import random_prompts, wait_for

# A model of a slow machine, so that the step needs a second instance of each kind: 1 req/s of 64 → 32
# tokens fits one prefill and one decode instance under TTFT 1 s / TPOT 80 ms, 3 req/s needs two of each.
SLOW = PerfModel(decode_base_s=0.04, decode_per_seq_s=0.004, prefill_per_token_s=3e-3)


def controller(down_after_s: float = 8.0) -> Autoscaler:
    return Autoscaler(SLOW, 1.0, 0.08, Bounds(1, 3), Bounds(1, 3), down_after_s=down_after_s)


def test_controller_grows_at_once_and_shrinks_one_at_a_time_after_a_low_window():
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


def test_load_step_grows_and_shrinks_the_pools_without_losing_a_request(tmp_path):
    """pdserve up --autoscale 1:3: the router decides, the cluster starts and drains instances."""
    SLOW_ROUTER.save(tmp_path / "profile.json")
    cluster = up_cluster(["--model", "models/demo-v32", "--port", "0", "--autoscale", "1:3", "--autoscale-period",
                          "2", "--autoscale-window", "4", "--autoscale-down-after", "8", "--profile",
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
                return 2.0 if 6 <= t < 26 else 0.5

            i = 0
            while (now := time.monotonic() - t0) < 70 and i < len(prompts):
                threads.append(threading.Thread(target=one, args=(prompts[i], time.monotonic())))
                threads[-1].start()
                i += 1
                time.sleep(rng.expovariate(rate(now)))
                if now > 40 and scaler.sizes() == Target(1, 1):
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
    in_step = [ttft for arrival, ttft, _ in results if 6 <= arrival < 26]
    print(f"\n{len(results)} requests, none failed; sizes {[(round(t - t0), s) for t, s in scaler.history]}; "
          f"TTFT ≤ 2 s for {sum(t <= 2.0 for t in in_step) / max(len(in_step), 1):.0%} of those sent during the step")
