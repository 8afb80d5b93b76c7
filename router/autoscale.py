"""Elastic pools: how many prefill (M) and decode (N) instances the observed load needs, decided with the
planner's own model (router.planner.plan: each side's capacity per instance under the SLA targets) and
with hysteresis, so a pool grows at once when the load needs it and shrinks only after the load has
stayed low for a while (a scale-down drains its instance: its requests move, none is lost).

The controller is pure (observations in, targets out): `pdserve up --autoscale MIN:MAX` runs it against
the router's Prometheus counters and starts and stops local instances; the planner's trace replay runs
it against simulated time; on Kubernetes the same decision drives each pool's replica count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.perf import PerfModel
from router.planner import Dist, Workload, plan


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


@dataclass(frozen=True)
class Observation:
    """The load over the last window, as the router counts it."""

    rate: float  # requests / s
    mean_prompt_tokens: float
    mean_output_tokens: float


@dataclass(frozen=True)
class Target:
    prefill: int
    decode: int


@dataclass
class Autoscaler:
    """Decides (M, N) every `decide` call. Up: at once, to what the planner says the load × `headroom`
    needs. Down: only once every decision of the last `down_after_s` seconds allowed fewer instances (the
    most of them is taken), one instance at a time."""

    perf: PerfModel
    ttft_p90_s: float
    tpot_p90_s: float
    prefill: Bounds
    decode: Bounds
    headroom: float = 1.3  # plan for this much more load than observed (arrivals are bursty)
    down_after_s: float = 30.0
    ranks: int = 1  # DP ranks per decode instance
    _wanted: list[tuple[float, Target]] = field(default_factory=list)  # (time, what the load needed)
    _changed: float | None = None  # when the sizes last changed (or the controller started)

    def needed(self, obs: Observation) -> Target:
        """The fewest instances meeting the targets at the observed load × headroom (the bounds' maxima
        when even those cannot)."""
        if obs.rate <= 0:
            return Target(self.prefill.low, self.decode.low)
        w = Workload(obs.rate * self.headroom, Dist("fixed", max(1.0, obs.mean_prompt_tokens)),
                     Dist("fixed", max(1.0, obs.mean_output_tokens)), self.ttft_p90_s, self.tpot_p90_s)
        p = plan(self.perf, w, self.prefill.high, self.decode.high, self.ranks)
        if p is None:
            return Target(self.prefill.high, self.decode.high)
        return Target(min(max(p.m, self.prefill.low), self.prefill.high),
                      min(max(p.n, self.decode.low), self.decode.high))

    def decide(self, now: float, obs: Observation, current: Target) -> Target:
        """The pools' sizes from now on, given the last window's load and the current sizes."""
        if self._changed is None:
            self._changed = now
        need = self.needed(obs)
        self._wanted = [(t, w) for t, w in self._wanted if t > now - self.down_after_s] + [(now, need)]
        settled = now - self._changed >= self.down_after_s  # a whole low window since the last change

        def side(cur: int, wanted: list[int]) -> int:
            if wanted[-1] > cur:
                return wanted[-1]  # up at once
            if settled and max(wanted) < cur:
                return cur - 1  # down one at a time, after a whole window that needed fewer
            return cur

        target = Target(side(current.prefill, [w.prefill for _, w in self._wanted]),
                        side(current.decode, [w.decode for _, w in self._wanted]))
        if target != current:
            self._changed = now
        return target


def observe(prev: dict[str, float], cur: dict[str, float], seconds: float) -> Observation:
    """The window's load from two readings of the router's counters (requests, prompt and output tokens)."""
    done = max(0.0, cur["requests"] - prev["requests"])
    rate = done / seconds if seconds > 0 else 0.0
    per = max(done, 1.0)
    return Observation(rate, max(0.0, cur["prompt_tokens"] - prev["prompt_tokens"]) / per,
                       max(0.0, cur["output_tokens"] - prev["output_tokens"]) / per if done else 0.0)


def instance_hours(samples: list[tuple[float, Target]], end: float) -> float:
    """∫(M + N) dt in hours over piecewise-constant (time, target) samples up to `end`."""
    total = 0.0
    for (t, target), nxt in zip(samples, [*samples[1:], (end, None)], strict=True):
        total += (target.prefill + target.decode) * max(0.0, nxt[0] - t)
    return total / 3600.0

