"""The lightning indexer's scoring kernel: its bf16 dot products (AVX512-BF16 `vdpbf16ps`) against its
fused multiply-adds, same build, same run.

    python bench/indexer.py [--heads 16,64] [--contexts 2048,8192,32768] [--queries 4] [--keys bf16,fp8]
                            [--repeat 7] [--threads 1]

`shared.model.cpu_kernels.index_scores` scores `--queries` decode queries (one per request, each over its
own context of C keys) with H indexer heads of 128 dims: DeepSeek's numerics put queries and keys on the FP8
grid times a power of two, bf16 values whose products are exact, so a build for a CPU with AVX512-BF16 takes
`vdpbf16ps`. The same queries with one value per head moved off the bf16 grid take the kernel's fused
multiply-adds instead (the same lane order; what a CPU without the instruction runs for every query). Keys
are bf16 rows (`--kv-cache-dtype auto`) or C8's FP8 rows (`int8`). Configurations alternate, best of
`--repeat`; prints ms per call, GFLOP/s (2 · queries · C · H · 128) and the ratio, and saves
bench/out/indexer.png.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse

import torch

from bench.common import OUT, MachineLimits, bar_plot, best_seconds, kernels_used, table
from shared.kvcache.layout import Fp8KeyRows
from shared.model import cpu_kernels

DIM, BLOCK = 128, 64  # DeepSeek-V3.2's index_head_dim; the KV block size


def key_pool(kind: str, keys: int, gen: torch.Generator) -> tuple[torch.Tensor, Fp8KeyRows | None]:
    """`keys` index keys as the cache stores them: bf16 values on the FP8 grid times 2^-4, or C8's FP8 rows."""
    rows = torch.randn(keys, DIM, generator=gen)
    if kind == "fp8":
        codec = Fp8KeyRows(DIM)
        return codec.encode(rows).view(keys // BLOCK, BLOCK, -1), codec
    on_grid = rows.to(torch.float8_e4m3fn).float() * 2.0**-4
    return on_grid.to(torch.bfloat16).view(keys // BLOCK, BLOCK, DIM), None


def measure(kind: str, heads: int, context: int, n: int, repeat: int, gen: torch.Generator) -> dict[str, float]:
    """Best seconds per index_scores call for on-grid queries (bf16 dots) and off-grid ones (FMA), alternating."""
    keys = -(-context // BLOCK) * BLOCK
    pool, codec = key_pool(kind, n * keys, gen)
    tables = torch.arange(n * keys // BLOCK).view(n, -1)
    on_grid = torch.randn(n, heads, DIM, generator=gen).to(torch.float8_e4m3fn).float() * 2.0**3
    off_grid = on_grid.clone()
    off_grid[:, :, 0] = 1.1  # not a bf16: the fused multiply-adds
    weights = torch.randn(n, heads, generator=gen)
    rows_of, counts = torch.arange(n), torch.full((n,), context)

    def score(q: torch.Tensor) -> None:
        cpu_kernels.index_scores(q, weights, pool, codec, tables, BLOCK, rows_of, counts, context, 0.088)

    best = {"bf16 dots": float("inf"), "FMA": float("inf")}
    order = [("bf16 dots", on_grid), ("FMA", off_grid)]
    for r in range(2):  # alternate, in both orders
        for name, q in order if r == 0 else order[::-1]:
            best[name] = min(best[name], best_seconds(lambda q=q: score(q), max(1, repeat // 2)))
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="16,64", help="indexer heads (DeepSeek-V3.2: 64)")
    p.add_argument("--contexts", default="2048,8192,32768", help="keys each query scores")
    p.add_argument("--queries", type=int, default=4, help="decode queries, one per request")
    p.add_argument("--keys", default="bf16,fp8", help="key rows: bf16 (KV auto) and/or fp8 (C8)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_kernels.library() is None:
        raise SystemExit("the CPU kernels are off here (no compiler, or PDSERVE_CPU_KERNELS=0): nothing to measure")
    gen = torch.Generator().manual_seed(0)
    n = args.queries
    rows, labels = [], []
    series: dict[str, list[float]] = {"bf16 dots": [], "FMA": []}
    for kind in args.keys.split(","):
        for heads in (int(h) for h in args.heads.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                best = measure(kind, heads, context, n, args.repeat, gen)
                flop = 2.0 * n * context * heads * DIM
                short = f"{context // 1024}k" if context % 1024 == 0 else str(context)
                label = f"{kind}\nH{heads}\n{short}"  # stacked: a dozen bars' labels side by side
                labels.append(label)
                for name, s in best.items():
                    series[name].append(flop / s / 1e9)
                rows.append([kind, heads, context, best["bf16 dots"] * 1e3, flop / best["bf16 dots"] / 1e9,
                             best["FMA"] * 1e3, flop / best["FMA"] / 1e9, f"{best['FMA'] / best['bf16 dots']:.2f}x"])
                print(f"  {kind} H{heads} {context}: {rows[-1][3]:.2f} ms vs {rows[-1][5]:.2f} ms", flush=True)
    print(f"\n## Indexer scores, {n} decode queries × 128 dims, best of {args.repeat}, "
          f"{torch.get_num_threads()} thread(s)")
    print(table(["keys", "heads", "context", "bf16 dots ms", "GFLOP/s", "FMA ms", "GFLOP/s", "speedup"], rows))
    print(MachineLimits.measure().describe())
    print(kernels_used())
    if not cpu_kernels.bf16_dots():
        print("(this build has no vdpbf16ps: both columns are the fused multiply-adds)")
    png = bar_plot(OUT / "indexer.png", "indexer scores: bf16 dots vs FMA", labels, series, "GFLOP/s")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
