"""How cheap can elastic pools be on the trace hour at all? A bound no autoscaler can beat, for
bench/trace_replay.py.

Cut the hour into segments of `segment_s` seconds. In each, let the pools take any size (M prefill, N decode) in a
range around the cheapest fixed split's, resized for free and at once, chosen knowing the whole hour: the
cheapest such schedule whose attainment over the hour reaches the goal is what a perfect-foresight autoscaler with
no boot time would spend. Each segment is simulated on its own at each size (its requests only, the pools warmed
by the WARM_S before it at the same size, as trace_replay.hindsight does), so a segment's requests met depend on
its own size only, and the cheapest schedule is a knapsack over segments. Its Lagrangian dual,

    max over λ >= 0 of  λ · need + Σ_segments min_sizes (instance-hours − λ · requests met),

is at most that schedule's cost: a lower bound, solved exactly (the dual is concave in λ; bisection on the
point where the schedule the inner minimum picks starts to meet `need`). The schedule picked just past that point
meets the goal: an achievable hindsight schedule, at most a few segments' upgrades above the bound. A causal
autoscaler pays boot time and forecast error on top, so where even this bound exceeds a target ratio to the
cheapest fixed split (--target, 0.9), no autoscaler can meet it on this trace and model.

    python bench/trace_bound.py [--scales 1,4,16] [--segments 600,300,120] [--below B] [--target 0.9]
                                [--goal 0.95] [--trace PATH] [--minutes M] [--jobs 2]

Scale 4 takes ~3 min on 2 cores; scale 16's search and its 10- and 5-minute bounds ~28 min (each segment at each
of 18 sizes is a simulation of 4 minutes of 16 copies of the trace). Prints a table and saves
bench/out/trace_bound.png (% of the cheapest fixed split against segment length, per scale). The README has the table.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import math
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from bench.common import OUT, line_plot, table
from bench.trace_replay import (
    GOAL,
    TRACE,
    Runner,
    _no_pool,
    scale_trace,
    search_static,
    segment_met,
    sim_args,
)
from router.autoscale import Target
from router.planner import TraceRequest, load_trace


@dataclass(frozen=True)
class Choice:
    """One size for one segment: its cost and the scored requests it meets."""

    segment: int
    size: Target
    hours: float
    met: int


@dataclass(frozen=True)
class Bound:
    """The dual's value (a lower bound on any schedule's instance-hours) and the schedule found at its optimum
    that meets the goal (instance-hours, attainment, the sizes it took, segments at the range's lower edge)."""

    segment_s: float
    lower_hours: float
    schedule_hours: float
    schedule_attainment: float
    sizes: tuple[Target, ...]
    at_floor: int


def _segment(job: tuple) -> tuple[int, int, int, int, int]:
    """One segment at one size: (segment, M, N, requests met, requests scored)."""
    k, segment_s, m, n, requests, args = job
    return k, m, n, *segment_met(requests, k * segment_s, segment_s, Target(m, n), args)


def segment_choices(runner: Runner, sizes: list[Target], segment_s: float, end_s: float) -> tuple[list[list[Choice]],
                                                                                                   int]:
    """Every segment at every size (simulated on the runner's pool): the choices per segment, and the number of
    requests scored over the hour. The last segment lasts until `end_s` (when the fixed split's last request
    ended), as the fixed split is charged."""
    span = runner.requests[-1].arrival
    segments = int(span // segment_s) + 1
    jobs = [(k, segment_s, t.prefill, t.decode, runner.requests, runner.args) for k in range(segments) for t in sizes]
    runs = runner.pool.map(_segment, jobs) if runner.pool else map(_segment, jobs)
    choices: list[list[Choice]] = [[] for _ in range(segments)]
    scored = [0] * segments
    for k, m, n, met, count in runs:
        length = segment_s if k + 1 < segments else max(segment_s, end_s - k * segment_s)
        choices[k].append(Choice(k, Target(m, n), (m + n) * length / 3600, met))
        scored[k] = count
    return choices, sum(scored)


def _pick(choices: list[list[Choice]], lam: float) -> list[Choice]:
    """Per segment the size minimizing hours − λ · met (ties: the cheaper)."""
    return [min(options, key=lambda c: (c.hours - lam * c.met, c.hours)) for options in choices]


def lagrangian_bound(choices: list[list[Choice]], scored: int, goal: float, segment_s: float,
                     floor: int) -> Bound | None:
    """The dual's maximum and the schedule at it that meets `goal` of the `scored` requests; None where no
    schedule in the range meets it. `floor`: the smallest prefill count in the range (segments picking it are
    counted: had the range gone lower, the bound could only have been lower there)."""
    need = math.ceil(goal * scored)

    def dual(lam: float) -> float:
        return lam * need + sum(c.hours - lam * c.met for c in _pick(choices, lam))

    def met(lam: float) -> int:
        return sum(c.met for c in _pick(choices, lam))

    lo, hi = 0.0, 1.0
    while met(hi) < need:
        hi *= 2
        if hi > 1e9:
            return None
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if met(mid) < need else (lo, mid)
    schedule = _pick(choices, hi)
    return Bound(segment_s, max(dual(lo), dual(hi)), sum(c.hours for c in schedule),
                 sum(c.met for c in schedule) / scored, tuple(c.size for c in schedule),
                 sum(c.size.prefill == floor for c in schedule))


def sizes_around(cheapest: Target, below: int, above: int) -> list[Target]:
    """Prefill counts from `below` under the cheapest split's to `above` over it, with its decode count and one
    fewer (where it has more than one)."""
    decodes: Iterable[int] = sorted({max(1, cheapest.decode - 1), cheapest.decode})
    prefills = range(max(1, cheapest.prefill - below), cheapest.prefill + above + 1)
    return [Target(m, n) for n in decodes for m in prefills]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--minutes", type=float, default=None, help="bound only the first MINUTES of the trace")
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--segments", default="600,300,120", help="segment lengths (s) to bound at")
    ap.add_argument("--goal", type=float, default=GOAL, help="the attainment every schedule must reach")
    ap.add_argument("--below", type=int, default=None, help="prefill counts under the cheapest split's tried "
                    "(default: a third of it, at least 3)")
    ap.add_argument("--target", type=float, default=0.9, help="the ratio to the cheapest fixed split asked for")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    trace = load_trace(a.trace, minutes=a.minutes)
    rows, curves = [], {}
    segments = sorted(float(x) for x in a.segments.split(","))
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else _no_pool() as pool:
        for scale in (int(x) for x in a.scales.split(",")):
            curves.update(bound_scale(trace, scale, segments, a, pool, rows))
    print(f"\n{len(rows)} bounds (sizes: prefill from the cheapest split's less --below to one more, its decode "
          f"count and one fewer):")
    print(table(HEADERS, rows))
    OUT.mkdir(parents=True, exist_ok=True)
    curves[f"target {a.target:.0%}"] = [100 * a.target] * len(segments)
    path = line_plot(OUT / "trace_bound.png", "Elastic pools with perfect foresight, free resizing: the bound",
                     [int(x) for x in segments], curves, "segment (s): how often the pools may resize",
                     "% of the cheapest fixed split's instance-hours")
    print(f"plot: {path}")


def bound_scale(trace: list[TraceRequest], scale: int, segments: list[float], a: argparse.Namespace, pool,
                rows: list[list[object]]) -> dict[str, list[float]]:
    """One scale's bounds at every segment length (a table row each, appended to `rows` and printed as it
    lands); the plot's curves (bound and schedule, % of the cheapest fixed split)."""
    requests = scale_trace(trace, scale)
    max_m, max_n = 4 * scale + 2, max(2, scale // 4 + 2)
    runner = Runner(requests, sim_args(scale, max_m, max_n), pool)
    t0 = time.perf_counter()
    cheapest = search_static(runner, max_m, max_n, a.goal)
    if cheapest is None:
        print(f"scale {scale}: no fixed split within M <= {max_m}, N <= {max_n} reaches {a.goal:.0%}")
        return {}
    base = runner.results[f"static {cheapest.prefill}P+{cheapest.decode}D"]
    below = a.below if a.below is not None else max(3, cheapest.prefill // 3)
    sizes = sizes_around(cheapest, below, 1)
    curves: dict[str, list[float]] = {f"{scale}x bound": [], f"{scale}x schedule": []}
    for seg in segments:
        choices, scored = segment_choices(runner, sizes, seg, base.end_s)
        b = lagrangian_bound(choices, scored, a.goal, seg, min(t.prefill for t in sizes))
        if b is None:
            print(f"scale {scale}, {seg:g}-s segments: no schedule in the size range reaches {a.goal:.0%}")
            continue
        lower, spent = b.lower_hours / base.instance_hours, b.schedule_hours / base.instance_hours
        curves[f"{scale}x bound"].append(100 * lower)
        curves[f"{scale}x schedule"].append(100 * spent)
        rows.append([scale, f"{cheapest.prefill}P+{cheapest.decode}D: {base.instance_hours:.2f} h", f"{seg:g}",
                     f"{b.lower_hours:.2f} ({lower:.2f}x)", f"{b.schedule_hours:.2f} ({spent:.2f}x), "
                     f"{100 * b.schedule_attainment:.1f} %", b.at_floor, "yes" if lower <= a.target else "no",
                     f"{time.perf_counter() - t0:.0f}"])
        print(table(HEADERS, rows[-1:]), flush=True)
    return curves


HEADERS = ["scale", "cheapest fixed split >= goal", "segment s", "lower bound, instance-h",
           "hindsight schedule meeting the goal", "segments at the range's floor", "bound <= target?", "wall s"]

if __name__ == "__main__":
    main()
