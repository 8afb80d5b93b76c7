"""M/N planning: how many prefill (M) and decode (N) instances a workload needs under TTFT/TPOT
targets, in two stages (the README's "Routing under SLA targets, and planning M/N" measures both):

* stage A, analytic: prefill is an M/G/m queue (the router sends each prompt to the least-queued
  instance, which behaves like one shared queue): Erlang C with the Allen–Cunneen correction and an
  exponential tail for the p90 wait; decode is Little's law per DP rank, batch B = λ·OSL·step(B), the
  p90 step taken at B + 1.28·√B;
* stage B, a discrete-event simulation of Poisson arrivals over simulated instances that asks **the
  router's own policy object** (router.policy) for every placement, with the same PerfModel.

Goodput (DistServe's metric) is the highest request rate at which the attainment target holds.

`simulate_trace` replays a recorded trace (arrival times, lengths, prefix-block hashes: Mooncake's format)
over pools that change size under a static M/N or the autoscaler (router.autoscale), with per-instance
prefix caches, startup delays, drains and migrations: SLA attainment against instance-hours
(bench/trace_replay.py).

Modules: stage_a (the vocabulary and the analytic model), stage_b (the simulation), report (`pdserve plan`),
trace (a recorded trace and its replay's result), instances (the replay's simulated instances), replay
(`simulate_trace`). This package's names are the planner's interface: import them from here.
"""

from router.planner.replay import ReplaySettings, TraceReplay, simulate_trace
from router.planner.report import run_plan
from router.planner.stage_a import Z90, Dist, Observation, Prediction, Target, Workload, analytic, goodput, plan
from router.planner.stage_b import SimResult, simulate
from router.planner.trace import TraceRequest, TraceResult, load_trace

__all__ = ["Z90", "Dist", "Observation", "Prediction", "ReplaySettings", "SimResult", "Target", "TraceReplay",
           "TraceRequest", "TraceResult", "Workload", "analytic", "goodput", "load_trace", "plan", "run_plan",
           "simulate", "simulate_trace"]
