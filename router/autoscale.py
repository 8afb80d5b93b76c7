"""Elastic pools: how many prefill (M) and decode (N) instances the observed load needs, decided with the
planner's own model (router.planner.plan: each side's capacity per instance under the SLA targets) and
with hysteresis, so a pool grows at once when the load needs it and shrinks only after the load has
stayed low for a while (a scale-down drains its instance: its requests move, none is lost).

The controller is pure (observations in, targets out). The router runs it (`--autoscale MIN:MAX`) on its
counters and exports the decision as `pdserve_router_desired_instances{pool}`: `pdserve up` starts and
drains local instances to it, the chart's KEDA ScaledObjects scale each pool to it; the planner's trace
replay runs the same controller against simulated time. A decode instance of D DP ranks is planned as D
ranks' batches (`ranks`, the router's --decode-dp), as the planner's stage A and B plan them.

Several routers (the chart's router.replicas > 1) each see only the requests sent to them. Their decisions
are not added (a pool's need is not linear in its load: queueing pools instances, and every router would
add its own minimum), nor is one router's need multiplied by R (clients and load balancers do not spread
load evenly). Instead every router decides from the whole fleet's load: `FleetLoad` reads every router's
counters summed by Prometheus (`sum(increase(...[window]))`, which also handles a router's restart and a
router gone mid-window) and feeds the one performance model and hysteresis here. The routers then decide
alike, and the KEDA query takes their largest decision: while Prometheus cannot be read a router falls back
to its own counters, a lower bound of the fleet's load, and the largest lower bound is the best one.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from router.forecast import LoadForecast
from router.perf import PerfModel
from router.planner import Dist, Observation, Target, Workload, analytic, plan
from shared.config import flag, knob_default

AUTOSCALE_TTFT_MS, AUTOSCALE_TPOT_MS = 2000.0, 200.0  # the targets sized for when the router has none
FLEET_STALE_PERIODS = 3  # a fleet reading older than this many decision periods is not used
log = logging.getLogger("pdserve.router")


@dataclass
class AutoscaleConfig:
    """`pdserve up`'s autoscaling flags."""

    autoscale: str | None = flag(None, "size each pool within MIN:MAX instances from the load the router sees (the "
                                       "planner's model under --ttft-slo-ms / --tpot-slo-ms); scale-down drains an "
                                       "instance")
    autoscale_period: float = flag(5.0, "seconds between autoscaling decisions", bounds=(0.5, None))
    autoscale_down_after: float = flag(120.0, "seconds the load must need fewer instances before the pool shrinks "
                                              "(to the most that time needed)", bounds=(0.0, None))
    autoscale_window: float = flag(120.0, "seconds of load each decision looks back over (longer than the decision "
                                          "period: a few heavy prompts in one period must not resize the pools)",
                                   bounds=(0.5, None))
    autoscale_headroom: float = flag(1.0, "plan for this much more load than observed, on top of the burst margin",
                                     bounds=(1.0, None))
    autoscale_burst_sigmas: float = flag(3.5, "plan for the load this many standard deviations above the window's "
                                              "count of arrivals (Poisson: x (1 + z / sqrt(arrivals))): a small "
                                              "fleet's load swings more, relative to it, than a large one's",
                                         bounds=(0.0, None))
    autoscale_lead: float = flag(0.0, "plan ahead: size the pools for the load forecast this many seconds from "
                                      "now (an instance's boot time: asked for now, it serves then), times a "
                                      "margin learned from the forecast's own recent errors (0: the load seen)",
                                 bounds=(0.0, None))


@dataclass(frozen=True)
class Bounds:
    """Instances a pool may have: MIN:MAX."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Bounds:
        try:
            low, high = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"--autoscale {text!r}: expected MIN:MAX instances, e.g. 1:4") from None
        if not 1 <= low <= high:
            raise ValueError(f"--autoscale {text!r}: need 1 <= MIN <= MAX")
        return cls(low, high)


@dataclass
class Autoscaler:
    """Decides (M, N) every `decide` call. Up: at once, to what the planner says the load × `margin` needs.
    Down: only once every decision of the last `down_after_s` seconds allowed fewer instances, to the most of
    them (the instances that whole time did not need are drained at once).

    The margin is the arrivals' own noise: a window that saw k arrivals estimates the rate to about 1/√k of
    it, and the next window's load swings as much, so the pools are sized `burst_sigmas` such deviations
    above the load seen (× `headroom`, 1 by default). A fleet serving 16 times the traffic needs a quarter of
    the margin: on the Mooncake trace's hour (bench/trace_replay.py) a fixed +15 % cost 1.12x the cheapest
    fixed split at 16x and changed the pools 58 times an hour; this margin (3.5 deviations), with two minutes'
    hold before a shrink, 1.05x and 29 times, and about the same as before at 1x and 4x, all at >= 95 %."""

    perf: PerfModel
    ttft_p90_s: float
    tpot_p90_s: float
    prefill: Bounds
    decode: Bounds
    headroom: float = knob_default(AutoscaleConfig, "autoscale_headroom")
    burst_sigmas: float = knob_default(AutoscaleConfig, "autoscale_burst_sigmas")
    down_after_s: float = knob_default(AutoscaleConfig, "autoscale_down_after")
    ranks: int = 1  # DP ranks per decode instance
    fleet: FleetLoad | None = None  # several routers: decide on all their load, not the observation given
    lead_s: float = knob_default(AutoscaleConfig, "autoscale_lead")  # > 0: size for the load forecast this far ahead
    window_s: float = knob_default(AutoscaleConfig, "autoscale_window")  # what each observation covers
    down_to_most: bool = True  # shrink to the most the hold time needed (False: one instance at a time)
    _forecast: LoadForecast | None = None
    _wanted: list[tuple[float, Target]] = field(default_factory=list)  # (time, what the load needed)
    _changed: float | None = None  # when the sizes last changed (or the controller started)

    def margin(self, obs: Observation) -> float:
        """What the observed rate is multiplied by: `headroom` × (1 + burst_sigmas / √arrivals seen)."""
        arrivals = obs.rate * obs.seconds
        burst = self.burst_sigmas / math.sqrt(max(1.0, arrivals)) if math.isfinite(arrivals) else 0.0
        return self.headroom * (1.0 + burst)

    def needed(self, obs: Observation) -> Target:
        """The fewest instances meeting the targets at the observed load × margin (the bounds' maxima
        when even those cannot)."""
        if obs.rate <= 0:
            return Target(self.prefill.low, self.decode.low)
        w = Workload(obs.rate * self.margin(obs), Dist("fixed", max(1.0, obs.mean_prompt_tokens)),
                     Dist("fixed", max(1.0, obs.mean_output_tokens)), self.ttft_p90_s, self.tpot_p90_s,
                     cached_tokens=obs.mean_cached_prompt_tokens)
        p = plan(self.perf, w, self.prefill.high, self.decode.high, self.ranks)
        if p is not None:
            m, n = p.m, p.n
        else:  # one side cannot make its target within its bound: that side at its maximum, the other as needed
            m = next((m for m in range(1, self.prefill.high + 1)
                      if analytic(self.perf, w, m, 1, self.ranks).ttft_p90_s <= w.ttft_p90_s), self.prefill.high)
            n = next((n for n in range(1, self.decode.high + 1)
                      if analytic(self.perf, w, 1, n, self.ranks).tpot_p90_s <= w.tpot_p90_s), self.decode.high)
        return Target(min(max(m, self.prefill.low), self.prefill.high), min(max(n, self.decode.low), self.decode.high))

    def decide(self, now: float, obs: Observation, current: Target) -> Target:
        """The pools' sizes from now on, given the last window's load (with a `fleet`: every router's, while
        it can be read; `obs`, this router's own, otherwise) and the current sizes."""
        if self.fleet is not None:
            obs = self.fleet.observation(obs)
        if self._changed is None:
            self._changed = now
        if obs.seconds < self.window_s / 4:
            return current  # a few seconds of load are no estimate of it (one burst would size the pools)
        need = self.needed(obs)
        if self.lead_s > 0:  # planning ahead: the load's trend now and once an instance asked for now serves
            self._forecast = self._forecast or LoadForecast(self.window_s)
            self._forecast.observe(now, obs)
            now_need = self.needed(self._forecast.ahead(now, 0.0, obs, scored=False))
            ahead = self.needed(self._forecast.ahead(now, self.lead_s, obs))
            need = Target(max(now_need.prefill, ahead.prefill), max(now_need.decode, ahead.decode))
        self._wanted = [(t, w) for t, w in self._wanted if t > now - self.down_after_s] + [(now, need)]
        settled = now - self._changed >= self.down_after_s  # a whole low window since the last change

        def side(cur: int, wanted: list[int]) -> int:
            if wanted[-1] > cur:
                return wanted[-1]  # up at once
            if settled and max(wanted) < cur:  # a whole window needed fewer: down to the most it needed
                return max(wanted) if self.down_to_most else cur - 1
            return cur

        target = Target(side(current.prefill, [w.prefill for _, w in self._wanted]),
                        side(current.decode, [w.decode for _, w in self._wanted]))
        if target != current:
            self._changed = now
        return target


COUNTERS = {  # what `observe` reads of the router's metrics: (name, labels)
    "arrivals": ("pdserve_router_arrivals_total", {}),
    "prompt_tokens": ("pdserve_tokens_total", {"service": "router", "kind": "prompt"}),
    "cached_prompt_tokens": ("pdserve_tokens_total", {"service": "router", "kind": "cached_prompt"}),
    "output_tokens": ("pdserve_tokens_total", {"service": "router", "kind": "output"}),
    "completed": ("pdserve_router_e2e_seconds_count", {}),
}


def read_counters(sample: Callable[[str, dict[str, str]], float | None]) -> dict[str, float]:
    """The COUNTERS' values from `sample(name, labels)` (prometheus_client's REGISTRY.get_sample_value;
    0 for one not exported yet)."""
    return {key: float(sample(name, labels) or 0.0) for key, (name, labels) in COUNTERS.items()}


def observe(prev: dict[str, float], cur: dict[str, float], seconds: float) -> Observation:
    """The window's load from two readings of the router's counters: arrivals per second, mean prompt
    tokens per arrival, mean output tokens per completed request, mean prompt tokens per arrival found in a
    prefill instance's prefix cache."""
    arrived = max(0.0, cur["arrivals"] - prev["arrivals"])
    completed = max(0.0, cur["completed"] - prev["completed"])

    def per(key: str, count: float) -> float:
        return max(0.0, cur[key] - prev[key]) / max(count, 1.0)

    return Observation(arrived / seconds if seconds > 0 else 0.0, per("prompt_tokens", arrived),
                       per("output_tokens", completed), per("cached_prompt_tokens", arrived), seconds)


def prometheus_query(base_url: str, timeout: float = 5.0) -> Callable[[str], float | None]:
    """A PromQL instant query against the Prometheus at `base_url`: the value of a one-series answer, None
    when no series matches (OSError / ValueError when Prometheus cannot be read)."""
    def query(promql: str) -> float | None:
        url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = json.loads(reply.read().decode())
        if body.get("status") != "success":
            raise ValueError(f"Prometheus: {body.get('error') or body}")
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None
    return query


@dataclass
class FleetLoad:
    """Every router's load over the last `window_s` seconds: the routers' COUNTERS, each summed over the
    routers `selector` matches (PromQL label matchers, e.g. `namespace="ml",pod=~"pdserve-router-.+"`) by
    `sum(increase(...))`. Read every `period_s` on a thread of its own (a slow Prometheus never stalls the
    router's event loop); `observation` hands out the latest reading, or the caller's own observation when
    there is none fresh (Prometheus unreachable, or no router of `selector` scraped yet)."""

    query: Callable[[str], float | None]  # PromQL → value (prometheus_query)
    selector: str
    window_s: float
    period_s: float
    background: bool = True  # read on a thread of its own; False: only `refresh` reads (tests)
    _latest: tuple[float, Observation] | None = None  # (monotonic time, the fleet's load)
    _ok: bool | None = None  # the last reading's outcome (logged when it changes)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def queries(self) -> dict[str, str]:
        """The PromQL of each counter: its increase over the window, summed over the fleet's routers."""
        window = f"{max(1, round(self.window_s))}s"
        out = {}
        for key, (name, labels) in COUNTERS.items():
            matchers = ",".join([*(f'{k}="{v}"' for k, v in sorted(labels.items())), *filter(None, [self.selector])])
            out[key] = f"sum(increase({name}{{{matchers}}}[{window}]))"
        return out

    def read(self) -> Observation | None:
        """The fleet's load now (None: no router matches; errors propagate)."""
        values = {key: self.query(q) for key, q in self.queries().items()}
        if values["arrivals"] is None:
            return None
        zero = dict.fromkeys(COUNTERS, 0.0)
        return observe(zero, {k: v or 0.0 for k, v in values.items()}, float(max(1, round(self.window_s))))

    def refresh(self) -> Observation | None:
        """One reading, kept for `observation`; a failure is logged when the state changes, never raised."""
        try:
            obs, why = self.read(), "no router's counters found (not scraped yet?)"
        except (OSError, ValueError, KeyError, IndexError) as exc:
            obs, why = None, str(exc)
        if (obs is not None) != self._ok:
            self._ok = obs is not None
            if obs is None:
                log.warning("autoscale: the fleet's load cannot be read (%s); deciding on this router's own", why)
            else:
                log.info("autoscale: deciding on the fleet's load (every router's counters, summed)")
        if obs is not None:
            with self._lock:
                self._latest = (time.monotonic(), obs)
        return obs

    def observation(self, own: Observation) -> Observation:
        """The latest fresh fleet reading, else `own` (starts the reading thread on first use)."""
        if self._thread is None and self.background:
            self._thread = threading.Thread(target=self._run, name="fleet-load", daemon=True)
            self._thread.start()
        with self._lock:
            latest = self._latest
        if latest is None or time.monotonic() - latest[0] > FLEET_STALE_PERIODS * self.period_s:
            return own
        return latest[1]

    def _run(self) -> None:
        while True:
            self.refresh()
            time.sleep(self.period_s)


def instance_hours(samples: list[tuple[float, Target]], end: float) -> float:
    """∫(M + N) dt in hours over piecewise-constant (time, target) samples up to `end`."""
    total = 0.0
    for (t, target), nxt in zip(samples, [*samples[1:], (end, None)], strict=True):
        total += (target.prefill + target.decode) * max(0.0, nxt[0] - t)
    return total / 3600.0

