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


@dataclass(frozen=True)
class Observation:
    """The load over the last window, as the router counts it."""

    rate: float  # requests / s
    mean_prompt_tokens: float
    mean_output_tokens: float
    mean_cached_prompt_tokens: float = 0.0  # of the prompt tokens, those a prefill instance found in its cache


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
    return Workload(rate, w.isl, w.osl, w.ttft_p90_s, w.tpot_p90_s, w.attainment, w.cached_tokens)


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


# --- trace replay: time-varying pools ---------------------------------------------------------------

@dataclass(frozen=True)
class TraceRequest:
    """One request of a recorded trace: arrival (s from the start), prompt and output tokens, and the
    prompt's prefix-block hashes (equal leading hashes: a shareable prefix, `block_tokens` tokens each)."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()


def load_trace(path: str, limit: int | None = None, minutes: float | None = None) -> list[TraceRequest]:
    """A Mooncake-format trace (JSON lines: `timestamp` ms, `input_length`, `output_length`, `hash_ids`),
    sorted by arrival; the first `limit` requests and / or `minutes` of it."""
    import json

    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(TraceRequest(r["timestamp"] / 1e3, max(1, int(r["input_length"])),
                                        max(1, int(r["output_length"])), tuple(r.get("hash_ids") or ())))
    out.sort(key=lambda r: r.arrival)
    if minutes is not None:
        out = [r for r in out if r.arrival < minutes * 60]
    return out[:limit] if limit is not None else out


@dataclass
class TraceResult:
    """simulate_trace's outcome. Per request (in trace order) TTFT and TPOT (inf: refused by the policy);
    `met`: both within the targets. `series`: per bucket (start s, arrivals / s, mean M, mean N,
    attainment of the bucket's arrivals). `sizes`: (time, prefill, decode) whenever the pools' provisioned
    sizes change (instances booting included)."""

    ttft: list[float]
    tpot: list[float]
    met: list[bool]
    ttft_s: float
    tpot_s: float
    instance_hours: float
    end_s: float
    rejected: int
    migrations: int
    prompt_tokens: int  # prompt tokens of the prompts prefilled (re-prefills of migrations included)
    computed_tokens: int  # of them, the tokens not found in the instance's prefix cache
    series: list[tuple[float, float, float, float, float]]
    sizes: list[tuple[float, int, int]]

    @property
    def attainment(self) -> float:
        """Share of all requests (a refusal is a miss) whose TTFT and TPOT both met their targets."""
        return sum(self.met) / len(self.met) if self.met else 1.0

    @property
    def cache_hit_rate(self) -> float:
        return 1 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def quantile(self, which: str, q: float) -> float:
        """Quantile of the served requests' TTFT or TPOT (`which`: "ttft" / "tpot"; nearest rank)."""
        xs = sorted(x for x in getattr(self, which) if not math.isinf(x))
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.inf


_STARTING, _UP, _DRAINING, _GONE = range(4)
_ARRIVE, _PREFILLED, _ADMIT, _STEP, _READY, _DECIDE = range(6)


class _TReq:
    __slots__ = ("i", "arrival", "isl", "osl", "blocks", "dec", "rank", "first", "last", "done", "ticket", "join_k",
                 "migrations")

    def __init__(self, i: int, r: TraceRequest):
        self.i, self.arrival, self.isl, self.osl, self.blocks = i, r.arrival, r.prompt_tokens, r.output_tokens, r.blocks
        self.dec: _TDecode | None = None
        self.rank = 0  # the DP rank of `dec` it decodes on
        self.first = self.last = math.inf
        self.done = 0  # tokens generated (the first comes with the prefill)
        self.ticket = 0  # invalidates a decode instance's completion entry when the request moves
        self.join_k = 0
        self.migrations = 0


class _TPrefill:
    """A prefill instance: a FIFO of prompts computed one at a time, and an LRU prefix cache of blocks."""

    def __init__(self, name: str, state: int, capacity_blocks: int):
        self.name, self.state = name, state
        self.queue: list[tuple[_TReq, int, int]] = []  # (request, prompt tokens, uncached tokens as placed)
        self.head = 0  # index of the prompt in service (the queue's consumed prefix is trimmed lazily)
        self.waiting_tokens = 0  # uncached tokens of the prompts waiting (not the one in service)
        self.busy_until = 0.0
        self.busy_from = 0.0
        self.busy_tokens = 0
        self.cache: dict[int, None] = {}  # insertion order = recency (LRU at the front)
        self.capacity = capacity_blocks

    def cached_prefix(self, blocks: tuple[int, ...], touch: bool = False) -> int:
        n = 0
        for h in blocks:
            if h not in self.cache:
                break
            if touch:
                self.cache[h] = self.cache.pop(h)
            n += 1
        return n

    def insert(self, blocks: tuple[int, ...]) -> None:
        for h in blocks:
            self.cache.pop(h, None)
            self.cache[h] = None
        while len(self.cache) > self.capacity:
            del self.cache[next(iter(self.cache))]

    def queued_tokens(self, now: float) -> int:
        """What its load report would say: uncached prompt tokens waiting, plus the rest of the one in service."""
        rest = 0
        if self.busy_until > now and self.busy_until > self.busy_from:
            rest = int(self.busy_tokens * (self.busy_until - now) / (self.busy_until - self.busy_from))
        return self.waiting_tokens + rest

    @property
    def idle(self) -> bool:
        return self.head >= len(self.queue)


class _TDecode:
    """A decode instance of `ranks` DP ranks stepping in lock-step (one step counter, each step as long as its
    busiest rank's): a request joining at step k with r tokens to go finishes at step k + r (a heap by
    finishing step), so a step costs O(log batch), not O(batch). Batches, context and reservations per rank."""

    def __init__(self, name: str, state: int, ranks: int = 1):
        self.name, self.state = name, state
        self.k = 0  # steps taken
        self.batch = [0] * ranks
        self.ctx = [0] * ranks  # context tokens of each rank's running batch
        self.heap: list[tuple[int, int, int, _TReq]] = []  # (finishing step, request index, ticket, request)
        self.pending: list[_TReq] = []  # admitted, joining at the next step
        self.stepping = False
        self.reserved = [0] * ranks  # placed, still in prefill or transfer
        self.reserved_tokens = [0] * ranks
        self.epoch = 0  # a removed instance's step event is ignored

    def running(self) -> list[_TReq]:
        return [r for _, _, t, r in self.heap if r.ticket == t and r.dec is self]

    def rank_loads(self) -> list[tuple[int, int]]:
        """Per rank, what its load report would say: (requests, context tokens), reservations and requests
        joining at the next step included."""
        running = [b + r for b, r in zip(self.batch, self.reserved)]
        used = [c + t for c, t in zip(self.ctx, self.reserved_tokens)]
        for r in self.pending:
            running[r.rank] += 1
            used[r.rank] += r.isl + r.done
        return list(zip(running, used))

    def view(self, decode_kv_tokens: int, loads: list[tuple[int, int]] | None = None) -> DecodeView:
        """The view the router's policy gets of it (free blocks: its fullest rank's, as the router takes them)."""
        loads = loads or self.rank_loads()
        return DecodeView(self.name, [RankView(b, u) for b, u in loads],
                          free_blocks=max(0, (decode_kv_tokens - max(u for _, u in loads)) // 64))

    def step_seconds(self, perf: PerfModel) -> float:
        return max(perf.decode_step_seconds(b, c) for b, c in zip(self.batch, self.ctx))


def simulate_trace(perf: PerfModel, requests: list[TraceRequest], sizing: object, ttft_s: float, tpot_s: float,
                   period: float = 15.0, window: float | None = None, startup_s: float = 60.0,
                   initial: object | None = None, observe_cached: bool = False,
                   block_tokens: int = 512, prefix_cache_blocks: int = 1 << 30, decode_kv_tokens: int = 1 << 40,
                   policy: SlaPolicy | None = None, candidates: int | None = None, bucket_s: float = 60.0,
                   seed: int = 0, ranks: int = 1) -> TraceResult:
    """Replay `requests` (a recorded trace: real arrival times, lengths, prefix hashes) over prefill and decode
    pools whose sizes follow `sizing`: a router.autoscale.Target (static M/N) or a controller with
    `decide(now, Observation, current Target) -> Target` (router.autoscale.Autoscaler), called every `period`
    s of simulated time with the load of the last `window` s (default: the period) as the router counts it
    (arrivals / s, mean prompt tokens per arrival, mean output tokens per completed request). Every
    placement is the router's policy object (SlaPolicy, as `simulate`) over the instances that are up, with
    `cached_by_prefill` from each prefill instance's prefix cache; a refusal is a miss. `observe_cached`: the
    observation also counts the prompt tokens the chosen prefill instance holds in its cache, as the router's
    cached-prompt token counter does (the autoscaler then sizes prefill on the tokens it computes).
    `candidates`: show the policy only that many prefill and decode instances, those its own curves predict
    fastest (on dedicated hardware a pair's cost is a prefill term plus a decode term, so the best pair is
    among them; near-ties spread over fewer); None: all, as the router does.

    * A new instance serves `startup_s` after it is asked for (booting, it counts in instance-hours); a
      static sizing's and `initial`'s instances are up from the start (`initial`: the controller's sizes
      at t = 0, else its bounds' minima).
    * Shrinking removes a booting instance first, else the least loaded one. A removed prefill instance
      takes no new prompt and finishes its queue (counted until then); a removed decode instance migrates
      its requests at once: each goes back through the policy as a prompt of prompt + generated tokens (a
      re-prefill, prefix cache applying), then continues its remaining tokens on the new decode instance
      (its TPOT includes the pause). Requests still in prefill for it are sent to another one on arrival.
    * Prefill: one prompt at a time per instance, FIFO; a prompt computes only the blocks past its longest
      cached prefix (`block_tokens` per hash; at least one token), taking prefill_base_s + a·new + c·(T² −
      cached²) (the new tokens attend to the cached prefix too), then the KV transfer; its blocks then
      enter the instance's LRU cache of `prefix_cache_blocks` blocks. TTFT is the first token at decode.
    * Decode: `ranks` DP ranks per instance (the decode instances' --dp), each request on the rank the policy's
      view names (its least loaded); the ranks step in lock-step, each step as long as the busiest rank's
      perf.decode_step_seconds(batch, context tokens), a new request joining at the next step; TPOT = (last −
      first token) / (output − 1). `decode_kv_tokens`: a rank's KV capacity (what the policy's room check sees).

    Instance-hours: ∫ (M + N) dt over instances booting, up or draining, until the last request ends."""

    policy = policy or SlaPolicy(perf, seed=seed)
    static = isinstance(sizing, Target)
    start = sizing if static else (initial or Target(sizing.prefill.low, sizing.decode.low))
    reqs = [_TReq(i, r) for i, r in enumerate(requests)]
    events: list[tuple[float, int, int, object]] = []
    seq = iter(range(1 << 62))
    prefills: list[_TPrefill] = []
    decodes: list[_TDecode] = []
    names = iter(range(1 << 30))
    ttft = [math.inf] * len(reqs)
    tpot = [math.inf] * len(reqs)
    met = [False] * len(reqs)
    stats = {"rejected": 0, "migrations": 0, "prompt": 0, "computed": 0}
    # instance-hours and the per-bucket series
    nb = 1 + int((requests[-1].arrival if requests else 0.0) // bucket_s)  # buckets holding arrivals
    area_m, area_n = [0.0] * nb, [0.0] * nb
    acct = {"t": 0.0, "m": 0, "n": 0, "hours": 0.0}
    sizes: list[tuple[float, int, int]] = []
    window = window or period
    arrived: list[tuple[float, int, int]] = []  # (time, prompt tokens, cached ones) of every arrival, to observe
    completed: list[tuple[float, int]] = []  # (time, output tokens) of every completion
    seen = [0, 0]  # the first entries of both still inside the window
    done_count = [0]

    def account(now: float) -> None:
        t0, m, n = acct["t"], acct["m"], acct["n"]
        if now > t0:
            acct["hours"] += (m + n) * (now - t0) / 3600.0
            b = int(t0 // bucket_s)
            while t0 < now and b < nb:
                t1 = min(now, (b + 1) * bucket_s)
                area_m[b] += m * (t1 - t0)
                area_n[b] += n * (t1 - t0)
                t0, b = t1, b + 1
        acct["t"] = now
        acct["m"] = sum(1 for p in prefills if p.state != _GONE)
        acct["n"] = sum(1 for d in decodes if d.state != _GONE)

    def provisioned() -> tuple[int, int]:
        return (sum(1 for p in prefills if p.state in (_STARTING, _UP)),
                sum(1 for d in decodes if d.state in (_STARTING, _UP)))

    def push(t: float, kind: int, payload: object) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    def add(kind: str, now: float, up: bool) -> None:
        state = _UP if up or startup_s <= 0 else _STARTING
        if kind == "prefill":
            inst: object = _TPrefill(f"p{next(names)}", state, prefix_cache_blocks)
            prefills.append(inst)
        else:
            inst = _TDecode(f"d{next(names)}", state, ranks)
            decodes.append(inst)
        if state == _STARTING:
            push(now + startup_s, _READY, inst)

    # --- placement -----------------------------------------------------------------------------------
    def views(now: float, tokens: int, remaining: int, blocks: tuple[int, ...]):
        pre = [p for p in prefills if p.state == _UP]
        dec = [d for d in decodes if d.state == _UP]
        queued = [p.queued_tokens(now) for p in pre]
        cached = [min(p.cached_prefix(blocks) * block_tokens, tokens - 1) for p in pre]
        loads = [d.rank_loads() for d in dec]
        if candidates and len(pre) > candidates:  # the fastest prefills by the policy's own TTFT curve
            keep = sorted(range(len(pre)), key=lambda i: perf.ttft_raw(queued[i], tokens, cached[i]))[:candidates]
            pre, queued, cached = [pre[i] for i in keep], [queued[i] for i in keep], [cached[i] for i in keep]
        if candidates and len(dec) > candidates:  # the fastest decodes once the request joins (its best rank)
            keep = sorted(range(len(dec)), key=lambda i: min(perf.tpot_raw(b + 1, u + tokens + remaining)
                                                             for b, u in loads[i]))[:candidates]
            dec, loads = [dec[i] for i in keep], [loads[i] for i in keep]
        pviews = [PrefillView(p.name, q) for p, q in zip(pre, queued)]
        dviews = [d.view(decode_kv_tokens, x) for d, x in zip(dec, loads)]
        return pre, dec, pviews, dviews, cached

    def place(req: _TReq, now: float, tokens: int, remaining: int, must: bool) -> bool:
        """Choose a pair by the policy and queue the prompt (`tokens`: what to prefill); `must` (a migration):
        never refused, the cheapest pair instead."""
        pre, dec, pviews, dviews, cached = views(now, tokens, remaining, req.blocks)
        ask = Request(tokens, remaining, ttft_s, tpot_s, cached_by_prefill=cached)
        try:
            choice = policy.choose(ask, pviews, dviews)[0]
        except Rejected:
            if not must:
                return False
            choice = min(policy.predict(ask, pviews, dviews), key=lambda c: c.cost)
        p, d = pre[choice.prefill], dec[choice.decode]
        req.dec, req.rank = d, dviews[choice.decode].least_loaded()
        d.reserved[req.rank] += 1
        d.reserved_tokens[req.rank] += tokens + remaining
        uncached = tokens - cached[choice.prefill]
        if observe_cached and req.migrations == 0:
            arrived[-1] = (now, tokens, tokens - uncached)
        p.queue.append((req, tokens, uncached))
        if len(p.queue) - p.head == 1 and p.busy_until <= now:
            start_prefill(p, now)
        else:
            p.waiting_tokens += uncached
        return True

    def start_prefill(p: _TPrefill, now: float) -> None:
        req, tokens, placed_uncached = p.queue[p.head]
        hit = min(p.cached_prefix(req.blocks, touch=True) * block_tokens, tokens - 1)
        new = tokens - hit
        seconds = perf.prefill_base_s + perf.prefill_per_token_s * new \
            + perf.prefill_per_token2_s * (tokens * tokens - hit * hit)
        stats["prompt"] += tokens
        stats["computed"] += new
        p.busy_from, p.busy_until, p.busy_tokens = now, now + seconds, new
        push(now + seconds, _PREFILLED, p)

    # --- decode ----------------------------------------------------------------------------------------
    def start_step(d: _TDecode, now: float) -> None:
        for r in d.pending:
            r.join_k = d.k
            r.ticket += 1
            heapq.heappush(d.heap, (d.k + r.osl - r.done, r.i, r.ticket, r))
            d.batch[r.rank] += 1
            d.ctx[r.rank] += r.isl + r.done
        d.pending.clear()
        if not any(d.batch):
            d.stepping = False
            return
        d.stepping = True
        push(now + d.step_seconds(perf), _STEP, (d, d.epoch))

    def finish(r: _TReq, now: float) -> None:
        r.last = now
        i = r.i
        ttft[i] = r.first - r.arrival
        tpot[i] = (r.last - r.first) / (r.osl - 1) if r.osl > 1 else 0.0
        met[i] = ttft[i] <= ttft_s and tpot[i] <= tpot_s
        completed.append((now, r.osl))
        done_count[0] += 1

    def admit(r: _TReq, now: float) -> None:
        d = r.dec
        d.reserved[r.rank] -= 1
        d.reserved_tokens[r.rank] -= r.isl + r.osl  # what `place` reserved: prompt (+ generated) + the tokens to go
        if d.state != _UP:  # its decode instance left while the prompt was in prefill: another one takes it
            up = [x for x in decodes if x.state == _UP]
            d = r.dec = min(up, key=lambda x: (sum(x.ctx) + sum(x.reserved_tokens), sum(x.batch)))
            r.rank = d.view(decode_kv_tokens).least_loaded()
        if r.done == 0:
            r.first = now
            r.done = 1
        if r.done >= r.osl:
            finish(r, now)
            return
        d.pending.append(r)
        if not d.stepping:
            start_step(d, now)

    def retire_decode(d: _TDecode, now: float) -> None:
        d.state = _GONE
        d.epoch += 1
        moving = [(r, r.done + d.k - r.join_k) for r in d.running()] + [(r, r.done) for r in d.pending]
        d.heap.clear()
        d.pending.clear()
        d.batch, d.ctx = [0] * ranks, [0] * ranks
        d.stepping = False
        for r, done in moving:
            r.done = done
            r.ticket += 1
            r.migrations += 1
            stats["migrations"] += 1
            place(r, now, r.isl + r.done, r.osl - r.done, must=True)

    def retire_prefill(p: _TPrefill, now: float) -> None:
        p.state = _DRAINING if not p.idle or p.busy_until > now else _GONE

    def resize(target: Target, now: float) -> None:
        for kind, pool, want in (("prefill", prefills, target.prefill), ("decode", decodes, target.decode)):
            live = [x for x in pool if x.state in (_STARTING, _UP)]
            for _ in range(want - len(live)):
                add(kind, now, up=False)
            for _ in range(len(live) - want):
                live = [x for x in pool if x.state in (_STARTING, _UP)]
                booting = [x for x in live if x.state == _STARTING]
                if booting:
                    booting[-1].state = _GONE
                elif kind == "prefill":
                    retire_prefill(min(live, key=lambda p: (p.queued_tokens(now), len(p.queue) - p.head)), now)
                else:
                    retire_decode(min(live, key=lambda d: (sum(d.batch) + len(d.pending) + sum(d.reserved),
                                                           sum(d.ctx))), now)
        m, n = provisioned()
        if not sizes or sizes[-1][1:] != (m, n):
            sizes.append((now, m, n))

    for _ in range(start.prefill):
        add("prefill", 0.0, up=True)
    for _ in range(start.decode):
        add("decode", 0.0, up=True)
    sizes.append((0.0, start.prefill, start.decode))
    account(0.0)
    for r in reqs:
        push(r.arrival, _ARRIVE, r)
    if not static:
        push(period, _DECIDE, None)
    now = end = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == _DECIDE and done_count[0] + stats["rejected"] == len(reqs):
            continue  # every request is over: the replay ends with the last one
        end = now
        if kind == _ARRIVE:
            r = payload
            arrived.append((now, r.isl, 0))
            if not place(r, now, r.isl, r.osl, must=False):
                stats["rejected"] += 1
        elif kind == _PREFILLED:
            p = payload
            r, tokens, placed_uncached = p.queue[p.head]
            p.head += 1
            if p.head > 64 and p.head * 2 > len(p.queue):
                del p.queue[:p.head]
                p.head = 0
            p.insert(r.blocks)
            push(now + perf.transfer_seconds(tokens), _ADMIT, r)
            if not p.idle:
                p.waiting_tokens -= p.queue[p.head][2]
                start_prefill(p, now)
            elif p.state == _DRAINING:
                p.state = _GONE
                account(now)
        elif kind == _ADMIT:
            admit(payload, now)
        elif kind == _STEP:
            d, epoch = payload
            if epoch != d.epoch:
                continue
            d.k += 1
            for i, b in enumerate(d.batch):
                d.ctx[i] += b
            while d.heap and d.heap[0][0] <= d.k:
                _, _, ticket, r = heapq.heappop(d.heap)
                if r.ticket != ticket or r.dec is not d:
                    continue
                d.batch[r.rank] -= 1
                d.ctx[r.rank] -= r.isl + r.osl
                r.done = r.osl
                finish(r, now)
            start_step(d, now)
        elif kind == _READY:
            if payload.state == _STARTING:
                payload.state = _UP
        else:  # _DECIDE
            for j, xs in enumerate((arrived, completed)):
                while seen[j] < len(xs) and xs[seen[j]][0] <= now - window:
                    seen[j] += 1
            ins, outs = arrived[seen[0]:], completed[seen[1]:]
            obs = Observation(len(ins) / min(window, now), sum(x[1] for x in ins) / max(1, len(ins)),
                              sum(x for _, x in outs) / len(outs) if outs else 0.0,
                              sum(x[2] for x in ins) / max(1, len(ins)))
            m, n = provisioned()
            resize(sizing.decide(now, obs, Target(m, n)), now)
            account(now)
            push(now + period, _DECIDE, None)
    account(end)
    arrivals_in = [[] for _ in range(nb)]
    for r in reqs:
        arrivals_in[min(nb - 1, int(r.arrival // bucket_s))].append(r.i)
    series = [(b * bucket_s, len(ix) / bucket_s, area_m[b] / bucket_s, area_n[b] / bucket_s,
               (sum(met[i] for i in ix) / len(ix)) if ix else math.nan) for b, ix in enumerate(arrivals_in)]
    return TraceResult(ttft, tpot, met, ttft_s, tpot_s, acct["hours"], end, stats["rejected"], stats["migrations"],
                       stats["prompt"], stats["computed"], series, sizes)
