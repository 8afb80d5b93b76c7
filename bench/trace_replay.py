"""Replay one hour of real conversation traffic (Mooncake's FAST'25 trace: 12,031 requests from Kimi, real
arrival times, prompt / output lengths and 512-token prefix-block hashes) in the planner's simulation at
real scale (router.planner.simulate_trace: every placement is the router's SlaPolicy, each prefill
instance keeps an LRU prefix cache of the hashed blocks), with a performance model set from figures
published for DeepSeek-V3 on H800 nodes. Prints SLA attainment against instance-hours for static M/N
splits and for the autoscaler (router.autoscale), and plots both.

    python bench/trace_replay.py [--scales 1,4,16] [--ttft-s 5] [--tpot-ms 50] [--startup-s 60] [--min-m 1]
                                 [--max-m M] [--max-n N] [--swing D] [--global-cache] [--minutes M] [--jobs 2]

Per scale (--scales K: K copies of the hour superposed, copy k shifted by 7.5·k s with its own prefix hashes:
K times the traffic with the same hourly shape; the policy is shown the 4 fastest instances of each pool, see
simulate_trace's `candidates`), the fixed splits are searched wide enough that the cheapest one reaching 95 %
attainment lies inside the bounds (search_static: the fewest decode instances that reach it with ample prefill,
then for that N and N + 1 the fewest prefill instances, by bisection; bounds M <= 4·K + 2, N <= K/4 + 2 unless
given), and the autoscalers (router.autoscale.Autoscaler within the same bounds, a decision every 5 s on the
last 120 s, cached prompt tokens counted apart) run against it: as `pdserve up --autoscale` ships it (the load
seen plus 3.5 standard deviations of its arrival count, down after 120 s to the most that time needed), with the
previous defaults (the load seen + 15 % at every scale, down after 60 s) and planning ahead (--autoscale-lead:
the load forecast one boot time ahead). A hindsight
reference rechooses the prefill count every 10 minutes knowing the hour (the cheapest choice whose attainment
over the hour reaches 95 %): what no causal autoscaler can expect to beat.
--swing D presses a day's shape into the hour (the middle thinned to 1 - D of its rate; see `swing`).
Each row: instance-hours and their ratio to the cheapest fixed split, attainment, pool changes per hour and
the instance-seconds spent booting. Saves bench/out/trace_replay[_xK_..].png (attainment vs instance-hours per
scale; the planning-ahead autoscaler's hour at the largest scale) and .json.

One instance = one 8×H800 node (the unit DeepSeek publishes its per-node throughputs in). Weights do not
fit one node (DeepSeek deploys prefill in units of 4 nodes, decode in units of 18), so an instance here is
a node's share of such a deployment: capacity added and removed a node at a time.

Performance model (PerfModel, node level), every number from a published figure:

  Sources
  [D6]  DeepSeek, "Day 6: One More Thing, DeepSeek-V3/R1 Inference System Overview", github.com/deepseek-ai/
        open-infra-index/blob/main/202502OpenSourceWeek/day_6_one_more_thing_deepseekV3R1_inference_system_overview.md
        : "Each H800 node delivers an average throughput of ~73.7k tokens/s input (including cache hits)
        during prefilling or ~14.8k tokens/s output during decoding"; "342B tokens (56.3%) hit the on-disk
        KV cache"; "The average output speed was 20–22 tokens per second, and the average kvcache length
        per output token was 4,989 tokens"; "matrix multiplications ... FP8 ..., core MLA computations ...
        BF16"; prefill deployment unit 4 nodes (EP32), decode 18 nodes (EP144).
  [SG]  LMSYS / SGLang, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96
        H100 GPUs", lmsys.org/blog/2025-05-05-large-scale-ep: its table of DeepSeek's figures: blog prefill
        32,206 tokens/s per node excluding cache hits; DeepSeek's profile (github.com/deepseek-ai/profile-data:
        decode EP128, 4K prompt, 128 requests per GPU) 18,598 output tokens/s per node; and its own H100
        figures (22,282 output tokens/s per node at 256 requests per GPU, 2,000-token contexts, no MTP).
  [FM]  FlashMLA README, github.com/deepseek-ai/FlashMLA: "The dense MLA decoding kernel achieves up to 3000
        GB/s in memory-bound configuration ... on H800 SXM5".
  [EP]  DeepEP docs/legacy.md, github.com/deepseek-ai/DeepEP: H800 "each connected to a CX7 InfiniBand 400
        Gb/s RDMA network card (~50 GB/s maximum bandwidth)".
  [V3]  DeepSeek-V3 config / technical report (arXiv 2412.19437): 61 layers, 128 heads, q/k head dim 192
        (128 + 64 rope), v head dim 128, KV latent 512 + 64 rope, 37B activated parameters per token.
  [MC]  Mooncake, FAST'25 (github.com/kvcache-ai/Mooncake/blob/main/FAST25-release/Mooncake-FAST25.pdf),
        §5.1: "the threshold for TTFT is set to 30 s, and TBT thresholds are set to 100 ms, 200 ms, and
        300 ms"; the conversation trace on 16 nodes of 8×A800, "Cache Ratio 40%" (Table 2).

  Prefill, prefill(T new tokens after a cached prefix p) = a·(T − p) + c·(T² − p²):
    linear FLOPs per token 2 × 37e9 = 74 GFLOP [V3]; attention FLOPs per (query, key) pair 61 × 128 × 2 ×
    (192 + 128) = 5.0 MFLOP [V3], T²/2 pairs (causal); the GEMMs run FP8, the attention BF16 [D6] (H800:
    half the FP8 rate), so c/a = 2 × 5.0e6 / 2 / 74e9 = 6.75e-5 per token. DeepSeek's production prefill
    excluding cache hits is 73.7k × (1 − 0.563) = 32.2k tokens/s per node [D6] ([SG] lists 32,206); taken
    at the profile's 4,096-token prompts: a·(1 + 6.75e-5 × 4096) = 1 / 32,206 s → a = 24.3 µs per token,
    c = 1.64 ns per token². (A 12k-token prompt: 0.53 s; 128k: 30 s. DeepSeek-V3.2's sparse attention
    cuts the T² term, so for V3.2 this is pessimistic on long prompts.) prefill_base_s = 0.
    One instance computes one prompt at a time at the node's rate (a long prompt spread over the node's 8
    GPUs, as V3.2 prefill context parallelism does): node throughput is right, a lone prompt's latency is
    optimistic when the real engine would give it one GPU.
  Decode, step(B requests, C context tokens) = a + b·B + c·C per output token, node level:
    c from the KV read: 61 × 576 × 2 B = 70,272 B per context token [V3] over 8 × 3,000 GB/s [FM] →
    c = 2.93 ns; a, b through two published operating points (effective seconds per output token, MTP
    included): production 1/21 s at B = 14,800/21 = 705 requests per node, C = 705 × 4,989 [D6]; DeepSeek's
    profile 1,024/18,598 s at B = 1,024, C = 1,024 × 4,096 [SG] → b = 17.1 µs per request, a = 25.3 ms.
    (Cross-check: SGLang's H100 point [SG], B = 2,048, C = 2,048 × 2,000: the model says 72 ms per token,
    measured 92 ms, on slower H100 software without MTP.)
  Transfer: 70,272 B per prompt token over one GPU's 400 Gb/s NIC, 50 GB/s [EP] (a request's KV sits on one
    DP rank): a 12k-token prompt 17 ms.
  Prefix cache of a prefill instance (LRU over the trace's 512-token block hashes): 640 GB HBM − 188 GB of
    FP8 weights (671B parameters + 32 redundant experts [D6] over the 4-node unit) − 160 GB assumed for
    activations and buffers = 292 GB → 4.16M tokens → 8,120 blocks. --global-cache: one shared pool
    without limit (DeepSeek's on-disk cache [D6], Mooncake Store [MC]).
  Decode KV capacity (the policy's room check): 640 GB − 42 GB of weights (18-node unit) − 80 GB → 7.4M
    tokens per node; the trace never comes near it.

SLA: TTFT ≤ 5 s and TPOT ≤ 50 ms per request (attainment: both met; a refusal is a miss). 50 ms is
DeepSeek's production speed (20–22 tokens/s [D6]); 5 s is an interactive chat's first token, tighter than
Mooncake's 30 s [MC] (at 30 s every split with enough prefill meets it and nothing is traded). Mooncake's TBT
is the mean of the longest 10% of a request's token gaps; TPOT here is the mean gap.

Instance startup: 60 s from the decision to serving (loading a node's ~190 GB of FP8 weights from local
NVMe at a few GB/s, plus warm-up; an assumption, --startup-s), counted in instance-hours while booting.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import itertools
import json
import math
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.common import OUT, ROOT, table
from router.autoscale import AutoscaleConfig, Autoscaler, Bounds, Observation, Target
from router.perf import PerfModel
from router.planner import TraceRequest, TraceResult, load_trace, simulate_trace
from shared.config import knob_default

# The trace, vendored with its license (Apache-2.0, bench/data/mooncake-fast25/LICENSE-APACHE): 3 MB of
# token counts and hashed prefix blocks, no text.
TRACE = ROOT / "bench" / "data" / "mooncake-fast25" / "conversation_trace.jsonl"
TRACE_SOURCE = ("github.com/kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl "
                "(Apache-2.0)")

# --- the published figures (see the docstring) -------------------------------------------------------------
LAYERS, HEADS, QK_DIM, V_DIM, KV_LATENT = 61, 128, 192, 128, 576  # DeepSeek-V3 [V3]
ACTIVE_PARAMS = 37e9
KV_BYTES = LAYERS * KV_LATENT * 2  # 70,272 B per token (BF16 latent + rope) [V3, D6]
PREFILL_TOKENS_S = 73.7e3 * (1 - 0.563)  # per node, excluding cache hits [D6]
PREFILL_AT_TOKENS = 4096  # DeepSeek's prefill profile prompt [SG]
FP8_OVER_BF16 = 2.0  # H800: FP8 GEMMs at twice the BF16 rate of the attention [D6]
DECODE_POINTS = (  # (requests per node, context tokens per request, seconds per output token)
    (14.8e3 / 21, 4989, 1 / 21),  # production [D6]: 14.8k tokens/s per node at 20–22 tokens/s each
    (1024, 4096, 1024 / 18598),  # DeepSeek's decode profile [SG]: 128 per GPU, 18,598 tokens/s per node
)
HBM_BYTES_S = 8 * 3000e9  # FlashMLA's memory-bound decode on 8 H800 [FM]
NIC_BYTES_S = 50e9  # one CX7 400 Gb/s per H800 [EP]
PREFILL_KV_BYTES = 640e9 - 188e9 - 160e9  # HBM − weights (4-node unit) − activations (assumed)
DECODE_KV_BYTES = 640e9 - 42e9 - 80e9
BLOCK_TOKENS = 512  # the trace's hash block


def deepseek_v3_h800() -> PerfModel:
    """The node-level PerfModel derived in the module docstring."""
    pair_flops = LAYERS * HEADS * 2 * (QK_DIM + V_DIM)
    ratio = FP8_OVER_BF16 * (pair_flops / 2) / (2 * ACTIVE_PARAMS)  # c / a
    a = 1 / PREFILL_TOKENS_S / (1 + ratio * PREFILL_AT_TOKENS)
    ctx_s = KV_BYTES / HBM_BYTES_S
    (b1, l1, t1), (b2, l2, t2) = DECODE_POINTS
    r1, r2 = t1 - ctx_s * b1 * l1, t2 - ctx_s * b2 * l2
    per_seq = (r2 - r1) / (b2 - b1)
    return PerfModel(prefill_base_s=0.0, prefill_per_token_s=a, prefill_per_token2_s=a * ratio,
                     decode_base_s=r1 - per_seq * b1, decode_per_seq_s=per_seq, decode_per_context_token_s=ctx_s,
                     kv_bytes_per_token=KV_BYTES, transfer_bytes_per_s=NIC_BYTES_S)


SHIPPED_PERIOD = knob_default(AutoscaleConfig, "autoscale_period")
SHIPPED_WINDOW = knob_default(AutoscaleConfig, "autoscale_window")
GOAL = 0.95  # the attainment the cheapest fixed split is sought for (--goal)
AUTOSCALERS = {  # name: the Autoscaler's knobs (None: its shipped default; "startup": the bench's --startup-s)
    "autoscaler, as shipped": {},  # `pdserve up --autoscale` / the chart, with their defaults
    # the previous defaults: the load seen + 15 % whatever the fleet's size, down after 60 s
    "autoscaler, fixed +15 %": {"lead_s": 0.0, "headroom": 1.15, "burst_sigmas": 0.0, "down_after_s": 60.0},
    # the load forecast one boot time ahead, times the forecast's own error margin, +10 %; down after 2 min
    "autoscaler, planning ahead": {"lead_s": "startup", "headroom": 1.1, "burst_sigmas": 0.0, "down_after_s": 120.0},
}
HINDSIGHT_S = 600.0  # the hindsight reference re-chooses the fixed split every this many seconds
WARM_S = 120.0  # ... each segment's simulation starting this much earlier (its prefix caches warm), not scored


def segment_met(requests: list[TraceRequest], t0: float, length: float, target: Target, args: dict) -> tuple[int, int]:
    """Requests met and requests scored of the window [t0, t0 + length) at a fixed split, simulated from WARM_S
    before it (the lead-in's requests warm the prefix caches and are not scored): the hindsight reference's and
    trace_bound's unit of work."""
    part = [TraceRequest(r.arrival - t0 + WARM_S, r.prompt_tokens, r.output_tokens, r.blocks)
            for r in requests if t0 - WARM_S <= r.arrival < t0 + length]
    start = min(WARM_S, t0)  # the first segment has nothing before it
    part = [r for r in part if r.arrival >= WARM_S - start]
    r = simulate_trace(deepseek_v3_h800(), part, target, args["ttft_s"], args["tpot_s"],
                       startup_s=args["startup_s"], block_tokens=BLOCK_TOKENS, prefix_cache_blocks=args["cache_blocks"],
                       decode_kv_tokens=args["decode_kv_tokens"], candidates=args["candidates"])
    scored = [met for req, met in zip(part, r.met, strict=True) if req.arrival >= WARM_S]
    return sum(scored), len(scored)


def _segment(job: tuple) -> tuple[int, int, int, int]:
    """One hindsight segment at one split: (segment, M, requests met, requests scored)."""
    k, m, n, requests, args = job
    return k, m, *segment_met(requests, k * HINDSIGHT_S, HINDSIGHT_S, Target(m, n), args)


def sim_args(scale: int, max_m: int, max_n: int, ttft_s: float = 5.0, tpot_s: float = 0.05, min_m: int = 1,
             startup_s: float = 60.0, global_cache: bool = False) -> dict:
    """The simulation's settings for one scale of the trace (Runner's `args`): SLA targets, the search's bounds,
    boot time, each prefill instance's prefix-cache blocks (unbounded: one cache shared by all), each decode
    instance's KV tokens, and the router's candidate pairs (every pair at scale 1, 4 beyond)."""
    return {"ttft_s": ttft_s, "tpot_s": tpot_s, "min_m": min_m, "max_m": max_m, "max_n": max_n,
            "startup_s": startup_s,
            "cache_blocks": (1 << 40) if global_cache else int(PREFILL_KV_BYTES / KV_BYTES / BLOCK_TOKENS),
            "decode_kv_tokens": int(DECODE_KV_BYTES / KV_BYTES), "candidates": None if scale == 1 else 4}


def hindsight(runner: Runner, cheapest: Target, goal: float, end_s: float) -> tuple[float, float]:
    """A reference no causal autoscaler can expect to beat: a prefill count per HINDSIGHT_S segment (the cheapest
    split's decode count), chosen knowing the whole hour, resized for free and at once, the cheapest combination
    whose attainment over the hour reaches `goal` (every combination of the counts near the cheapest split's
    tried), until `end_s` (when the fixed split's last request ended). Its (instance-hours, attainment)."""
    span = runner.requests[-1].arrival
    segments = int(span // HINDSIGHT_S) + 1
    ms = range(max(1, cheapest.prefill - 3), cheapest.prefill + 2)
    jobs = [(k, m, cheapest.decode, runner.requests, runner.args) for k in range(segments) for m in ms]
    out = {(k, m): (met, n) for k, m, met, n in (runner.pool.map(_segment, jobs) if runner.pool else
                                                  map(_segment, jobs))}
    lengths = [HINDSIGHT_S if k + 1 < segments else end_s - k * HINDSIGHT_S for k in range(segments)]
    total = sum(out[0, m][1] for m in ms[:1]) + sum(out[k, ms[0]][1] for k in range(1, segments))
    best = (math.inf, 0.0)
    for choice in itertools.product(ms, repeat=segments):
        met = sum(out[k, m][0] for k, m in enumerate(choice))
        if met >= goal * total:
            hours = sum((m + cheapest.decode) * length for m, length in zip(choice, lengths, strict=True)) / 3600
            best = min(best, (hours, met / total))
    return best


def _run(job: tuple) -> tuple[str, TraceResult]:
    name, requests, sizing, initial, args = job
    perf = deepseek_v3_h800()
    period = window = 15.0
    if sizing in AUTOSCALERS:
        period, window = SHIPPED_PERIOD, SHIPPED_WINDOW
        knobs = {k: args["startup_s"] if v == "startup" else v for k, v in AUTOSCALERS[sizing].items()}
        sizing = Autoscaler(perf, args["ttft_s"], args["tpot_s"], Bounds(args["min_m"], args["max_m"]),
                            Bounds(1, args["max_n"]), window_s=window, **knobs)
    return name, simulate_trace(perf, requests, sizing, args["ttft_s"], args["tpot_s"], period=period, window=window,
                                startup_s=args["startup_s"], initial=initial, observe_cached=True,
                                block_tokens=BLOCK_TOKENS, prefix_cache_blocks=args["cache_blocks"],
                                decode_kv_tokens=args["decode_kv_tokens"], candidates=args["candidates"])


def _warm_start(requests: list[TraceRequest], args: dict) -> Target:
    """The autoscaler's sizes at t = 0: what it would decide on the trace's first minute (the hour is a slice
    of a service already running)."""
    first = [r for r in requests if r.arrival < 60] or requests[:1]
    obs = Observation(len(first) / 60, sum(r.prompt_tokens for r in first) / len(first),
                      sum(r.output_tokens for r in first) / len(first))
    return Autoscaler(deepseek_v3_h800(), args["ttft_s"], args["tpot_s"], Bounds(args["min_m"], args["max_m"]),
                      Bounds(1, args["max_n"])).needed(obs)


def scale_trace(requests: list[TraceRequest], copies: int, shift_s: float = 7.5) -> list[TraceRequest]:
    """`copies` independent populations with the trace's hour: copy k arrives k·shift_s later (wrapping
    around the hour's end, so the hour's trend stays) with its own prefix hashes (no sharing across copies)."""
    if copies <= 1:
        return requests
    span = requests[-1].arrival + 1e-3
    top = 1 + max((h for r in requests for h in r.blocks), default=0)
    out = [TraceRequest((r.arrival + k * shift_s) % span, r.prompt_tokens, r.output_tokens,
                        tuple(h + k * top for h in r.blocks)) for k in range(copies) for r in requests]
    return sorted(out, key=lambda r: r.arrival)


class Runner:
    """The scale's simulations, run `jobs` at a time, each split simulated once."""

    def __init__(self, requests: list[TraceRequest], args: dict, pool: ProcessPoolExecutor | None):
        self.requests, self.args, self.pool = requests, args, pool
        self.results: dict[str, TraceResult] = {}

    def run(self, jobs: list[tuple[str, object, Target | None]]) -> None:
        todo = [(name, self.requests, sizing, initial, self.args) for name, sizing, initial in jobs
                if name not in self.results]
        self.results.update(self.pool.map(_run, todo) if self.pool else map(_run, todo))

    def static(self, targets: list[Target]) -> list[TraceResult]:
        names = [f"static {t.prefill}P+{t.decode}D" for t in targets]
        self.run([(name, t, None) for name, t in zip(names, targets)])
        return [self.results[name] for name in names]


def search_static(runner: Runner, max_m: int, max_n: int, goal: float = GOAL) -> Target | None:
    """The cheapest fixed split reaching `goal`, searched wide: the fewest decode instances N that reach it with
    `max_m` prefill instances, then for N and N + 1 the fewest prefill instances M that do (bisection: attainment
    rises with M). None when even max_m + max_n cannot."""
    n = next((n for n in range(1, max_n + 1) if runner.static([Target(max_m, n)])[0].attainment >= goal), None)
    if n is None:
        return None
    best = []
    spans = {d: [0, max_m] for d in (n, n + 1) if d <= max_n}  # attainment < goal at lo (0: none), >= goal at hi
    while any(hi - lo > 1 for lo, hi in spans.values()):
        asked = {d: (lo + hi) // 2 for d, (lo, hi) in spans.items() if hi - lo > 1}
        for (d, m), r in zip(asked.items(), runner.static([Target(m, d) for d, m in asked.items()]), strict=True):
            spans[d][1 if r.attainment >= goal else 0] = m  # hi when it reaches the goal, lo when short of it
    for d, (lo, hi) in spans.items():
        runner.static([Target(hi, d)] + ([Target(lo, d)] if lo else []))
        best.append((hi + d, Target(hi, d)))
    return min(best, key=lambda x: (x[0], x[1].decode))[1]


def swing(requests: list[TraceRequest], depth: float, seed: int = 0) -> list[TraceRequest]:
    """The trace with a day's shape compressed into its hour: each request kept with probability
    1 - depth·(1 + cos(2πt / hour)) / 2 (the full rate at the hour's ends, 1 - depth of it in the middle), so
    the load falls and rises again as traffic does over a day. depth 0: the trace as recorded."""
    if depth <= 0:
        return requests
    rng, hour = random.Random(seed), max(r.arrival for r in requests) + 1e-3
    return [r for r in requests if rng.random() < 1 - depth * (1 - math.cos(2 * math.pi * r.arrival / hour)) / 2]


def replay_scale(trace: list[TraceRequest], scale: int, a: argparse.Namespace, pool) -> dict:
    """One scale: the fixed-split search and the autoscalers (their bounds the search's), printed as a table."""
    requests = swing(scale_trace(trace, scale), a.swing)
    max_m = a.max_m or 4 * scale + 2
    max_n = a.max_n or max(2, scale // 4 + 2)
    args = sim_args(scale, max_m, max_n, a.ttft_s, a.tpot_ms / 1e3, a.min_m, a.startup_s, a.global_cache)
    t0 = time.perf_counter()
    runner = Runner(requests, args, pool)
    cheapest = search_static(runner, max_m, max_n, a.goal)
    warm = _warm_start(requests, args)
    runner.run([(name, name, warm) for name in AUTOSCALERS])
    wall = time.perf_counter() - t0
    base = runner.results[f"static {cheapest.prefill}P+{cheapest.decode}D"] if cheapest else None
    bound = hindsight(runner, cheapest, a.goal, base.end_s) if cheapest else None
    print(f"\n--- scale {scale}: {len(requests):,} requests; fixed splits searched within M <= {max_m}, N <= {max_n}; "
          f"autoscalers within M {a.min_m}:{max_m}, N 1:{max_n} ({wall:.0f} s wall)")
    headers = ["config", "instance-hours", "vs cheapest", "attainment %", "TTFT p90 s", "TPOT p90 ms", "refused %",
               "changes / h", "booting inst-s", "prefix hit %", "sizes (M P + N D)"]
    rows = []
    for name, r in sorted(runner.results.items(), key=lambda kv: (kv[0] in AUTOSCALERS, kv[1].instance_hours)):
        seen = sorted({(m, n) for _, m, n in r.sizes})
        rows.append([name + (f" (cheapest >= {a.goal:.0%})" if r is base else ""), f"{r.instance_hours:.2f}",
                     f"{r.instance_hours / base.instance_hours:.2f}x" if base else "-", round(100 * r.attainment, 1),
                     round(r.quantile("ttft", 0.9), 2), round(1e3 * r.quantile("tpot", 0.9), 1),
                     round(100 * r.rejected / max(1, len(r.met)), 1), round(r.changes_per_hour, 1),
                     round(3600 * r.booting_hours), round(100 * r.cache_hit_rate, 1),
                     " ".join(f"{m}+{n}" for m, n in seen) if len(seen) <= 6 else
                     f"{min(seen)[0]}..{max(seen)[0]} P, {min(n for _, n in seen)}..{max(n for _, n in seen)} D"])
    if bound is not None:
        rows.append([f"hindsight, per {HINDSIGHT_S / 60:.0f} min (reference)", f"{bound[0]:.2f}",
                     f"{bound[0] / base.instance_hours:.2f}x", round(100 * bound[1], 1), *["-"] * 7])
    print(table(headers, rows))
    return {"scale": scale, "hindsight": bound, "cheapest": [cheapest.prefill, cheapest.decode] if cheapest else None,
            "rows": [dict(zip(headers, row)) for row in rows],
            "points": {k: [v.instance_hours, v.attainment] for k, v in runner.results.items()},
            "series": {k: runner.results[k].series for k in AUTOSCALERS},
            "sizes": {k: runner.results[k].sizes for k in AUTOSCALERS}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--minutes", type=float, default=None, help="replay only the first MINUTES of the trace")
    ap.add_argument("--scales", default="1", help="comma-separated copies of the trace superposed (scale_trace)")
    ap.add_argument("--goal", type=float, default=GOAL, help="the attainment the cheapest fixed split must reach")
    ap.add_argument("--ttft-s", type=float, default=5.0)
    ap.add_argument("--tpot-ms", type=float, default=50.0)
    ap.add_argument("--min-m", type=int, default=1, help="autoscaler bound: fewest prefill instances")
    ap.add_argument("--max-m", type=int, default=None, help="search and autoscaler bound (default 4 x scale + 2)")
    ap.add_argument("--max-n", type=int, default=None, help="search and autoscaler bound (default scale / 4 + 2)")
    ap.add_argument("--startup-s", type=float, default=60.0, help="seconds from asking for an instance to serving")
    ap.add_argument("--swing", type=float, default=0.0, help="a day's shape in the hour: thin the middle of the hour "
                    "to 1 - SWING of its rate (see `swing`; 0: the trace as recorded)")
    ap.add_argument("--global-cache", action="store_true", help="one unlimited prefix cache pool instead of HBM")
    ap.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    a = ap.parse_args(argv)
    if not Path(a.trace).is_file():
        ap.error(f"--trace {a.trace}: no such file (the repository ships it at {TRACE.relative_to(ROOT)}; "
                 f"it is {TRACE_SOURCE})")
    trace = load_trace(a.trace, minutes=a.minutes)
    perf = deepseek_v3_h800()
    span = trace[-1].arrival - trace[0].arrival if trace else 0.0
    print(f"trace: {len(trace)} requests over {span / 60:.1f} min, mean prompt "
          f"{sum(r.prompt_tokens for r in trace) / max(1, len(trace)):,.0f} tokens, mean output "
          f"{sum(r.output_tokens for r in trace) / max(1, len(trace)):,.0f}")
    print(f"model (one 8×H800 node): prefill {perf.prefill_per_token_s * 1e6:.1f} µs/token + "
          f"{perf.prefill_per_token2_s * 1e9:.2f} ns/token²; decode step {perf.decode_base_s * 1e3:.1f} ms + "
          f"{perf.decode_per_seq_s * 1e6:.1f} µs/request + {perf.decode_per_context_token_s * 1e9:.2f} ns/context "
          f"token; transfer {perf.kv_bytes_per_token / perf.transfer_bytes_per_s * 1e6:.2f} µs/token; prefix cache "
          f"{'unlimited' if a.global_cache else f'{int(PREFILL_KV_BYTES / KV_BYTES / BLOCK_TOKENS):,} blocks'} "
          f"per prefill instance")
    print(f"SLA: TTFT <= {a.ttft_s:g} s and TPOT <= {a.tpot_ms:g} ms per request; instances boot in "
          f"{a.startup_s:g} s; autoscalers start where the first minute's load puts them")
    scales = [int(x) for x in a.scales.split(",")]
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else _no_pool() as pool:
        out = [replay_scale(trace, scale, a, pool) for scale in scales]
    for o in out:
        r = {row["config"].split(" (")[0]: row for row in o["rows"]}
        autos = "; ".join(f"{k.removeprefix('autoscaler, ')}: {r[k]['vs cheapest']} at {r[k]['attainment %']} %, "
                          f"{r[k]['changes / h']} changes/h" for k in AUTOSCALERS)
        split = "{}P+{}D".format(*o["cheapest"]) if o["cheapest"] else "none in the bounds"
        print(f"scale {o['scale']}: cheapest fixed split >= {a.goal:.0%}: {split}; {autos}")
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "trace_replay" + ("" if scales == [1] else "_x" + "_".join(map(str, scales))) + \
        (f"_swing{a.swing:g}" if a.swing else "")
    (OUT / f"{stem}.json").write_text(json.dumps({"args": vars(a), "scales": out}, indent=1, default=str) + "\n")
    _plot(OUT / f"{stem}.png", out, a)
    print(f"plot: {OUT / f'{stem}.png'}")


class _no_pool:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _plot(path: _Path, scales: list[dict], a: argparse.Namespace) -> None:
    """Per scale, attainment against instance-hours (fixed splits, the autoscalers); then the planning-ahead
    autoscaler's hour at the largest scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scales) + 1, figsize=(6 * (len(scales) + 1), 5))
    for ax, o in zip(axes, scales, strict=False):
        static = [(h, att, k) for k, (h, att) in o["points"].items() if k not in AUTOSCALERS]
        ax.scatter([p[0] for p in static], [100 * p[1] for p in static], color="grey", label="fixed splits", zorder=3)
        for h, att, k in static:
            ax.annotate(k.split()[1], (h, 100 * att), textcoords="offset points", xytext=(4, -10), fontsize=7)
        for name, color in zip(AUTOSCALERS, ("red", "darkorange", "purple", "green"), strict=False):
            h, att = o["points"][name]
            ax.scatter([h], [100 * att], marker="*", s=220, color=color, zorder=4, label=name)
        ax.axhline(100 * a.goal, color="grey", linewidth=0.8, linestyle="--")
        tops = [100 * att for _, att, _ in static if att >= 0.85] + [100 * o["points"][k][1] for k in AUTOSCALERS]
        ax.set_ylim(max(0.0, min(tops) - 1.5), min(100.0, max(tops) + 1.0))
        ax.set_xlabel("instance-hours (8×H800 nodes × hours)")
        ax.set_ylabel(f"SLA attainment % (TTFT ≤ {a.ttft_s:g} s, TPOT ≤ {a.tpot_ms:g} ms)")
        ax.set_title(f"Mooncake conversation trace × {o['scale']}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    bx = axes[-1]
    name, o = "autoscaler, planning ahead", scales[-1]
    series = o["series"][name]
    minutes = [s[0] / 60 for s in series]
    bx.plot(minutes, [s[1] for s in series], color="black", label="arrivals / s")
    bx.step(minutes, [s[2] for s in series], where="post", label="M (prefill, mean)")
    bx.step(minutes, [s[3] for s in series], where="post", label="N (decode, mean)")
    bx.set_xlabel("minute")
    bx.set_ylabel("requests / s, instances")
    bx.set_ylim(bottom=0)
    cx = bx.twinx()
    cx.plot(minutes, [100 * s[4] if not math.isnan(s[4]) else None for s in series], color="red", linestyle=":",
            label="attainment % (right)")
    cx.set_ylim(0, 105)
    lines, more = bx.get_legend_handles_labels(), cx.get_legend_handles_labels()
    bx.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    bx.set_title(f"{name}, scale {o['scale']}: load and pools over the hour", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
