"""Stage B of the M/N planner: a discrete-event simulation of Poisson arrivals over simulated instances that
asks the router's own policy object (router.policy) for every placement, with the same PerfModel."""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field
from enum import IntEnum

from router.perf import PerfModel
from router.planner.stage_a import Prediction, Workload
from router.policy import DecodeView, PrefillView, RankView, Rejected, Request, SlaPolicy


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


class _Event(IntEnum):
    ARRIVE = 0  # payload: the _SimRequest
    PREFILLED = 1  # (prefill index, the _SimRequest)
    ADMIT = 2  # the _SimRequest, its KV at its decode instance
    STEP = 3  # the decode instance's index


class _PoissonRun:
    """One stage-B run: the arrivals drawn up front, then events until the last request ends."""

    def __init__(self, perf: PerfModel, w: Workload, m: int, n: int, policy: SlaPolicy, ranks: int,
                 requests: int, rng: random.Random):
        self.perf, self.w, self.policy, self.ranks = perf, w, policy, ranks
        self.prefill_queue: list[list[_SimRequest]] = [[] for _ in range(m)]
        self.decodes = [_Decode([[] for _ in range(ranks)], [[] for _ in range(ranks)]) for _ in range(n)]
        self.events: list[tuple[float, int, _Event, object]] = []
        self.counter = iter(range(1 << 62))
        t = 0.0
        for _ in range(requests):
            t += rng.expovariate(w.rate)
            self.push(t, _Event.ARRIVE, _SimRequest(t, w.isl.sample(rng), w.osl.sample(rng)))
        self.done: list[_SimRequest] = []
        self.rejected = 0
        self.trace: list[tuple[int, int]] = []

    def push(self, t: float, kind: _Event, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.counter), kind, payload))

    def run(self) -> None:
        handlers = {_Event.ARRIVE: self.on_arrive, _Event.PREFILLED: self.on_prefilled, _Event.ADMIT: self.on_admit,
                    _Event.STEP: self.on_step}
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](payload, now)

    def views(self) -> tuple[list[PrefillView], list[DecodeView]]:
        pre = [PrefillView(f"p{i}", sum(r.isl for r in q)) for i, q in enumerate(self.prefill_queue)]
        dec = [DecodeView(f"d{i}", [RankView(len(d.ranks[r]) + len(d.reserved[r]),
                                             sum(x.isl + x.done_tokens for x in d.ranks[r])
                                             + sum(x.isl + x.osl for x in d.reserved[r])) for r in range(self.ranks)])
               for i, d in enumerate(self.decodes)]
        return pre, dec

    def busy_engines(self) -> int:
        """Engines computing now (on shared cores each slows the others: PerfModel's interference terms)."""
        return sum(1 for q in self.prefill_queue if q) + sum(1 for d in self.decodes if d.stepping)

    def start_prefill(self, p: int, now: float) -> None:
        req = self.prefill_queue[p][0]
        seconds = self.perf.prefill_seconds(req.isl) * self.perf.prefill_slowdown(self.busy_engines() - 1)
        self.push(now + seconds, _Event.PREFILLED, (p, req))

    def step(self, d: int, now: float) -> None:
        dec = self.decodes[d]
        busy = [(len(r), sum(x.isl + x.done_tokens for x in r)) for r in dec.ranks]
        if not any(b for b, _ in busy):
            dec.stepping = False
            return
        dec.stepping = True
        others = self.busy_engines() - 1
        seconds = max(self.perf.tpot_raw(b, c, others) for b, c in busy)  # lock-step: the busiest rank
        self.push(now + seconds, _Event.STEP, d)

    def on_arrive(self, req: _SimRequest, now: float) -> None:
        pre, dec = self.views()
        try:
            choice = self.policy.choose(Request(req.isl, req.osl, self.w.ttft_p90_s, self.w.tpot_p90_s), pre, dec)[0]
        except Rejected:
            self.rejected += 1
            return
        self.trace.append((choice.prefill, choice.decode))
        req.decode = choice.decode
        req.rank = dec[choice.decode].least_loaded()
        self.decodes[req.decode].reserved[req.rank].append(req)
        self.prefill_queue[choice.prefill].append(req)
        if len(self.prefill_queue[choice.prefill]) == 1:
            self.start_prefill(choice.prefill, now)

    def on_prefilled(self, payload: tuple[int, _SimRequest], now: float) -> None:
        p, req = payload
        self.prefill_queue[p].pop(0)
        if self.prefill_queue[p]:
            self.start_prefill(p, now)
        self.push(now + self.perf.transfer_seconds(req.isl), _Event.ADMIT, req)

    def on_admit(self, req: _SimRequest, now: float) -> None:
        dec = self.decodes[req.decode]
        dec.reserved[req.rank].remove(req)
        req.first = req.last = now
        req.done_tokens = 1
        if req.osl <= 1:
            self.done.append(req)
            return
        dec.ranks[req.rank].append(req)
        if not dec.stepping:
            self.step(req.decode, now)

    def on_step(self, d: int, now: float) -> None:
        """A decode step ends: every running request has one more token."""
        for rank in self.decodes[d].ranks:
            for req in list(rank):
                req.done_tokens += 1
                req.last = now
                if req.done_tokens >= req.osl:
                    rank.remove(req)
                    self.done.append(req)
        self.step(d, now)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[8] if len(xs) >= 10 else (max(xs) if xs else math.inf)


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.inf


def simulate(perf: PerfModel, w: Workload, m: int, n: int, policy: SlaPolicy | None = None, ranks: int = 1,
             requests: int = 2000, seed: int = 0) -> SimResult:
    """Stage B: Poisson arrivals at w.rate; every placement is `policy.choose` (the router's code)
    over views built the way the router builds them from load reports."""
    rng = random.Random(seed)
    run = _PoissonRun(perf, w, m, n, policy or SlaPolicy(perf, seed=seed), ranks, requests, rng)
    run.run()
    ttft = [r.first - r.arrival for r in run.done]
    tpot = [(r.last - r.first) / (r.done_tokens - 1) if r.done_tokens > 1 else 0.0 for r in run.done]
    met = sum(1 for a, b in zip(ttft, tpot) if a <= w.ttft_p90_s and b <= w.tpot_p90_s)
    pred = Prediction(m, n, _p50(ttft), _p90(ttft), _p50(tpot), _p90(tpot),
                      attainment=met / requests, rejected=run.rejected / requests)  # a refusal is a miss
    return SimResult(pred, run.trace)

