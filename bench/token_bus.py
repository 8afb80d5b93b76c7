"""Token bus on vs off: the same streams through two routers, one with the decode instances' token bus (the
default) and one with `--no-token-bus`, alternating in one run.

    python bench/token_bus.py [--streams 16,64] [--rounds 4] [--prompt-len 128] [--max-tokens 128]
                              [--dtype bfloat16]

Two clusters (router + 1 prefill + 1 decode each, the tiny DeepSeek-V3 of bench/peers, both started and warm
before the first measurement; the idle one costs little) serve the same concurrent HTTP streams (bench/serving's
own client), ABBA-alternated `--rounds` times per concurrency: median output tok/s, median TPOT p50, and the CPU
ms per generated token of the router and of the decode instance (its front and engine processes, /proc). Prints
a table and saves bench/out/token_bus.png (tok/s per concurrency, bus vs per-call streams).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import OUT, bar_plot, pct, table
from bench.hostload import tree_seconds
from bench.peers import VLLM_CONFIG, stream_completion
from bench.serving import run_streams
from router.cluster import Cluster
from shared.loader.tiny import write_checkpoint

MODES = {"token bus": [], "per-call streams": ["--no-token-bus"]}


def measure(cluster: Cluster, served: str, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """One run of all prompts at once over the HTTP API: tok/s, TPOT p50 (ms), CPU ms per token by process."""
    host, _, port = cluster.http_address.rpartition(":")
    pids = {"router": cluster.process(cluster.address).pid, "decode": cluster.process(cluster.decode_addrs[0]).pid}
    before = {k: tree_seconds(v) for k, v in pids.items()}
    res = run_streams(lambda p, n: stream_completion(host, int(port), served, p, n), prompts, max_tokens)
    cpu = {f"{k} CPU": (tree_seconds(v) - before[k]) / res["tokens"] * 1e3 for k, v in pids.items()}
    return {"tok/s": res["tok/s"], "TPOT": pct(res["tpot"], 0.5) * 1e3, **cpu}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="16,64")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.streams.split(",")]
    model = str(write_checkpoint(Path(tempfile.mkdtemp()) / "v3", "deepseek_v3", **VLLM_CONFIG))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 1000, (max(levels), args.prompt_len), generator=g).tolist()
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    clusters = {mode: Cluster(model, dtype=args.dtype, extra_router=["--http-port", "0", *flags],
                              extra_decode=["--max-num-seqs", str(max(levels))]) for mode, flags in MODES.items()}
    try:
        for c in clusters.values():
            c.start()
            measure(c, Path(model).name, prompts[:2], 4)  # warm, and the bus opened
        for n in levels:
            for r in range(args.rounds):
                for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    print(f"{n} streams, round {r + 1}/{args.rounds}: {mode} ...", flush=True)
                    runs.setdefault((n, mode), []).append(measure(clusters[mode], Path(model).name, prompts[:n],
                                                                  args.max_tokens))
    finally:
        for c in clusters.values():
            c.stop()
    keys = ["tok/s", "TPOT", "router CPU", "decode CPU"]
    med = {k: {key: statistics.median(x[key] for x in v) for key in keys} for k, v in runs.items()}
    print(f"\n{args.prompt_len} → {args.max_tokens} tokens, {args.dtype}, {args.rounds} alternating rounds; medians")
    print(table(["streams", "path", "tok/s", "TPOT p50 ms", "router CPU ms / token", "decode CPU ms / token",
                 "tok/s / per-call"],
                [[n, mode, f"{m['tok/s']:,.0f}", f"{m['TPOT']:.1f}", f"{m['router CPU']:.3f}", f"{m['decode CPU']:.3f}",
                  f"{m['tok/s'] / med[(n, 'per-call streams')]['tok/s']:.2f}x"] for (n, mode), m in med.items()]))
    plot = bar_plot(OUT / "token_bus.png", "Served tok/s, token bus vs per-call streams",
                    [f"{n} streams" for n in levels],
                    {mode: [med[(n, mode)]["tok/s"] for n in levels] for mode in MODES}, "output tok/s")
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
