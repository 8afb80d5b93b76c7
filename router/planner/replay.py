"""The trace replay (`simulate_trace`): a recorded trace over prefill and decode pools whose sizes follow a
static M/N or the autoscaler, every placement asked of the router's own policy (bench/trace_replay.py)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from enum import IntEnum

from router.perf import PerfModel
from router.planner.instances import ReplayDecode, ReplayPrefill, ReplayRequest, State
from router.planner.stage_a import Observation, Target
from router.planner.trace import TraceRequest, TraceResult
from router.policy import DecodeView, PrefillView, Rejected, Request, SlaPolicy


class Event(IntEnum):
    """What an event of the replay's queue is: its payload follows from it."""

    ARRIVE = 0  # a trace request arrives (payload: the ReplayRequest)
    PREFILLED = 1  # a prefill instance finishes the prompt in service (the ReplayPrefill)
    ADMIT = 2  # a prompt's KV reaches its decode instance (the ReplayRequest)
    STEP = 3  # a decode step ends ((the ReplayDecode, its epoch))
    READY = 4  # a booting instance is up (the instance)
    DECIDE = 5  # the sizing controller decides (None)


@dataclass(frozen=True)
class ReplaySettings:
    """simulate_trace's knobs (its signature holds their defaults and says what each means)."""

    ttft_s: float
    tpot_s: float
    period: float
    window: float
    startup_s: float
    observe_cached: bool
    block_tokens: int
    prefix_cache_blocks: int
    decode_kv_tokens: int
    candidates: int | None
    bucket_s: float
    ranks: int
    admission: bool
    boot_busy: float


@dataclass
class _Placement:
    """The instances that are up, as shown to the policy for one prompt (with what each prefill has cached)."""

    prefills: list[ReplayPrefill]
    decodes: list[ReplayDecode]
    prefill_views: list[PrefillView]
    decode_views: list[DecodeView]
    cached: list[int]


class TraceReplay:
    """One replay: the event queue, the pools, the per-request outcomes and the instance-hours accounting."""

    def __init__(self, perf: PerfModel, requests: list[TraceRequest], sizing: object, settings: ReplaySettings,
                 policy: SlaPolicy, initial: Target | None = None):
        self.perf, self.sizing, self.cfg, self.policy = perf, sizing, settings, policy
        self.static = isinstance(sizing, Target)
        self.start = sizing if self.static else (initial or Target(sizing.prefill.low, sizing.decode.low))
        self.reqs = [ReplayRequest(i, r) for i, r in enumerate(requests)]
        self.events: list[tuple[float, int, Event, object]] = []
        self.seq = iter(range(1 << 62))
        self.prefills: list[ReplayPrefill] = []
        self.decodes: list[ReplayDecode] = []
        self.names = iter(range(1 << 30))
        self.ttft = [math.inf] * len(self.reqs)
        self.tpot = [math.inf] * len(self.reqs)
        self.met = [False] * len(self.reqs)
        self.rejected = self.migrations = self.prompt_tokens = self.computed_tokens = 0
        # instance-hours and the per-bucket series
        self.buckets = 1 + int((requests[-1].arrival if requests else 0.0) // settings.bucket_s)  # holding arrivals
        self.area_m, self.area_n = [0.0] * self.buckets, [0.0] * self.buckets
        self.accounted_t, self.live_m, self.live_n, self.hours = 0.0, 0, 0, 0.0
        self.booting, self.booting_hours = 0, 0.0  # instances asked for and not serving yet, and their hours
        self.sizes: list[tuple[float, int, int]] = []
        self.arrived: list[tuple[float, int, int]] = []  # (time, prompt tokens, cached ones) of every arrival
        self.completed: list[tuple[float, int]] = []  # (time, output tokens) of every completion
        self.seen = [0, 0]  # the first entries of both still inside the window
        self.done_count = 0

    # --- the run -------------------------------------------------------------------------------------
    def run(self) -> TraceResult:
        for _ in range(self.start.prefill):
            self.add("prefill", 0.0, up=True)
        for _ in range(self.start.decode):
            self.add("decode", 0.0, up=True)
        self.sizes.append((0.0, self.start.prefill, self.start.decode))
        self.account(0.0)
        for r in self.reqs:
            self.push(r.arrival, Event.ARRIVE, r)
        if not self.static:
            self.push(self.cfg.period, Event.DECIDE, None)
        handlers = {Event.ARRIVE: self.on_arrive, Event.PREFILLED: self.on_prefilled, Event.ADMIT: self.admit,
                    Event.STEP: self.on_step, Event.READY: self.on_ready, Event.DECIDE: self.on_decide}
        now = end = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == Event.DECIDE and self.done_count + self.rejected == len(self.reqs):
                continue  # every request is over: the replay ends with the last one
            end = now
            handlers[kind](payload, now)
        self.account(end)
        return self.result(end)

    def result(self, end: float) -> TraceResult:
        bucket_s = self.cfg.bucket_s
        arrivals_in: list[list[int]] = [[] for _ in range(self.buckets)]
        for r in self.reqs:
            arrivals_in[min(self.buckets - 1, int(r.arrival // bucket_s))].append(r.i)
        series = [(b * bucket_s, len(ix) / bucket_s, self.area_m[b] / bucket_s, self.area_n[b] / bucket_s,
                   (sum(self.met[i] for i in ix) / len(ix)) if ix else math.nan) for b, ix in enumerate(arrivals_in)]
        return TraceResult(self.ttft, self.tpot, self.met, self.cfg.ttft_s, self.cfg.tpot_s, self.hours, end,
                           self.rejected, self.migrations, self.prompt_tokens, self.computed_tokens, series,
                           self.sizes, self.booting_hours)

    def push(self, t: float, kind: Event, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    # --- pools and their accounting ------------------------------------------------------------------
    def account(self, now: float) -> None:
        t0, m, n = self.accounted_t, self.live_m, self.live_n
        if now > t0:
            self.hours += (m + n) * (now - t0) / 3600.0
            self.booting_hours += self.booting * (now - t0) / 3600.0
            b = int(t0 // self.cfg.bucket_s)
            while t0 < now and b < self.buckets:
                t1 = min(now, (b + 1) * self.cfg.bucket_s)
                self.area_m[b] += m * (t1 - t0)
                self.area_n[b] += n * (t1 - t0)
                t0, b = t1, b + 1
        self.accounted_t = now
        self.live_m = sum(1 for p in self.prefills if p.state != State.GONE)
        self.live_n = sum(1 for d in self.decodes if d.state != State.GONE)
        self.booting = sum(1 for x in (*self.prefills, *self.decodes) if x.state == State.STARTING)

    def provisioned(self) -> tuple[int, int]:
        return (sum(1 for p in self.prefills if p.state in (State.STARTING, State.UP)),
                sum(1 for d in self.decodes if d.state in (State.STARTING, State.UP)))

    def add(self, kind: str, now: float, up: bool) -> None:
        state = State.UP if up or self.cfg.startup_s <= 0 else State.STARTING
        if kind == "prefill":
            inst: object = ReplayPrefill(f"p{next(self.names)}", state, self.cfg.prefix_cache_blocks)
            self.prefills.append(inst)
        else:
            inst = ReplayDecode(f"d{next(self.names)}", state, self.cfg.ranks)
            self.decodes.append(inst)
        if state == State.STARTING:
            self.push(now + self.cfg.startup_s, Event.READY, inst)

    def on_ready(self, inst: ReplayPrefill | ReplayDecode, now: float) -> None:
        if inst.state == State.STARTING:
            self.account(now)  # its boot ends: counted as booting until now
            inst.state = State.UP
            self.account(now)

    def on_decide(self, _: None, now: float) -> None:
        for j, xs in enumerate((self.arrived, self.completed)):
            while self.seen[j] < len(xs) and xs[self.seen[j]][0] <= now - self.cfg.window:
                self.seen[j] += 1
        ins, outs = self.arrived[self.seen[0]:], self.completed[self.seen[1]:]
        obs = Observation(len(ins) / min(self.cfg.window, now), sum(x[1] for x in ins) / max(1, len(ins)),
                          sum(x for _, x in outs) / len(outs) if outs else 0.0,
                          sum(x[2] for x in ins) / max(1, len(ins)), min(self.cfg.window, now))
        m, n = self.provisioned()
        self.resize(self.sizing.decide(now, obs, Target(m, n)), now)
        self.account(now)
        self.push(now + self.cfg.period, Event.DECIDE, None)

    def resize(self, target: Target, now: float) -> None:
        for kind, pool, want in (("prefill", self.prefills, target.prefill), ("decode", self.decodes, target.decode)):
            live = [x for x in pool if x.state in (State.STARTING, State.UP)]
            for _ in range(want - len(live)):
                self.add(kind, now, up=False)
            for _ in range(len(live) - want):
                live = [x for x in pool if x.state in (State.STARTING, State.UP)]
                booting = [x for x in live if x.state == State.STARTING]
                if booting:
                    self.account(now)
                    booting[-1].state = State.GONE
                elif kind == "prefill":
                    self.retire_prefill(min(live, key=lambda p: (p.queued_tokens(now), len(p.queue) - p.head)), now)
                else:
                    self.retire_decode(min(live, key=lambda d: (sum(d.batch) + len(d.pending) + sum(d.reserved),
                                                                sum(d.ctx))), now)
        m, n = self.provisioned()
        if not self.sizes or self.sizes[-1][1:] != (m, n):
            self.sizes.append((now, m, n))

    def retire_prefill(self, p: ReplayPrefill, now: float) -> None:
        p.state = State.DRAINING if not p.idle or p.busy_until > now else State.GONE

    def retire_decode(self, d: ReplayDecode, now: float) -> None:
        d.state = State.GONE
        d.epoch += 1
        moving = [(r, r.done + d.k - r.join_k) for r in d.running()] + [(r, r.done) for r in d.pending]
        d.heap.clear()
        d.pending.clear()
        d.batch, d.ctx = [0] * self.cfg.ranks, [0] * self.cfg.ranks
        d.stepping = False
        for r, done in moving:
            r.done = done
            r.ticket += 1
            r.migrations += 1
            self.migrations += 1
            self.place(r, now, r.isl + r.done, r.osl - r.done, must=True)

    def others_busy(self, me: ReplayPrefill | ReplayDecode, now: float) -> float:
        """Engines computing beside `me` (prefills mid-prompt, decodes stepping; an instance booting counts as
        `boot_busy` of one: a boot loads a model on the same cores for part of its time) where the model's
        instances share cores (perf.colocated); 0 on dedicated hardware. An operation's length is set by those
        busy as it starts."""
        if not self.perf.colocated:
            return 0.0
        busy = 0.0
        for x in (*self.prefills, *self.decodes):
            if x is me or x.state == State.GONE:
                continue
            if x.state == State.STARTING:
                busy += self.cfg.boot_busy
            elif (x.busy_until > now) if isinstance(x, ReplayPrefill) else x.stepping:
                busy += 1.0
        return busy

    # --- placement -----------------------------------------------------------------------------------
    def views(self, now: float, tokens: int, remaining: int, blocks: tuple[int, ...]) -> _Placement:
        perf, candidates = self.perf, self.cfg.candidates
        pre = [p for p in self.prefills if p.state == State.UP]
        dec = [d for d in self.decodes if d.state == State.UP]
        queued = [p.queued_tokens(now) for p in pre]
        cached = [min(p.cached_prefix(blocks) * self.cfg.block_tokens, tokens - 1) for p in pre]
        loads = [d.rank_loads() for d in dec]
        if candidates and len(pre) > candidates:  # the fastest prefills by the policy's own TTFT curve
            keep = sorted(range(len(pre)), key=lambda i: perf.ttft_raw(queued[i], tokens, cached[i]))[:candidates]
            pre, queued, cached = [pre[i] for i in keep], [queued[i] for i in keep], [cached[i] for i in keep]
        if candidates and len(dec) > candidates:  # the fastest decodes once the request joins (its best rank)
            keep = sorted(range(len(dec)), key=lambda i: min(perf.tpot_raw(b + 1, u + tokens + remaining)
                                                             for b, u in loads[i]))[:candidates]
            dec, loads = [dec[i] for i in keep], [loads[i] for i in keep]
        pviews = [PrefillView(p.name, q) for p, q in zip(pre, queued)]
        dviews = [d.view(self.cfg.decode_kv_tokens, x) for d, x in zip(dec, loads)]
        return _Placement(pre, dec, pviews, dviews, cached)

    def place(self, req: ReplayRequest, now: float, tokens: int, remaining: int, must: bool) -> bool:
        """Choose a pair by the policy and queue the prompt (`tokens`: what to prefill); `must` (a migration):
        never refused, the cheapest pair instead."""
        shown = self.views(now, tokens, remaining, req.blocks)
        ask = Request(tokens, remaining, self.cfg.ttft_s, self.cfg.tpot_s, cached_by_prefill=shown.cached)
        try:
            choice = self.policy.choose(ask, shown.prefill_views, shown.decode_views)[0]
        except Rejected:
            if not must:
                return False
            choice = min(self.policy.predict(ask, shown.prefill_views, shown.decode_views), key=lambda c: c.cost)
        p, d = shown.prefills[choice.prefill], shown.decodes[choice.decode]
        req.dec, req.rank = d, shown.decode_views[choice.decode].least_loaded()
        d.reserved[req.rank] += 1
        d.reserved_tokens[req.rank] += tokens + remaining
        uncached = tokens - shown.cached[choice.prefill]
        if self.cfg.observe_cached and req.migrations == 0:
            self.arrived[-1] = (now, tokens, tokens - uncached)
        p.queue.append((req, tokens, uncached))
        if len(p.queue) - p.head == 1 and p.busy_until <= now:
            self.start_prefill(p, now)
        else:
            p.waiting_tokens += uncached
        return True

    def on_arrive(self, r: ReplayRequest, now: float) -> None:
        self.arrived.append((now, r.isl, 0))
        if not self.place(r, now, r.isl, r.osl, must=not self.cfg.admission):
            self.rejected += 1

    # --- prefill -------------------------------------------------------------------------------------
    def start_prefill(self, p: ReplayPrefill, now: float) -> None:
        req, tokens, _ = p.queue[p.head]
        hit = min(p.cached_prefix(req.blocks, touch=True) * self.cfg.block_tokens, tokens - 1)
        new = tokens - hit
        perf = self.perf
        seconds = (perf.prefill_base_s + perf.prefill_per_token_s * new
                   + perf.prefill_per_token2_s * (tokens * tokens - hit * hit)) * perf.prefill_slowdown(
                       self.others_busy(p, now))
        self.prompt_tokens += tokens
        self.computed_tokens += new
        p.busy_from, p.busy_until, p.busy_tokens = now, now + seconds, new
        self.push(now + seconds, Event.PREFILLED, p)

    def on_prefilled(self, p: ReplayPrefill, now: float) -> None:
        r, tokens, _ = p.queue[p.head]
        p.head += 1
        if p.head > 64 and p.head * 2 > len(p.queue):
            del p.queue[:p.head]
            p.head = 0
        p.insert(r.blocks)
        self.push(now + self.perf.transfer_seconds(tokens), Event.ADMIT, r)
        if not p.idle:
            p.waiting_tokens -= p.queue[p.head][2]
            self.start_prefill(p, now)
        elif p.state == State.DRAINING:
            p.state = State.GONE
            self.account(now)

    # --- decode --------------------------------------------------------------------------------------
    def admit(self, r: ReplayRequest, now: float) -> None:
        d = r.dec
        d.reserved[r.rank] -= 1
        d.reserved_tokens[r.rank] -= r.isl + r.osl  # what `place` reserved: prompt (+ generated) + tokens to go
        if d.state != State.UP:  # its decode instance left while the prompt was in prefill: another one takes it
            up = [x for x in self.decodes if x.state == State.UP]
            d = r.dec = min(up, key=lambda x: (sum(x.ctx) + sum(x.reserved_tokens), sum(x.batch)))
            r.rank = d.view(self.cfg.decode_kv_tokens).least_loaded()
        if r.done == 0:
            r.first = now
            r.done = 1
        if r.done >= r.osl:
            self.finish(r, now)
            return
        d.pending.append(r)
        if not d.stepping:
            self.start_step(d, now)

    def start_step(self, d: ReplayDecode, now: float) -> None:
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
        seconds = d.step_seconds(self.perf) * self.perf.decode_slowdown(self.others_busy(d, now))
        self.push(now + seconds, Event.STEP, (d, d.epoch))

    def on_step(self, payload: tuple[ReplayDecode, int], now: float) -> None:
        d, epoch = payload
        if epoch != d.epoch:
            return
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
            self.finish(r, now)
        self.start_step(d, now)

    def finish(self, r: ReplayRequest, now: float) -> None:
        r.last = now
        i = r.i
        self.ttft[i] = r.first - r.arrival
        self.tpot[i] = (r.last - r.first) / (r.osl - 1) if r.osl > 1 else 0.0
        self.met[i] = self.ttft[i] <= self.cfg.ttft_s and self.tpot[i] <= self.cfg.tpot_s
        self.completed.append((now, r.osl))
        self.done_count += 1


def simulate_trace(perf: PerfModel, requests: list[TraceRequest], sizing: object, ttft_s: float, tpot_s: float,
                   period: float = 15.0, window: float | None = None, startup_s: float = 60.0,
                   initial: object | None = None, observe_cached: bool = False,
                   block_tokens: int = 512, prefix_cache_blocks: int = 1 << 30, decode_kv_tokens: int = 1 << 40,
                   policy: SlaPolicy | None = None, candidates: int | None = None, bucket_s: float = 60.0,
                   seed: int = 0, ranks: int = 1, admission: bool = True, boot_busy: float = 1.0) -> TraceResult:
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
    among them; near-ties spread over fewer); None: all, as the router does. `admission` False: nothing is
    refused (the policy's cheapest pair takes a request no pair can serve in time), as a router without SLA
    targets of its own (its autoscaler still sizes for `ttft_s` / `tpot_s`).

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
    * Shared cores (a colocated perf model: `pdserve profile --router` measured interference, as on one host):
      a prefill or a decode step takes perf.prefill_slowdown / decode_slowdown of the other engines busy as it
      starts (computing; a booting instance counts as `boot_busy` of one, its CPU time over its boot), so
      instances added to the same cores add no compute.

    Instance-hours: ∫ (M + N) dt over instances booting, up or draining, until the last request ends."""
    settings = ReplaySettings(ttft_s, tpot_s, period, window or period, startup_s, observe_cached, block_tokens,
                              prefix_cache_blocks, decode_kv_tokens, candidates, bucket_s, ranks, admission,
                              boot_busy)
    return TraceReplay(perf, requests, sizing, settings, policy or SlaPolicy(perf, seed=seed), initial).run()
