"""Routing policies: which (prefill, decode) pair serves a request, or an early no.

The router and the planner's simulation (router/planner/) both call these objects with the same
views of the instances (what the load reports say, plus what was dispatched since), so what the
planner predicts is what the router does.

`SlaPolicy` predicts each pair's TTFT (prefill queue + prompt + KV transfer) and TPOT (the decode
instance's step time once this request and the reservations already placed there have joined its
least-loaded DP rank, at the pace of its busiest rank) with the shared PerfModel; it keeps the pairs
that meet the request's targets with margin, takes the cheapest, spreading near-ties (within 10%) by
power of two choices so a stale report cannot herd every request onto one instance, and lists the rest as the
fail-over order. Prefix caches (the router's index of the instances' KvEvents, router.kv_index): a decode
instance that holds the prompt's leading blocks is pushed only the rest (the TTFT's transfer term shrinks),
a prefill instance that holds them computes only the rest; among the pairs within 10% of the cheapest
feasible one, the pair with the most cached tokens on decode, then on prefill, is taken outright (cache hit
over load balance while the SLA holds, decode's first, as llm-d's P/D prefix scorer and SGLang's
cache-aware router). If no pair can meet the targets it says no at once, with a retry-after hint, before
any prefill work.
`LeastLoadedPolicy` and `RoundRobinPolicy` ignore the SLA (baselines).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from router.perf import PerfModel
from shared.protocol.placement import least_loaded_rank


@dataclass
class RankView:
    running: int = 0  # requests decoding (+ reservations not yet admitted)
    tokens: int = 0  # their context tokens (reservations counted at prompt + max_tokens)
    prompt_tokens: int = 0  # prompt tokens the rank has yet to prefill itself (selective disaggregation)

    def count(self, context_tokens: int, prompt_tokens: int = 0) -> None:
        """A request placed here (its prompt to prefill here, if local), counted until the next load report."""
        self.running += 1
        self.tokens += context_tokens
        self.prompt_tokens += prompt_tokens


@dataclass
class PrefillView:
    address: str
    queued_tokens: int = 0  # prompt tokens waiting or not yet computed
    up: bool = True
    block_size: int = 64
    reports: int = 0  # load reports taken: a prompt counted since the last one is let go when it is done
    kv_seq: int = 0  # the last prefix-cache event the router's index took from it (changes when its cache does)

    def count(self, tokens: int) -> int:
        """A prompt sent here: queued until the next load report says otherwise (a burst's admissions must see
        it); returns the reports taken so far, for `done`."""
        self.queued_tokens += tokens
        return self.reports

    def done(self, tokens: int, counted_at: int) -> None:
        """That prompt was computed (or failed): no longer queued, unless a report since has counted it anew."""
        if self.reports == counted_at:
            self.queued_tokens = max(0, self.queued_tokens - tokens)


@dataclass
class DecodeView:
    address: str
    ranks: list[RankView] = field(default_factory=lambda: [RankView()])
    free_blocks: int = 1 << 30
    block_size: int = 64
    up: bool = True
    kv_seq: int = 0  # as PrefillView's

    def least_loaded(self) -> int:
        """The rank the decode instance will place a new request on (the same rule it applies)."""
        return least_loaded_rank([r.tokens for r in self.ranks], [r.running for r in self.ranks])

    @property
    def busy(self) -> bool:
        return self.up and any(r.running for r in self.ranks)

    def local_ttft_raw(self, perf: PerfModel, rank: int, prompt_tokens: int, others_busy: int) -> float:
        """First token of a prompt `rank` prefills itself, by the uncalibrated curves: the next lock-step
        step, whose length is the longest rank's decodes plus the prompt tokens it prefills (queued ones,
        and this prompt on `rank`)."""
        return max(perf.local_ttft_raw(view.running, view.tokens,
                                       view.prompt_tokens + (prompt_tokens if r == rank else 0), others_busy)
                   for r, view in enumerate(self.ranks))

    def step_with(self, perf: PerfModel, rank: int, tokens: int, others_busy: int = 0) -> tuple[float, float, int]:
        """(TPOT, uncalibrated TPOT, batch) of the busiest rank once a request of `tokens` context
        joins `rank`: the busiest rank sets a lock-step instance's pace. `others_busy`: other engines
        computing on the same cores (PerfModel's interference terms)."""
        worst = (0.0, 0.0, 1)
        for r, view in enumerate(self.ranks):
            batch, ctx = view.running + (r == rank), view.tokens + (tokens if r == rank else 0)
            t = perf.tpot(batch, ctx, others_busy)
            if t >= worst[0]:
                worst = (t, perf.tpot_raw(batch, ctx, others_busy), batch)
        return worst


@dataclass
class Request:
    prompt_tokens: int
    max_tokens: int
    ttft_s: float  # targets (0: none)
    tpot_s: float
    cached_tokens: int = 0
    cached_by_prefill: list[int] | None = None  # prompt tokens each prefill instance holds in its prefix cache
    cached_by_decode: list[int] | None = None  # prompt tokens each decode instance holds (not pushed again)
    priority: int = 0  # lower is more urgent (GenerateRequest.priority): see SlaPolicy.margin_for
    # a decode instance may prefill it itself when the prompt tokens it does not cache are at most this
    # (--local-prefill-tokens; 0: never), or at most overflow_prefill_tokens while every prefill instance has at
    # least that many prompt tokens queued (--overflow-prefill-tokens; 0 for a request an endpoint picker placed)
    local_prefill_tokens: int = 0
    overflow_prefill_tokens: int = 0

    def uncached_on_decode(self, d: int) -> int:
        """Prompt tokens decode instance `d` would compute to prefill it itself."""
        return self.prompt_tokens - (self.cached_by_decode[d] if self.cached_by_decode else 0)

    def local_limit(self, prefills: list[PrefillView]) -> int:
        """The most uncached prompt tokens a decode instance may prefill itself (0: none): the overflow limit too
        while every prefill instance that is up has at least that many prompt tokens queued (saturated: not one
        prompt in flight)."""
        up = [p for p in prefills if p.up]
        saturated = bool(up) and all(p.queued_tokens >= self.overflow_prefill_tokens for p in up)
        return max(self.local_prefill_tokens, self.overflow_prefill_tokens if saturated else 0)

    def local_prefill(self, limit: int) -> bool:
        """Some decode instance may prefill it itself within `limit` uncached tokens."""
        n = len(self.cached_by_decode) if self.cached_by_decode else 1
        return limit > 0 and any(self.uncached_on_decode(d) <= limit for d in range(n))


@dataclass
class Choice:
    prefill: int
    decode: int
    ttft_s: float  # predicted
    tpot_s: float
    cost: float
    cached_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens the decode instance holds already: not pushed
    queued_tokens: int = 0  # the prefill queue and the decode batch it was predicted at (calibration bands)
    batch: int = 0
    ttft_raw_s: float = 0.0  # the uncalibrated curves' predictions (what observations calibrate)
    tpot_raw_s: float = 0.0
    room: bool = True  # the decode's last report has the blocks (a stale report only orders: Reserve decides)
    busy_beside: int = 0  # engines computing beside its prefill (the TTFT calibration band)
    local: bool = False  # the decode instance prefills the prompt itself (prefill is -1: no prefill instance)


TIE = 0.1  # pairs within 10% of the cheapest are ties, spread by power of two choices
BACKGROUND_HEADROOM = 0.7  # a background request (priority > 0) may use 70% of the normal margin


class Rejected(Exception):
    """No pair can meet the request's targets now; `retry_after_s` says when one may."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SlaPolicy:
    name = "sla"

    def __init__(self, perf: PerfModel, margin: float = 0.9, seed: int | None = None):
        self.perf, self.margin = perf, margin
        self.rng = random.Random(seed)

    def predict(self, req: Request, prefills: list[PrefillView], decodes: list[DecodeView]) -> list[Choice]:
        """Every pair that is up and has room, with its predicted TTFT / TPOT and cost (normalised
        by the targets; lower is better). When every instance of a kind is down, all of that kind
        are candidates: a call fails fast on a dead one, and one back up is found at once."""
        context = req.prompt_tokens + req.max_tokens
        any_prefill, any_decode = any(p.up for p in prefills), any(d.up for d in decodes)
        # engines computing now: on shared cores each slows the others (0 effect on dedicated hardware)
        busy_prefills = sum(1 for p in prefills if p.up and p.queued_tokens > 0)
        busy_decodes = sum(1 for d in decodes if d.busy)
        out = []
        for d, dec in enumerate(decodes):
            if any_decode and not dec.up:
                continue
            others = busy_prefills + busy_decodes - dec.busy
            tpot, tpot_raw, batch = dec.step_with(self.perf, dec.least_loaded(), context, others)
            reused = req.cached_by_decode[d] if req.cached_by_decode else 0
            for p, pre in enumerate(prefills):
                if any_prefill and not pre.up:
                    continue
                cached = req.cached_by_prefill[p] if req.cached_by_prefill else req.cached_tokens
                others = busy_decodes + busy_prefills - (pre.up and pre.queued_tokens > 0)
                ttft = self.perf.ttft(pre.queued_tokens, req.prompt_tokens, cached, others, reused)
                cost = ttft / (req.ttft_s or 1.0) + tpot / (req.tpot_s or 1.0)
                raw = self.perf.ttft_raw(pre.queued_tokens, req.prompt_tokens, cached, others, reused)
                room = -(-context // dec.block_size) <= dec.free_blocks
                out.append(Choice(p, d, ttft, tpot, cost, cached, reused, pre.queued_tokens, batch, raw, tpot_raw,
                                  room, others))
        return out

    def predict_local(self, req: Request, prefills: list[PrefillView], decodes: list[DecodeView],
                      limit: int) -> list[Choice]:
        """Every decode instance that is up and caches all but at most `limit` of the prompt's tokens, prefilling
        the prompt itself: TTFT is its next step, carrying the
        prompt (and the prompts already queued there) beside its decodes (no prefill queue, RPC or
        transfer; DecodeView.local_ttft_raw, calibrated per batch band); TPOT as for a pair."""
        context = req.prompt_tokens + req.max_tokens
        busy_prefills = sum(1 for p in prefills if p.up and p.queued_tokens > 0)
        busy_decodes = sum(1 for d in decodes if d.busy)
        out = []
        for d, dec in enumerate(decodes):
            uncached = req.uncached_on_decode(d)  # it starts on the blocks it caches
            if not dec.up or uncached > limit:
                continue
            others = busy_prefills + busy_decodes - dec.busy
            rank = dec.least_loaded()
            tpot, tpot_raw, batch = dec.step_with(self.perf, rank, context, others)
            raw = dec.local_ttft_raw(self.perf, rank, uncached, others)
            ttft = raw * self.perf.local_ttft_factor(batch)
            room = -(-context // dec.block_size) <= dec.free_blocks
            out.append(Choice(-1, d, ttft, tpot, ttft / (req.ttft_s or 1.0) + tpot / (req.tpot_s or 1.0),
                              batch=batch, ttft_raw_s=raw, tpot_raw_s=tpot_raw, room=room, busy_beside=others,
                              local=True))
        return out

    def choose(self, req: Request, prefills: list[PrefillView], decodes: list[DecodeView]) -> list[Choice]:
        """Pairs to try, best first (the rest are the fail-over order); raises Rejected when none fits.
        Selective disaggregation: a request the decode instance may prefill itself goes there (decode
        instances to try, best first, all local) when that is predicted to give the first token sooner
        than the best pair within the targets (--local-prefill-tokens; --overflow-prefill-tokens while every prefill
        instance is saturated: a burst's overflow)."""
        pairs = self.predict(req, prefills, decodes)
        if not pairs:
            raise Rejected("no prefill/decode pair to choose from", 1.0)
        fits = [c for c in pairs if self._meets(c, req)]
        limit = req.local_limit(prefills)
        if req.local_prefill(limit):
            local = sorted((c for c in self.predict_local(req, prefills, decodes, limit)
                            if c.room and self._meets(c, req)), key=lambda c: c.cost)
            if local and (not fits or local[0].ttft_s < min(c.ttft_s for c in fits)):
                return local
        if not fits:
            if any(self._meets(c, req, raw=True) and c.queued_tokens == 0 and c.batch <= 1 for c in pairs):
                self.perf.relax()  # an idle pair refused by calibration alone: let it ease (a loaded one is observed)
            best = min(pairs, key=lambda c: c.cost)
            over = max(best.ttft_s - req.ttft_s * self.margin_for(req.priority) if req.ttft_s else 0.0,
                       best.tpot_s * req.max_tokens * 0.1 if req.tpot_s and best.tpot_s > req.tpot_s else 0.0)
            raise Rejected(f"no pair meets the SLA (best predicted TTFT {best.ttft_s * 1e3:.0f} ms, "
                           f"TPOT {best.tpot_s * 1e3:.1f} ms)", max(0.1, over))
        fits.sort(key=lambda c: (not c.room, c.cost))
        best = fits[0]
        ties = [i for i, c in enumerate(fits) if c.room and c.cost <= best.cost * (1 + TIE)]
        hit = max(ties, key=lambda i: (fits[i].reused_tokens, fits[i].cached_tokens), default=0)
        if fits[hit].reused_tokens or fits[hit].cached_tokens:  # a cache hit within the SLA wins: decode's first
            fits.insert(0, fits.pop(hit))
        elif len(ties) > 2:
            a, b = self.rng.sample(ties, 2)
            first = fits[min(a, b)]  # near-ties: the cheaper of two random ones, so stale reports do not herd
            fits.remove(first)
            fits.insert(0, first)
        return fits

    def margin_for(self, priority: int) -> float:
        """The share of a target a prediction may use: urgent requests (priority < 0) the whole target,
        normal ones `margin`, background ones (> 0) less, so under load they are refused first and
        leave headroom for the others."""
        if priority < 0:
            return 1.0
        return self.margin * (BACKGROUND_HEADROOM if priority > 0 else 1.0)

    def _meets(self, c: Choice, req: Request, raw: bool = False) -> bool:
        """Whether the pair's predictions (the uncalibrated curves' with `raw`) fit the targets with margin."""
        margin = self.margin_for(req.priority)
        ttft, tpot = (c.ttft_raw_s, c.tpot_raw_s) if raw else (c.ttft_s, c.tpot_s)
        return (not req.ttft_s or ttft <= req.ttft_s * margin) and (not req.tpot_s or tpot <= req.tpot_s * margin)


class LeastLoadedPolicy(SlaPolicy):
    """Fewest queued prefill tokens and decode tokens first; never rejects (the old router)."""

    name = "least-loaded"

    def choose(self, req: Request, prefills: list[PrefillView], decodes: list[DecodeView]) -> list[Choice]:
        pairs = self.predict(req, prefills, decodes)
        if not pairs:
            raise Rejected("no prefill/decode pair to choose from", 1.0)

        def load(c: Choice) -> tuple[bool, int, int]:
            return not c.room, prefills[c.prefill].queued_tokens, sum(r.tokens for r in decodes[c.decode].ranks)

        return sorted(pairs, key=load)


class RoundRobinPolicy(SlaPolicy):
    """Pairs in turn, blind to load and SLA (the baseline of bench/sla_router.py)."""

    name = "round-robin"

    def __init__(self, perf: PerfModel, margin: float = 0.9, seed: int | None = None):
        super().__init__(perf, margin, seed)
        self._turn = itertools.count()

    def choose(self, req: Request, prefills: list[PrefillView], decodes: list[DecodeView]) -> list[Choice]:
        pairs = self.predict(req, prefills, decodes)
        if not pairs:
            raise Rejected("no prefill/decode pair to choose from", 1.0)
        k = next(self._turn) % len(pairs)
        return pairs[k:] + pairs[:k]


POLICIES = {p.name: p for p in (SlaPolicy, LeastLoadedPolicy, RoundRobinPolicy)}
