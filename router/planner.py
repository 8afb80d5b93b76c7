"""M/N planning: how many prefill (M) and decode (N) instances a workload needs under TTFT/TPOT
targets, in two stages (see ../shared/design/router_planner.md):

* stage A, analytic: prefill is an M/G/m queue (the router sends each prompt to the least-queued
  instance, which behaves like one shared queue): Erlang C with the Allen–Cunneen correction and an
  exponential tail for the p90 wait; decode is Little's law per DP rank, batch B = λ·OSL·step(B), the
  p90 step taken at B + 1.28·√B;
* stage B, a discrete-event simulation of Poisson arrivals over simulated instances that asks **the
  router's own policy object** (router.policy) for every placement, with the same PerfModel.

Goodput (DistServe's metric) is the highest request rate at which the attainment target holds.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from router.perf import PerfModel
from router.policy import DecodeView, PrefillView, RankView, Rejected, Request, SlaPolicy

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


@dataclass
class Workload:
    rate: float  # requests / s
    isl: Dist
    osl: Dist
    ttft_p90_s: float
    tpot_p90_s: float
    attainment: float = 0.9


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
        busy_p = min(1.0, w.rate * perf.prefill_seconds(w.isl.mean) * stretch_p / m)
        busy_d = 1 - math.exp(-w.rate / n * w.osl.mean * pred.tpot_p50_s)
        new_p = perf.prefill_slowdown(n * busy_d + (m - 1) * busy_p)
        new_d = perf.decode_slowdown(m * busy_p + (n - 1) * busy_d)
        if abs(new_p - stretch_p) < 1e-4 and abs(new_d - stretch_d) < 1e-4:
            break
        stretch_p, stretch_d = new_p, new_d
    return pred


def _analytic(perf: PerfModel, w: Workload, m: int, n: int, ranks: int = 1) -> Prediction:
    inf = math.inf
    # prefill: M/G/m, service S = prefill(isl)
    s_mean = perf.prefill_seconds(w.isl.mean)
    s2 = (perf.prefill_base_s + perf.prefill_per_token_s * w.isl.mean) ** 2 \
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

        s90 = perf.prefill_seconds(w.isl.mean + Z90 * math.sqrt(max(0.0, w.isl.second_moment - w.isl.mean ** 2)))
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


# --- stage B ----------------------------------------------------------------------------------------

@dataclass
class _SimRequest:
    arrival: float
    isl: int
    osl: int
    decode: int = -1
    rank: int = 0
    first: float = 0.0
    done_tokens: int = 0
    last: float = 0.0


@dataclass
class _Decode:
    ranks: list[list[_SimRequest]]
    reserved: list[list[_SimRequest]]
    stepping: bool = False


@dataclass
class SimResult:
    prediction: Prediction
    trace: list[tuple[int, int]] = field(default_factory=list)  # (prefill, decode) per accepted request


def simulate(perf: PerfModel, w: Workload, m: int, n: int, policy: SlaPolicy | None = None, ranks: int = 1,
             requests: int = 2000, seed: int = 0) -> SimResult:
    """Stage B: Poisson arrivals at w.rate; every placement is `policy.choose` (the router's code)
    over views built the way the router builds them from load reports."""
    rng = random.Random(seed)
    policy = policy or SlaPolicy(perf, seed=seed)
    prefill_queue: list[list[_SimRequest]] = [[] for _ in range(m)]
    decodes = [_Decode([[] for _ in range(ranks)], [[] for _ in range(ranks)]) for _ in range(n)]
    events: list[tuple[float, int, str, object]] = []
    counter = iter(range(1 << 62))
    t, arrivals = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(w.rate)
        arrivals.append(_SimRequest(t, w.isl.sample(rng), w.osl.sample(rng)))
        heapq.heappush(events, (t, next(counter), "arrive", arrivals[-1]))
    done: list[_SimRequest] = []
    rejected = 0
    trace: list[tuple[int, int]] = []

    def views() -> tuple[list[PrefillView], list[DecodeView]]:
        pre = [PrefillView(f"p{i}", sum(r.isl for r in q)) for i, q in enumerate(prefill_queue)]
        dec = [DecodeView(f"d{i}", [RankView(len(d.ranks[r]) + len(d.reserved[r]),
                                             sum(x.isl + x.done_tokens for x in d.ranks[r])
                                             + sum(x.isl + x.osl for x in d.reserved[r])) for r in range(ranks)])
               for i, d in enumerate(decodes)]
        return pre, dec

    def busy_engines() -> int:
        """Engines computing now (on shared cores each slows the others: PerfModel's interference terms)."""
        return sum(1 for q in prefill_queue if q) + sum(1 for d in decodes if d.stepping)

    def start_prefill(p: int, now: float) -> None:
        req = prefill_queue[p][0]
        seconds = perf.prefill_seconds(req.isl) * perf.prefill_slowdown(busy_engines() - 1)
        heapq.heappush(events, (now + seconds, next(counter), "prefilled", (p, req)))

    def step(d: int, now: float) -> None:
        dec = decodes[d]
        busy = [(len(r), sum(x.isl + x.done_tokens for x in r)) for r in dec.ranks]
        if not any(b for b, _ in busy):
            dec.stepping = False
            return
        dec.stepping = True
        seconds = max(perf.tpot_raw(b, c, busy_engines() - 1) for b, c in busy)  # lock-step: the busiest rank
        heapq.heappush(events, (now + seconds, next(counter), "step", d))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            req = payload
            pre, dec = views()
            try:
                choice = policy.choose(Request(req.isl, req.osl, w.ttft_p90_s, w.tpot_p90_s), pre, dec)[0]
            except Rejected:
                rejected += 1
                continue
            trace.append((choice.prefill, choice.decode))
            req.decode = choice.decode
            req.rank = dec[choice.decode].least_loaded()
            decodes[req.decode].reserved[req.rank].append(req)
            prefill_queue[choice.prefill].append(req)
            if len(prefill_queue[choice.prefill]) == 1:
                start_prefill(choice.prefill, now)
        elif kind == "prefilled":
            p, req = payload
            prefill_queue[p].pop(0)
            if prefill_queue[p]:
                start_prefill(p, now)
            heapq.heappush(events, (now + perf.transfer_seconds(req.isl), next(counter), "admit", req))
        elif kind == "admit":
            req = payload
            dec = decodes[req.decode]
            dec.reserved[req.rank].remove(req)
            req.first = req.last = now
            req.done_tokens = 1
            if req.osl <= 1:
                done.append(req)
                continue
            dec.ranks[req.rank].append(req)
            if not dec.stepping:
                step(req.decode, now)
        else:  # a decode step ends: every running request has one more token
            dec = decodes[payload]
            for rank in dec.ranks:
                for req in list(rank):
                    req.done_tokens += 1
                    req.last = now
                    if req.done_tokens >= req.osl:
                        rank.remove(req)
                        done.append(req)
            step(payload, now)
    ttft = [r.first - r.arrival for r in done]
    tpot = [(r.last - r.first) / (r.done_tokens - 1) if r.done_tokens > 1 else 0.0 for r in done]
    met = sum(1 for a, b in zip(ttft, tpot) if a <= w.ttft_p90_s and b <= w.tpot_p90_s)

    def p90(xs: list[float]) -> float:
        return statistics.quantiles(xs, n=10)[8] if len(xs) >= 10 else (max(xs) if xs else math.inf)

    def p50(xs: list[float]) -> float:
        return statistics.median(xs) if xs else math.inf

    pred = Prediction(m, n, p50(ttft), p90(ttft), p50(tpot), p90(tpot),
                      attainment=met / requests, rejected=rejected / requests)  # a refusal is a miss
    return SimResult(pred, trace)


# --- `pdserve plan` ---------------------------------------------------------------------------------

def _row(name: str, p: Prediction) -> list[str]:
    def ms(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x * 1e3:.0f}"

    att = "-" if p.attainment is None else f"{p.attainment:.0%}"
    return [name, str(p.m), str(p.n), ms(p.ttft_p50_s), ms(p.ttft_p90_s), ms(p.tpot_p50_s), ms(p.tpot_p90_s), att]


def run_plan(perf: PerfModel, w: Workload, max_m: int, max_n: int, ranks: int = 1, requests: int = 2000,
             seed: int = 0, plot: str | None = None, say: Callable[[str], None] = print) -> Prediction | None:
    """Stage A picks (M, N); stage B simulates it with the router's SLA policy; both goodputs; the
    deployment keys. Returns stage B's prediction (None when no (M, N) within the limits fits)."""
    chosen = plan(perf, w, max_m, max_n, ranks)
    if chosen is None:
        say(f"no M <= {max_m}, N <= {max_n} meets TTFT p90 {w.ttft_p90_s * 1e3:.0f} ms and TPOT p90 "
            f"{w.tpot_p90_s * 1e3:.0f} ms at {w.rate:g} req/s; raise --max-m / --max-n or relax the targets")
        return None
    m, n = chosen.m, chosen.n
    sim = simulate(perf, w, m, n, ranks=ranks, requests=requests, seed=seed).prediction
    high = 4 * w.rate

    def analytic_ok(rate: float) -> bool:
        return analytic(perf, _at(w, rate), m, n, ranks).meets(w)

    def sim_ok(rate: float) -> bool:
        return simulate(perf, _at(w, rate), m, n, ranks=ranks, requests=requests, seed=seed).prediction.meets(w)

    good_a, good_b = goodput(analytic_ok, high), goodput(sim_ok, high, tolerance=0.03)
    header = ["stage", "M", "N", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms", "attainment"]
    rows = [_row("A analytic", chosen), _row("B simulated", sim)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        say("  ".join(c.rjust(wd) for c, wd in zip(r, widths)))
    say(f"goodput at M={m}, N={n}: stage A {good_a:.2f} req/s ({good_a / (m + n):.2f} per instance), "
        f"stage B {good_b:.2f} req/s ({good_b / (m + n):.2f} per instance); binds: {chosen.binds(w)}")
    say("# deployment (pdserve up --config FILE, or helm -f FILE):")
    say(f"prefill:\n  instances: {m}\ndecode:\n  instances: {n}\nrouter:\n  policy: sla\n"
        f"  ttftSloMs: {w.ttft_p90_s * 1e3:g}\n  tpotSloMs: {w.tpot_p90_s * 1e3:g}")
    if plot:
        _plot(perf, w, m, n, ranks, requests, seed, plot)
        say(f"plot: {plot}")
    return sim


def _at(w: Workload, rate: float) -> Workload:
    return Workload(rate, w.isl, w.osl, w.ttft_p90_s, w.tpot_p90_s, w.attainment)


def _plot(perf: PerfModel, w: Workload, m: int, n: int, ranks: int, requests: int, seed: int, path: str) -> None:
    """SLA attainment vs request rate (stage B) for the chosen (M, N) and its neighbours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [w.rate * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mm, nn in sorted({(m, n), (max(1, m - 1), n), (m, max(1, n - 1)), (m + 1, n), (m, n + 1)}):
        att = [simulate(perf, _at(w, r), mm, nn, ranks=ranks, requests=requests, seed=seed).prediction.attainment
               for r in rates]
        ax.plot(rates, att, marker="o", label=f"M={mm} N={nn}" + (" (chosen)" if (mm, nn) == (m, n) else ""))
    ax.axhline(w.attainment, color="grey", linestyle="--")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLA attainment")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
