"""The planner's trace replay (router.planner.simulate_trace): time-varying pools under the router's
policy, the autoscaler growing and shrinking them, drains and migrations losing nothing, prefix sharing,
and attainment / instance-hours that can be checked by hand."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest

from bench import trace_replay
from router.autoscale import Autoscaler, Bounds, Target
from router.perf import PerfModel
from router.planner import TraceRequest, simulate_trace

FIRST_MINUTES = Path(__file__).parent / "data" / "mooncake_conversation_first_2min.jsonl"

# Prefill takes 100 ms whatever the prompt; a decode step takes 10 ms + 2 ms per running request; no transfer.
FLAT = PerfModel(prefill_base_s=0.1, prefill_per_token_s=0.0, decode_base_s=0.01, decode_per_seq_s=0.002,
                 decode_per_context_token_s=0.0, transfer_bytes_per_s=1e15)


def _served(result) -> int:
    return sum(1 for x in result.ttft if not math.isinf(x))


def test_attainment_and_instance_hours_by_hand():
    """Two 64-token prompts arrive together at one prefill and one decode instance. The first: prefilled
    0-0.1 s (TTFT 0.1 s), then two decode steps of 12 ms (TPOT 12 ms). The second would wait for the
    first: predicted TTFT 0.2 s, over 90% of a 0.15 s target, so the policy refuses it at once: attainment
    1/2. With a 0.25 s target both are served (TTFT 0.1 and 0.2 s) and both meet it. Two instances from
    t = 0 to the last token: instance-hours 2 × end / 3600."""
    reqs = [TraceRequest(0.0, 64, 3), TraceRequest(0.0, 64, 3)]
    tight = simulate_trace(FLAT, reqs, Target(1, 1), ttft_s=0.15, tpot_s=1.0)
    assert tight.rejected == 1 and tight.met == [True, False] and tight.attainment == 0.5
    assert tight.ttft[0] == pytest.approx(0.1) and tight.tpot[0] == pytest.approx(0.012)
    assert tight.end_s == pytest.approx(0.124)
    assert tight.instance_hours == pytest.approx(2 * 0.124 / 3600)
    loose = simulate_trace(FLAT, reqs, Target(1, 1), ttft_s=0.25, tpot_s=1.0)
    assert loose.rejected == 0 and loose.attainment == 1.0
    assert sorted(loose.ttft) == pytest.approx([0.1, 0.2])
    # a TPOT target below the 12 ms step: served, but no request meets the SLA
    assert simulate_trace(FLAT, reqs, Target(1, 1), ttft_s=0.25, tpot_s=0.011).attainment == 0.0


def test_prefix_sharing_computes_only_the_uncached_blocks_and_places_on_the_instance_holding_them():
    """Two 2,048-token prompts with the same four 512-token block hashes, a second apart: the second computes
    one token (a prompt always computes at least one), and of two idle prefill instances the policy sends it
    to the one holding the prefix. Different hashes: both compute everything."""
    perf = PerfModel(prefill_base_s=0.01, prefill_per_token_s=1e-4, decode_base_s=0.01, decode_per_seq_s=0.0,
                     decode_per_context_token_s=0.0, transfer_bytes_per_s=1e15)
    shared = [TraceRequest(0.0, 2048, 2, (1, 2, 3, 4)), TraceRequest(1.0, 2048, 2, (1, 2, 3, 4))]
    apart = [TraceRequest(0.0, 2048, 2, (1, 2, 3, 4)), TraceRequest(1.0, 2048, 2, (5, 6, 7, 8))]
    for m in (1, 2):
        hit = simulate_trace(perf, shared, Target(m, 1), ttft_s=1.0, tpot_s=1.0, block_tokens=512)
        assert hit.prompt_tokens == 4096 and hit.computed_tokens == 2048 + 1, m
        assert hit.ttft[1] == pytest.approx(0.01 + 1e-4)  # one token's worth
    miss = simulate_trace(perf, apart, Target(2, 1), ttft_s=1.0, tpot_s=1.0, block_tokens=512)
    assert miss.computed_tokens == 4096 and miss.cache_hit_rate == 0.0
    # a cache of 2 blocks keeps only the most recent two: the first two blocks are gone, nothing matches
    small = simulate_trace(perf, shared, Target(1, 1), ttft_s=1.0, tpot_s=1.0, block_tokens=512,
                           prefix_cache_blocks=2)
    assert small.computed_tokens == 4096


def _step_trace(seed: int = 0) -> list[TraceRequest]:
    """Two minutes: 2 req/s for 40 s, 25 req/s for 40 s, 2 req/s for 40 s (Poisson), 64-token prompts,
    20 output tokens."""
    rng, out, t = random.Random(seed), [], 0.0
    for end, rate in ((40.0, 2.0), (80.0, 25.0), (120.0, 2.0)):
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            out.append(TraceRequest(t, 64, 20))
    return out


def test_the_autoscaler_grows_then_shrinks_the_pools_and_loses_no_request():
    """Prefill serves 10 req/s per instance, so 25 req/s needs three (the planner's M/G/m under a 1 s TTFT
    p90); the autoscaler starts at its minimum, grows within a decision period or two of the step (+5 s to
    boot) and shrinks again once the load has stayed low for 10 s. Every request is either served whole
    or refused at arrival; it costs far fewer instance-hours than the static maximum and attains far
    more than the static minimum."""
    reqs = _step_trace()
    scaler = Autoscaler(FLAT, 1.0, 0.05, Bounds(1, 4), Bounds(1, 4), headroom=1.0, down_after_s=10.0, window_s=2.0)
    auto = simulate_trace(FLAT, reqs, scaler, ttft_s=1.0, tpot_s=0.05, period=2.0, startup_s=5.0)
    peak = max(m for _, m, _ in auto.sizes)
    assert auto.sizes[0][1:] == (1, 1) and peak >= 3
    grown = next(t for t, m, _ in auto.sizes if m >= 3)
    assert 40.0 < grown < 46.0  # the first decision that sees the step
    assert auto.sizes[-1][1:] == (1, 1) and auto.sizes[-1][0] > 80.0  # back to the minimum after the step
    assert _served(auto) + auto.rejected == len(reqs)
    assert all(not math.isinf(t) for t, x in zip(auto.tpot, auto.ttft) if not math.isinf(x))
    most = simulate_trace(FLAT, reqs, Target(4, 4), ttft_s=1.0, tpot_s=0.05)
    least = simulate_trace(FLAT, reqs, Target(1, 1), ttft_s=1.0, tpot_s=0.05)
    assert most.rejected == 0 and most.attainment == 1.0
    assert auto.instance_hours < 0.6 * most.instance_hours
    assert least.attainment + 0.2 < auto.attainment  # growing pays; booting 5 s behind the step costs some
    # the series: per minute the arrivals, mean pool sizes and attainment
    assert len(auto.series) == 2 and auto.series[1][1] > auto.series[0][1]
    assert 1.0 <= auto.series[0][2] <= 4.0


class _Scripted:
    """A controller that shrinks both pools from 2 to 1 at t = 3 s (a drain of each kind under load)."""

    def decide(self, now, obs, current):
        return Target(2, 2) if now < 3.0 else Target(1, 1)


def test_a_removed_decode_instance_migrates_its_requests_and_a_removed_prefill_finishes_its_queue():
    """At t = 3 s one decode instance leaves with requests mid-generation: each is re-prefilled (prompt +
    generated tokens) and finishes its remaining tokens elsewhere, its TPOT including the pause; the
    prefill instance that leaves serves its queue first. No request is lost, none is generated twice."""
    reqs = [TraceRequest(0.05 * i, 64, 200) for i in range(80)]
    res = simulate_trace(FLAT, reqs, _Scripted(), ttft_s=10.0, tpot_s=1.0, period=1.0, startup_s=0.0,
                         initial=Target(2, 2))
    assert res.rejected == 0 and _served(res) == len(reqs)
    assert res.migrations > 0
    assert res.prompt_tokens > 64 * len(reqs)  # the re-prefills: prompt + generated tokens
    assert [s[1:] for s in res.sizes] == [(2, 2), (1, 1)]
    # one decode instance at 200 tokens: a step of 10 ms + 2 ms per request (80 running: 170 ms)
    assert max(res.tpot) < 0.5


def test_the_bench_runs_on_two_minutes(tmp_path, monkeypatch, capsys):
    """bench/trace_replay.py's main on the first two minutes of the real trace (346 requests, kept in
    tests/data: Mooncake's FAST'25 trace, Apache-2.0, tests/data/LICENSE-mooncake-trace), in-process (its plot
    is left to tests/test_bench_smoke.py: matplotlib alone takes seconds)."""
    monkeypatch.setattr(trace_replay, "OUT", tmp_path)
    monkeypatch.setattr(trace_replay, "_plot", lambda path, results, args: path.write_bytes(b""))
    trace_replay.main(["--trace", str(FIRST_MINUTES), "--minutes", "2", "--max-m", "4", "--max-n", "2", "--jobs", "1",
                       "--goal", "0.9"])  # two minutes' ceiling is under 95 %
    out = capsys.readouterr().out
    assert "(cheapest >= 90%)" in out and "autoscaler, as shipped" in out and "autoscaler, planning ahead" in out
    assert re.search(r"scale 1: cheapest fixed split >= 90%: \dP\+\dD", out)
    assert (tmp_path / "trace_replay.png").exists() and (tmp_path / "trace_replay.json").exists()


def test_instances_on_shared_cores_add_no_compute():
    """Where the perf model says the instances share cores (interference 1: two engines computing take twice as
    long each), a second prefill instance ends a burst no sooner than one; on dedicated hardware it ends it
    sooner. Eight 64-token prompts 20 ms apart, a generous target (none refused)."""
    from dataclasses import replace

    shared = replace(FLAT, prefill_interference=1.0, decode_interference=1.0)
    reqs = [TraceRequest(0.02 * i, 64, 2) for i in range(8)]
    end = {(name, m): simulate_trace(perf, reqs, Target(m, 1), ttft_s=2.0, tpot_s=60.0).end_s
           for name, perf in (("dedicated", FLAT), ("shared", shared)) for m in (1, 2)}
    assert end["dedicated", 2] < 0.9 * end["dedicated", 1]
    assert end["shared", 2] >= 0.99 * end["shared", 1]


def test_the_elastic_bound_is_below_every_schedule_that_meets_the_goal():
    """trace_bound's Lagrangian bound on random knapsacks of segments × sizes: never above the cheapest
    combination (found by brute force) that meets the goal, and the schedule it returns meets the goal and costs
    no less than that optimum; a goal no combination meets gives None. Then on two minutes of the trace at three
    sizes through the simulation: the bound sits at or below the cheapest fixed size's hours."""
    import itertools

    from bench import trace_bound

    rng = random.Random(3)
    for _ in range(40):
        segments, sizes = rng.randint(2, 4), rng.randint(2, 4)
        choices = []
        for k in range(segments):
            mets = sorted(rng.randint(0, 50) for _ in range(sizes))
            choices.append([trace_bound.Choice(k, Target(m + 1, 1), (m + 2) * 0.1, mets[m]) for m in range(sizes)])
        scored, goal = 50 * segments, rng.uniform(0.3, 1.0)
        need = math.ceil(goal * scored)
        feasible = [sum(c.hours for c in combo) for combo in itertools.product(*choices)
                    if sum(c.met for c in combo) >= need]
        bound = trace_bound.lagrangian_bound(choices, scored, goal, 60.0, 1)
        if not feasible:
            assert bound is None
            continue
        assert bound.lower_hours <= min(feasible) + 1e-9 <= bound.schedule_hours + 1e-9
        assert bound.schedule_attainment * scored >= need - 1e-9 and len(bound.sizes) == segments
    requests = [r for r in trace_replay.load_trace(str(trace_replay.TRACE)) if r.arrival < 120]
    args = {"ttft_s": 5.0, "tpot_s": 0.05, "startup_s": 60.0, "candidates": None, "decode_kv_tokens": 1 << 40,
            "cache_blocks": int(trace_replay.PREFILL_KV_BYTES / trace_replay.KV_BYTES / trace_replay.BLOCK_TOKENS)}
    runner = trace_replay.Runner(requests, args, None)
    (fixed,) = runner.static([Target(2, 1)])
    choices, scored = trace_bound.segment_choices(runner, trace_bound.sizes_around(Target(2, 1), 1, 1), 60.0,
                                                  fixed.end_s)
    assert scored == len(requests) and [len(c) for c in choices] == [3, 3]
    bound = trace_bound.lagrangian_bound(choices, scored, fixed.attainment, 60.0, 1)
    assert bound is not None and bound.lower_hours <= fixed.instance_hours + 1e-9
