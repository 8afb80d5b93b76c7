"""Decode attention and whole runs by KV block size: why `--block-size` defaults to 64.

    python bench/block_size.py [--sizes 16,32,64,128] [--batch 256] [--context 192] [--threads 1]
                               [--engine-rounds 6] [--prompt-len 128] [--new-tokens 128] [--label NAME]

Part 1, the kernel: batch-`--batch` decode attention (the tiny model's 4 heads, bf16 MLA rows of 576 values) over
four layers' pools laid out in `--sizes`-token blocks, each call a different layer's pool so the rows come from
memory. Per block size, the blocks of every context in order (a fresh pool), scattered over the pool (what a
long-running pool hands out once requests have given their blocks back in their own order), and the same call
over one context's rows (in cache: the arithmetic alone). Cycles a row at the machine's nominal 3 GHz.

Part 2, the engine (`--engine-rounds` > 0): the tiny model (engine_throughput's checkpoint) in one process per
block size, batch `--batch`, fresh `--prompt-len`-token prompts → `--new-tokens` a round, the sizes alternating;
tok/s per round and the median (the first round runs on a fresh pool, the rest on the order the rounds before
left). vLLM's CPU MLA backend runs 16-token blocks only, so it is no peer here.

Prints both tables; saves bench/out/block_size[-LABEL].png."""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import OUT, bar_plot, table

HEADS, DIM, OUT_DIM, LAYERS, NOMINAL_HZ = 4, 576, 512, 4, 3e9


def attention_ms(batch: int, context: int, block: int, scattered: bool, reps: int = 10) -> tuple[float, float]:
    """(out of cache, in cache): median ms of four layers' decode attention calls."""
    from shared.device import zeros_on_huge_pages
    from shared.model import cpu_kernels

    per = -(-context // block)
    blocks = batch * per * LAYERS
    pool = zeros_on_huge_pages((blocks, block, DIM), torch.bfloat16, torch.device("cpu"))
    pool.copy_(torch.randn(blocks, block, DIM) * 0.5)
    order = torch.randperm(blocks) if scattered else torch.arange(blocks)
    tables = [order[torch.arange(batch * per).view(batch, per) + layer * batch * per] for layer in range(LAYERS)]
    query = (torch.randn(batch, HEADS, DIM) * 0.1).bfloat16().float()
    counts = torch.full((batch,), context)

    def median_ms(rows: torch.Tensor) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for layer in range(LAYERS):
                cpu_kernels.paged_mqa(query, pool, tables[layer], block, rows, counts, 0.1, OUT_DIM)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    median_ms(torch.arange(batch))  # warm: the kernels built, the pool's pages touched
    return median_ms(torch.arange(batch)), median_ms(torch.zeros(batch, dtype=torch.long))


def engine_rounds(sizes: list[int], batch: int, rounds: int, prompt_len: int, new_tokens: int
                  ) -> dict[int, list[float]]:
    """tok/s of whole runs (fresh prompts each round, the same for every size) per block size."""
    from bench.engine_throughput import run_pdserve
    from bench.peers import VLLM_CONFIG
    from shared.engine import LLM
    from shared.loader.tiny import write_checkpoint

    results: dict[int, list[float]] = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "model", "deepseek_v3", tokenizer=False, **VLLM_CONFIG)
        llms = {size: LLM(str(path), dtype="bfloat16", max_num_seqs=batch, block_size=size) for size in sizes}
        for r in range(rounds):
            prompts = [torch.randint(2, 1000, (prompt_len,)).tolist() for _ in range(batch)]
            for size in sizes if r % 2 == 0 else sizes[::-1]:
                results[size].append(run_pdserve(llms[size], prompts, new_tokens))
                print(f"round {r + 1}: block size {size}: {results[size][-1]:,.0f} tok/s", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,32,64,128")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--threads", type=int, default=1, help="kernel part's threads (the engine's: all)")
    ap.add_argument("--engine-rounds", type=int, default=6, help="0: the kernel part only")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    from shared.model import cpu_kernels

    if cpu_kernels.library() is None:
        _sys.exit("the CPU kernels are not built here (no C compiler?): nothing to measure")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows = args.batch * args.context * LAYERS
    cycles = lambda ms: ms * 1e-3 * NOMINAL_HZ * args.threads / rows  # noqa: E731
    kernel_rows, series = [], {"in order": [], "scattered": [], "in cache": []}
    for size in sizes:
        in_order, hot = attention_ms(args.batch, args.context, size, scattered=False)
        scattered, _ = attention_ms(args.batch, args.context, size, scattered=True)
        kernel_rows.append([size, in_order, scattered, hot, cycles(in_order), cycles(scattered), cycles(hot)])
        for name, ms in (("in order", in_order), ("scattered", scattered), ("in cache", hot)):
            series[name].append(cycles(ms))
        print(f"block size {size}: done", flush=True)
    torch.set_num_threads(threads)
    print(f"\nbatch-{args.batch} decode attention, {HEADS} heads, {args.context} positions, {LAYERS} layers' pools, "
          f"{args.threads} thread(s): ms per four calls and cycles a row at 3 GHz")
    print(table(["block size", "in order ms", "scattered ms", "in cache ms", "in order cyc/row",
                 "scattered cyc/row", "in cache cyc/row"], kernel_rows))
    if args.engine_rounds > 0:
        runs = engine_rounds(sizes, args.batch, args.engine_rounds, args.prompt_len, args.new_tokens)
        print(f"\ntiny model, batch {args.batch}, {args.prompt_len} → {args.new_tokens} tokens, "
              f"{args.engine_rounds} alternating rounds")
        base = statistics.median(runs[sizes[0]])
        print(table(["block size", "median tok/s", "rounds", f"vs {sizes[0]}"],
                    [[s, statistics.median(v), " / ".join(f"{x:,.0f}" for x in v),
                      f"{statistics.median(v) / base:.3f}x"] for s, v in runs.items()]))
    path = OUT / f"block_size{'-' + args.label if args.label else ''}.png"
    print("plot:", bar_plot(path, "Decode attention by KV block size (out of cache unless said)",
                            [str(s) for s in sizes], series, "cycles a row (3 GHz)"))


if __name__ == "__main__":
    main()
