"""KV reuse across the fleet, measured with a real client: AIPerf (bench/peers/aiperf.py, its own venv) replays a
window of the Mooncake conversation trace (bench/data/mooncake-fast25) against `pdserve up` once per
configuration, all in one run, and the services' Prometheus /metrics are read before and after each replay.

    python bench/kv_reuse.py [--start-s 0] [--duration-s 60] [--speed 2.5] [--isl-block-size 16]
                             [--num-prefill 2] [--num-decode 2] [--configs no-prefix-cache,prefix-cache,...]
                             [--max-output-tokens N] [--share-only]

The window: the trace's requests arriving in [start, start + duration) of trace time, replayed at `speed`×
(timestamps divided by it). The trace hashes prompts in blocks of 512 tokens; prompts are scaled so that one
hash id is `--isl-block-size` tokens (16: the demo model's 1,024-token context holds the scaled prompts), and
AIPerf builds each prompt from its hash ids at that size (equal ids, equal tokens). Requests whose scaled prompt
does not fit the model's context are left out; output lengths are cut to fit it (and to --max-output-tokens).

The bound: the *unbounded single-cache share*, the fraction of the window's prompt tokens that lie in full blocks
whose hash id an earlier request (in order of arrival) already had in a full block: what one cache that never
evicts would serve, the best any cache can do. Configurations (each a fresh `pdserve up`): no-prefix-cache,
prefix-cache (the default), no-fetch (`--no-kv-fetch`: no cross-instance fetch), small-pool (`--kv-cache-tokens`
at a quarter of the window's working set: its distinct full blocks), small-pool+tier (the same plus
`--kv-tier-tokens`, the whole working set). One whose
flags `pdserve up --help` does not list is reported as skipped.

Prints a table (AIPerf's TTFT p50/p90, TPOT p50, requests and failures; from /metrics the cache share, by tier,
KV bytes pushed per request, decode's blocks pushed vs reused) and the goals it checks, and saves
bench/out/kv_reuse.json and kv_reuse.png. Metrics a running build does not export yet read n/a.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import OUT, table  # noqa: E402
from bench.peers.aiperf import AiperfSummary, run_aiperf  # noqa: E402

TRACE = ROOT / "bench" / "data" / "mooncake-fast25" / "conversation_trace.jsonl"
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
CONFIGS = ("no-prefix-cache", "prefix-cache", "no-fetch", "small-pool", "small-pool+tier")
TIERS = ("device", "host")


@dataclass(frozen=True)
class TraceRequest:
    """One trace line: arrival (ms), token counts, prefix-block hash ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Window:
    """The requests chosen for one replay, scaled to `block_size` tokens per hash id and rebased to 0."""

    requests: tuple[TraceRequest, ...]
    block_size: int
    dropped: int  # prompts that do not fit the context even scaled

    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def load_trace(path: Path) -> list[TraceRequest]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(TraceRequest(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                    tuple(int(h) for h in d.get("hash_ids", ()))))
    return out


def select_window(trace: list[TraceRequest], start_s: float, duration_s: float, speed: float, block_size: int,
                  context: int, max_output: int | None = None, trace_block: int = TRACE_BLOCK) -> Window:
    """The requests arriving in [start, start + duration) of trace time, in order of arrival, timestamps from 0 at
    `speed`×, prompts scaled by block_size / trace_block (rounded up, so the last hash id stays a partial or full
    block as in the trace), outputs cut so prompt + output fit `context`. A prompt of `context` tokens or more is
    dropped."""
    if speed <= 0 or block_size <= 0 or duration_s <= 0:
        raise ValueError("speed, block size and duration must be positive")
    lo, hi = start_s * 1000, (start_s + duration_s) * 1000
    chosen, dropped = [], 0
    for r in sorted((r for r in trace if lo <= r.timestamp_ms < hi), key=lambda r: r.timestamp_ms):
        isl = max(1, math.ceil(r.input_length * block_size / trace_block))
        if isl >= context:
            dropped += 1
            continue
        osl = min(r.output_length, context - isl, max_output or r.output_length)
        chosen.append(TraceRequest(round((r.timestamp_ms - lo) / speed, 3), isl, max(1, osl), r.hash_ids))
    return Window(tuple(chosen), block_size, dropped)


def _full_ids(r: TraceRequest, block_size: int) -> tuple[int, ...]:
    return r.hash_ids[: r.input_length // block_size]


def unbounded_share(window: Window) -> float:
    """Share of prompt tokens in full blocks whose hash id an earlier request held in a full block."""
    seen: set[int] = set()
    cached = 0
    for r in window.requests:
        full = _full_ids(r, window.block_size)
        cached += sum(h in seen for h in full) * window.block_size
        seen.update(full)
    total = window.prompt_tokens()
    return cached / total if total else 0.0


def working_set_tokens(window: Window) -> int:
    """Tokens in the window's distinct full blocks: what a cache holding everything reusable needs."""
    return len({h for r in window.requests for h in _full_ids(r, window.block_size)}) * window.block_size


def write_window(window: Window, path: Path) -> Path:
    """The window as a Mooncake-format trace for AIPerf's mooncake_trace loader (timestamps in ms)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                            for r in window.requests))
    return path


# --- Prometheus text ---------------------------------------------------------------------------------------

@dataclass
class Scrape:
    """One service's /metrics: samples by (name, sorted labels)."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> Scrape:
    """Prometheus text exposition → Scrape (comments and unparsable lines are skipped)."""
    scrape = Scrape()
    for line in text.splitlines():
        if line and not line.startswith("#") and (m := _SAMPLE.match(line)):
            try:
                value = float(m.group(3))
            except ValueError:
                continue
            labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
            scrape.samples[(m.group(1), labels)] = value
    return scrape


def metric_delta(before: list[Scrape], after: list[Scrape], name: str, **labels: str) -> float | None:
    """Sum over services of after − before for the samples of `name` carrying `labels`; None (n/a) when no
    service exports such a sample (a build without the metric, or one that never counted it: a labelled
    counter shows no sample before its first increment)."""
    want = set(labels.items())
    if not any(n == name and want <= set(ls) for s in after for n, ls in s.samples):
        return None

    def total(scrapes: list[Scrape]) -> float:
        return sum(v for s in scrapes for (n, ls), v in s.samples.items() if n == name and want <= set(ls))

    return total(after) - total(before)


# --- configurations and runs -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    name: str
    up_args: tuple[str, ...]


def configs(names: list[str], kv_tokens: int, tier_tokens: int) -> list[Config]:
    table_ = {"no-prefix-cache": ("--no-prefix-cache",), "prefix-cache": (), "no-fetch": ("--no-kv-fetch",),
              "small-pool": ("--kv-cache-tokens", str(kv_tokens)),
              "small-pool+tier": ("--kv-cache-tokens", str(kv_tokens), "--kv-tier-tokens", str(tier_tokens))}
    unknown = set(names) - set(table_)
    if unknown:
        raise ValueError(f"--configs: unknown {sorted(unknown)} (known: {', '.join(CONFIGS)})")
    return [Config(n, table_[n]) for n in names]


def missing_flags(config: Config, help_text: str) -> list[str]:
    """The config's flags that `pdserve up --help` does not list."""
    return [a for a in config.up_args if a.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])",
                                                                              help_text)]


def up_help() -> str:
    """`pdserve up --help` of the build the runs start (as bench/fleet_faults.UpProcess starts it)."""
    exe = Path(sys.executable).with_name("pdserve")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "router.cli"]
    return subprocess.run([*cmd, "up", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout


@dataclass
class Row:
    """One configuration's results (None: n/a)."""

    config: str
    skipped: str = ""  # why it did not run (skipped: a flag missing; failed: see its logs)
    requests: int | None = None
    errors: int | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    tpot_p50_ms: float | None = None
    client_cache_pct: float | None = None
    prompt_tokens: float | None = None
    cache_share: float | None = None  # router: cached prompt tokens / prompt tokens
    tier_share: dict[str, float | None] = field(default_factory=dict)  # prefill's hits by tier / prompt tokens
    decode_reuse_share: float | None = None  # decode's hits (not pushed) / prompt tokens
    push_bytes_per_request: float | None = None
    blocks_pushed: float | None = None
    blocks_reused: float | None = None
    follow_up_fewer: float | None = None  # follow-ups whose context decode kept: all their blocks / those pushed


def scrape_all(urls: dict[str, str]) -> list[Scrape]:
    return [parse_metrics(urllib.request.urlopen(u, timeout=10).read().decode()) for u in urls.values()]


def fill_metrics(row: Row, before: list[Scrape], after: list[Scrape]) -> None:
    """The /metrics side of a row (deltas over the replay)."""
    prompt = metric_delta(before, after, "pdserve_tokens_total", service="router", kind="prompt")
    cached = metric_delta(before, after, "pdserve_tokens_total", service="router", kind="cached_prompt")
    row.prompt_tokens = prompt

    def share(x: float | None) -> float | None:
        return x / prompt if x is not None and prompt else None

    row.cache_share = share(cached)
    row.tier_share = {t: share(metric_delta(before, after, "pdserve_prefix_cache_hit_tokens_total",
                                            service="prefill", tier=t)) for t in TIERS}
    row.decode_reuse_share = share(metric_delta(before, after, "pdserve_prefix_cache_hit_tokens_total",
                                                service="decode"))
    pushed = metric_delta(before, after, "pdserve_kv_push_bytes_total")
    row.push_bytes_per_request = pushed / row.requests if pushed is not None and row.requests else None
    row.blocks_pushed = metric_delta(before, after, "pdserve_decode_kv_blocks_total", source="pushed")
    row.blocks_reused = metric_delta(before, after, "pdserve_decode_kv_blocks_total", source="reused")
    fu_pushed, fu_reused = (metric_delta(before, after, "pdserve_decode_follow_up_kv_blocks_total", source=s)
                            for s in ("pushed", "reused"))
    if fu_pushed and fu_reused is not None:
        row.follow_up_fewer = (fu_pushed + fu_reused) / fu_pushed


def run_config(config: Config, args: argparse.Namespace, window_file: Path, log_dir: Path,
               timeout_s: float, schedule_s: float) -> Row:
    """One fresh `pdserve up` with the config's flags, one AIPerf replay of the window against it."""
    from bench.fleet_faults import UpProcess
    up = UpProcess(["--model", args.model, "--num-prefill", str(args.num_prefill), "--num-decode",
                    str(args.num_decode), "--port", "0", "--http-port", "0", *config.up_args, *args.up_arg],
                   log_dir / config.name)
    row = Row(config.name)
    try:
        up.start()
        before = scrape_all(up.metrics)
        summary: AiperfSummary = run_aiperf(up.http_url.removesuffix("/v1"), up.model, Path(args.model),
                                            window_file, args.isl_block_size, log_dir / config.name / "aiperf",
                                            timeout_s, schedule_s=schedule_s, seed=args.seed)
        time.sleep(1)  # the last pushes' counters
        after = scrape_all(up.metrics)
    finally:
        up.stop()
    row.requests, row.errors = summary.requests, summary.errors
    row.ttft_p50_ms, row.ttft_p90_ms, row.tpot_p50_ms = summary.ttft_p50_ms, summary.ttft_p90_ms, summary.tpot_p50_ms
    row.client_cache_pct = summary.client_cache_pct
    fill_metrics(row, before, after)
    return row


# --- report ------------------------------------------------------------------------------------------------

def _f(v: float | None, spec: str = ",.1f", scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, spec)


def report_table(rows: list[Row], unbounded: float) -> str:
    headers = ["config", "requests", "failed", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "cache %",
               "of unbounded", *(f"{t} %" for t in TIERS), "decode reuse %", "KV pushed / req",
               "blocks pushed", "blocks reused", "follow-up push fewer"]
    out = []
    for r in rows:
        if r.skipped:
            out.append([r.config, r.skipped, *[""] * (len(headers) - 2)])
            continue
        of = r.cache_share / unbounded if r.cache_share is not None and unbounded else None
        out.append([r.config, _f(r.requests, ",.0f"), _f(r.errors, ",.0f"), _f(r.ttft_p50_ms), _f(r.ttft_p90_ms),
                    _f(r.tpot_p50_ms), _f(r.cache_share, ".1f", 100), _f(of, ".2f"),
                    *(_f(r.tier_share.get(t), ".1f", 100) for t in TIERS), _f(r.decode_reuse_share, ".1f", 100),
                    "n/a" if r.push_bytes_per_request is None else f"{r.push_bytes_per_request / 1024:,.0f} KiB",
                    _f(r.blocks_pushed, ",.0f"), _f(r.blocks_reused, ",.0f"), _f(r.follow_up_fewer, ".1f")])
    return table(headers, out)


@dataclass(frozen=True)
class Goal:
    what: str
    value: float | None
    target: float

    def line(self) -> str:
        verdict = "n/a" if self.value is None else "met" if self.value >= self.target else "NOT met"
        return f"- {self.what}: {_f(self.value, '.2f')} (goal >= {self.target:g}): {verdict}"


def goals(rows: list[Row], unbounded: float) -> list[Goal]:
    """The issue's goals, each a ratio from this run's rows (n/a where a row or metric is missing)."""
    by = {r.config: r for r in rows if not r.skipped}

    def get(config: str, attr: str) -> float | None:
        return getattr(by[config], attr) if config in by else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return [Goal("prefix-cache share / unbounded share", ratio(get("prefix-cache", "cache_share"), unbounded), 0.95),
            Goal("TTFT p90 no-prefix-cache / prefix-cache",
                 ratio(get("no-prefix-cache", "ttft_p90_ms"), get("prefix-cache", "ttft_p90_ms")), 2.0),
            Goal("KV pushed per follow-up turn whose context decode holds: today (every block) / prefix-cache",
                 get("prefix-cache", "follow_up_fewer"), 5.0),
            Goal("small-pool+tier share / unbounded share",
                 ratio(get("small-pool+tier", "cache_share"), unbounded), 0.8)]


def plot(path: Path, rows: list[Row], unbounded: float, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if not r.skipped]
    names = [r.config for r in ran]
    xs = range(len(ran))

    def z(v: float | None, k: float = 1.0) -> float:
        return 0.0 if v is None else v * k

    fig, ((ax, bx), (cx, dx)) = plt.subplots(2, 2, figsize=(12, 8))
    ax.bar([x - 0.2 for x in xs], [z(r.ttft_p50_ms) for r in ran], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [z(r.ttft_p90_ms) for r in ran], 0.4, label="p90")
    ax.set_title("TTFT (AIPerf)"), ax.set_ylabel("ms"), ax.legend()
    bx.bar(xs, [z(r.tpot_p50_ms) for r in ran], 0.5)
    bx.set_title("TPOT p50 (AIPerf)"), bx.set_ylabel("ms")
    bottom = [0.0] * len(ran)
    for tier in TIERS:  # prefill's hits by tier; the router's total where tiers are not exported
        vals = [z(r.tier_share.get(tier), 100) for r in ran]
        cx.bar(xs, vals, 0.5, bottom=bottom, label=f"{tier} tier")
        bottom = [b + v for b, v in zip(bottom, vals)]
    cx.plot(xs, [z(r.cache_share, 100) for r in ran], "k_", markersize=40, mew=3, label="router: cached")
    cx.axhline(100 * unbounded, color="red", linestyle=":", label="unbounded single cache")
    cx.set_title("prompt tokens from cache"), cx.set_ylabel("%"), cx.legend(fontsize=8, markerscale=0.3)
    dx.bar(xs, [z(r.push_bytes_per_request, 1 / 1024) for r in ran], 0.5)
    dx.set_title("KV bytes pushed per request"), dx.set_ylabel("KiB")
    for axis in (ax, bx, cx, dx):
        axis.set_xticks(list(xs), names, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--start-s", type=float, default=0.0, help="window start, trace seconds")
    p.add_argument("--duration-s", type=float, default=60.0, help="window length, trace seconds")
    p.add_argument("--speed", type=float, default=2.5, help="replay speed factor")
    p.add_argument("--isl-block-size", type=int, default=16, help="prompt tokens per trace hash id (trace: 512)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cut outputs to this (default: the trace's)")
    p.add_argument("--model", default="models/demo-v32")
    p.add_argument("--num-prefill", type=int, default=2)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--small-pool-fraction", type=float, default=0.25, help="small-pool: of the working set")
    p.add_argument("--tier-tokens", type=int, default=None, help="small-pool+tier: default the working set")
    p.add_argument("--up-arg", action="append", default=[], help="one more `pdserve up` argument (repeatable)")
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--share-only", action="store_true", help="print the window and its unbounded share; no runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    context = int(json.loads((Path(args.model) / "config.json").read_text()).get("max_position_embeddings", 4096))
    window = select_window(load_trace(Path(args.trace)), args.start_s, args.duration_s, args.speed,
                           args.isl_block_size, context, args.max_output_tokens)
    unbounded, working = unbounded_share(window), working_set_tokens(window)
    biggest = max((r.input_length + r.output_length for r in window.requests), default=0)
    kv_tokens = max(int(working * args.small_pool_fraction), 2 * biggest)
    kv_tokens = -(-kv_tokens // args.isl_block_size) * args.isl_block_size
    tier_tokens = args.tier_tokens or working
    print(f"window: {len(window.requests)} requests ({window.dropped} longer than the {context}-token context left "
          f"out), trace {args.start_s:g}-{args.start_s + args.duration_s:g} s at {args.speed:g}x, "
          f"{window.prompt_tokens():,} prompt tokens at {args.isl_block_size} per hash id; working set "
          f"{working:,} tokens; unbounded single-cache share {100 * unbounded:.1f} %")
    if args.share_only or not window.requests:
        return
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kv-reuse-"))
    window_file = write_window(window, log_dir / "window.jsonl")
    help_text, rows = up_help(), []
    for config in configs([c for c in args.configs.split(",") if c], kv_tokens, tier_tokens):
        if missing := missing_flags(config, help_text):
            rows.append(Row(config.name, skipped=f"skipped: pdserve up has no {' '.join(missing)}"))
        else:
            print(f"{config.name}: pdserve up {' '.join(config.up_args)} ...", flush=True)
            try:
                rows.append(run_config(config, args, window_file, log_dir, args.request_timeout_s,
                                       args.duration_s / args.speed))
            except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired) as e:  # the next one still runs
                print(f"{config.name} failed: {e}", flush=True)
                rows.append(Row(config.name, skipped=f"failed ({type(e).__name__}; logs {log_dir / config.name})"))
    print(report_table(rows, unbounded))
    print("\n".join(g.line() for g in goals(rows, unbounded)))
    stem = OUT / "kv_reuse"
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(
        {"window": {"start_s": args.start_s, "duration_s": args.duration_s, "speed": args.speed,
                    "isl_block_size": args.isl_block_size, "requests": len(window.requests),
                    "dropped": window.dropped, "prompt_tokens": window.prompt_tokens(),
                    "working_set_tokens": working, "unbounded_share": unbounded,
                    "small_pool_kv_tokens": kv_tokens, "tier_tokens": tier_tokens},
         "shape": {"num_prefill": args.num_prefill, "num_decode": args.num_decode, "model": args.model},
         "rows": [asdict(r) for r in rows], "goals": [asdict(g) for g in goals(rows, unbounded)]}, indent=1))
    title = (f"Mooncake trace {args.start_s:g}+{args.duration_s:g} s at {args.speed:g}x, "
             f"{args.num_prefill}P+{args.num_decode}D, {Path(args.model).name}")
    print(f"saved {stem}.json; plot: {plot(Path(f'{stem}.png'), rows, unbounded, title)}; logs: {log_dir}")


if __name__ == "__main__":
    main()
