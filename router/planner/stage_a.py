"""Stage A of the M/N planner: the workload's vocabulary (token distributions, targets, predictions) and the
analytic model (Erlang C with the Allen–Cunneen correction for prefill, Little's law per DP rank for decode),
the smallest M and N meeting the targets, and goodput by bisection."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from router.perf import PerfModel

Z90 = 1.2816  # the standard normal's 90th percentile


@dataclass(frozen=True)
class Dist:
    """A token-count distribution: "128" (fixed), "64:256" (uniform), "exp:128" (exponential mean)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Dist:
        try:
            if text.startswith("exp:"):
                return cls("exp", float(text[4:]))
            if ":" in text:
                lo, hi = (float(x) for x in text.split(":"))
                if not 1 <= lo <= hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            return cls("fixed", float(text))
        except ValueError:
            raise ValueError(f"token distribution {text!r}: expected N, LO:HI or exp:MEAN") from None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(1, round(self.a))
        if self.kind == "uniform":
            return rng.randint(round(self.a), round(self.b))
        return max(1, round(rng.expovariate(1 / self.a)))

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    @property
    def second_moment(self) -> float:
        if self.kind == "fixed":
            return self.a * self.a
        if self.kind == "uniform":
            return (self.a * self.a + self.a * self.b + self.b * self.b) / 3
        return 2 * self.a * self.a


@dataclass(frozen=True)
class Observation:
    """The load over the last window, as the router counts it."""

    rate: float  # requests / s
    mean_prompt_tokens: float
    mean_output_tokens: float
    mean_cached_prompt_tokens: float = 0.0  # of the prompt tokens, those a prefill instance found in its cache
    seconds: float = field(default=math.inf, compare=False)  # how long the counts cover (a window just begun: less)


@dataclass(frozen=True)
class Target:
    prefill: int
    decode: int


@dataclass
class Workload:
    rate: float  # requests / s
    isl: Dist
    osl: Dist
    ttft_p90_s: float
    tpot_p90_s: float
    attainment: float = 0.9
    cached_tokens: float = 0.0  # mean prompt tokens prefill finds in its prefix cache (not computed; still sent)


@dataclass
class Prediction:
    m: int
    n: int
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    attainment: float | None = None  # stage B only
    rejected: float | None = None  # stage B: fraction refused by the policy

    def meets(self, w: Workload) -> bool:
        if self.attainment is not None:
            return self.attainment >= w.attainment
        return self.ttft_p90_s <= w.ttft_p90_s and self.tpot_p90_s <= w.tpot_p90_s

    def binds(self, w: Workload) -> str:
        """The side closer to (or further past) its target."""
        return "prefill (TTFT)" if self.ttft_p90_s / w.ttft_p90_s >= self.tpot_p90_s / w.tpot_p90_s else "decode (TPOT)"


# --- stage A ----------------------------------------------------------------------------------------

def _erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in an M/M/m queue offered `load` Erlangs."""
    if load >= servers:
        return 1.0
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= load / k
        total += term
    term *= load / servers
    tail = term * servers / (servers - load)
    return tail / (total + tail)


def analytic(perf: PerfModel, w: Workload, m: int, n: int, ranks: int = 1) -> Prediction:
    """Stage A. With interference (instances sharing cores, PerfModel.colocated) prefill and decode are stretched by
    the engines expected busy beside them: each prefill busy with probability ρ_p = λ·S/m, each decode
    with 1 − e^(−L), L = λ/n·OSL·TPOT its requests in flight (Little), iterated to a fixed point."""
    if not perf.colocated:
        return _analytic(perf, w, m, n, ranks)
    stretch_p = stretch_d = 1.0
    for _ in range(30):
        pred = _analytic(perf.scaled(stretch_p, stretch_d), w, m, n, ranks)
        if math.isinf(pred.ttft_p90_s) or math.isinf(pred.tpot_p90_s):
            return pred
        busy_p = min(1.0, w.rate * perf.prefill_seconds(_computed(w)) * stretch_p / m)
        busy_d = 1 - math.exp(-w.rate / n * w.osl.mean * pred.tpot_p50_s)
        new_p = perf.prefill_slowdown(n * busy_d + (m - 1) * busy_p)
        new_d = perf.decode_slowdown(m * busy_p + (n - 1) * busy_d)
        if abs(new_p - stretch_p) < 1e-4 and abs(new_d - stretch_d) < 1e-4:
            break
        stretch_p, stretch_d = new_p, new_d
    return pred


def _computed(w: Workload) -> float:
    """Mean prompt tokens a prefill instance computes: the prompt less what its prefix cache holds."""
    return max(1.0, w.isl.mean - w.cached_tokens)


def _analytic(perf: PerfModel, w: Workload, m: int, n: int, ranks: int = 1) -> Prediction:
    inf = math.inf
    # prefill: M/G/m, service S = prefill(computed tokens); the KV of the whole prompt is sent
    computed = _computed(w)
    s_mean = perf.prefill_seconds(computed)
    s2 = (perf.prefill_base_s + perf.prefill_per_token_s * computed) ** 2 \
        + (perf.prefill_per_token_s ** 2) * (w.isl.second_moment - w.isl.mean ** 2)
    cs2 = max(0.0, s2 / (s_mean * s_mean) - 1) if s_mean else 0.0
    load = w.rate * s_mean
    transfer = perf.transfer_seconds(w.isl.mean)
    if load >= m:
        ttft50 = ttft90 = inf
    else:
        wait_prob = _erlang_c(m, load)
        decay = (m / s_mean - w.rate) * 2 / (1 + cs2)  # Allen–Cunneen: general service stretches the tail

        def wait_quantile(q: float) -> float:
            return 0.0 if wait_prob <= 1 - q else math.log(wait_prob / (1 - q)) / decay

        s90 = perf.prefill_seconds(computed + Z90 * math.sqrt(max(0.0, w.isl.second_moment - w.isl.mean ** 2)))
        ttft50 = wait_quantile(0.5) + s_mean + transfer
        ttft90 = wait_quantile(0.9) + s90 + transfer
    # decode: Little's law per DP rank, B = λ·OSL·(a + B·(b + c·ctx))
    lam = w.rate / (n * ranks)
    ctx = w.isl.mean + w.osl.mean / 2
    slope = lam * w.osl.mean * (perf.decode_per_seq_s + perf.decode_per_context_token_s * ctx)
    if slope >= 1:
        tpot50 = tpot90 = inf
    else:
        batch = max(1.0, lam * w.osl.mean * perf.decode_base_s / (1 - slope))
        tpot50 = perf.decode_step_seconds(batch, batch * ctx)
        b90 = batch + Z90 * math.sqrt(batch)
        tpot90 = perf.decode_step_seconds(b90, b90 * ctx)
    return Prediction(m, n, ttft50, ttft90, tpot50, tpot90)


def plan(perf: PerfModel, w: Workload, max_m: int = 8, max_n: int = 16, ranks: int = 1) -> Prediction | None:
    """Stage A: the fewest prefill instances meeting the TTFT target and the fewest decode instances
    meeting the TPOT target (the two sides do not interfere once disaggregated), or None. With
    interference (shared cores) the sides do interfere: the smallest M + N that meets both."""
    if perf.colocated:
        pairs = sorted(((m, n) for m in range(1, max_m + 1) for n in range(1, max_n + 1)), key=lambda mn: (sum(mn), mn))
        return next((p for m, n in pairs if (p := analytic(perf, w, m, n, ranks)).meets(w)), None)
    m = next((m for m in range(1, max_m + 1) if analytic(perf, w, m, 1, ranks).ttft_p90_s <= w.ttft_p90_s), None)
    n = next((n for n in range(1, max_n + 1) if analytic(perf, w, 1, n, ranks).tpot_p90_s <= w.tpot_p90_s), None)
    if m is None or n is None:
        return None
    return analytic(perf, w, m, n, ranks)


def goodput(meets: Callable[[float], bool], high: float, tolerance: float = 0.01) -> float:
    """The highest rate in (0, high] for which `meets(rate)` holds (bisection; meets is monotone)."""
    lo, hi = 0.0, high
    if meets(hi):
        return hi
    while hi - lo > tolerance * max(hi, 1e-9):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo
