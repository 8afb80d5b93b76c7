"""C8 KV cache vs bf16 at long contexts: decode speed where attention and the indexer dominate.

    python bench/c8.py [--contexts 2000,8000] [--batch 4] [--new-tokens 12] [--repeat 3] [--index-topk 2048]
                       [--hidden 256] [--threads 1] [--distinct]

A generated DeepSeek-V3.2-shaped tiny model (hidden `--hidden`, 4 layers, 4 heads, kv_lora_rank 512, rope 64,
indexer 16 heads × 128; index_topk DeepSeek's 2048, so a 2,000-token context decodes with dense attention and
an 8,000-token one with the indexer scoring every key and sparse attention over 2,048 picks), loaded in bf16
twice: KV cache bf16 (`auto`) and C8 (`int8`: int8 latent + scales, FP8 indexer keys). Prefill is what makes
long contexts slow here (an 8k prompt's tokens each attend to 2,048 picks through the portable path: minutes
per request on 2 cores), so the `--batch` prompts of a context share all but their last `--tail` tokens, and
every engine prefills one of them first: the others, and every timed round, take the shared blocks from the
prefix cache. `--repeat` rounds, configurations alternating (order reversed every round), each submit the
batch and time every decode step: decode tok/s is batch / the median step, best round of each, and the ratio of
the rounds' medians (steadier on a loaded machine). (Requests
reading the same prefix blocks find them in cache more often than distinct contexts would: C8's smaller
rows matter less here than in a real batch; `--distinct` gives every request its own context, prefilled once
per engine before the timed rounds.) KV bytes per token are the allocated pools'. Greedy, ignore_eos, one torch
thread by default (a second thread waits on whatever else holds the other core). Prints the machine's GEMM
rate and copy bandwidth and each run's FLOP and KV bytes per second against them, and per context the share of
a bf16 step in attention and the indexer's top-k (two more runs each, alternating, the faster kept:
bench.common.fastest_parts) with what C8 could gain at most were those bound by bytes alone.
"""

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

from bench.common import (
    OUT,
    MachineLimits,
    TokenCost,
    against_limits,
    bar_plot,
    fastest_parts,
    kernels_used,
    kv_read_bound,
    table,
)
from shared.engine import LLM, SamplingParams
from shared.loader.tiny import write_checkpoint

CONFIGS = {"bf16": "auto", "C8": "int8"}  # name: kv_cache_dtype


def decode_step_seconds(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Run the prompts to `new_tokens` tokens; the median time of the steps after every request has its first
    token (the decode steps)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in prompts]
    steps = []
    while eng.has_work:
        decoding = all(s.output_token_ids for s in seqs)
        t0 = time.perf_counter()
        eng.step()
        if decoding:
            steps.append(time.perf_counter() - t0)
    assert all(len(s.output_token_ids) == new_tokens for s in seqs)
    return statistics.median(steps)


def kv_bytes_per_token(llm: LLM) -> float:
    kv = llm.engine.kv
    pools = [p for p in (kv.mla, kv.index) if p is not None]
    return sum(p.numel() * p.element_size() for p in pools) / (kv.num_blocks * llm.engine.layout.block_size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2000,8000", help="prompt lengths (tokens in cache when decode starts)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tail", type=int, default=16, help="tokens of each prompt after the shared prefix")
    p.add_argument("--distinct", action="store_true",
                   help="no shared prefix: every prompt its own context (rows out of cache, as in a real batch; "
                        "the prefill takes --batch times longer)")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per (context, configuration); the best counts")
    p.add_argument("--index-topk", type=int, default=2048, help="the model's index_topk (DeepSeek-V3.2: 2048)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default, one per core)")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    limits = MachineLimits.measure()
    gen = torch.Generator().manual_seed(0)
    rows, notes, bounds = [], [], []
    plotted: list[str] = []  # contexts, the plot's groups
    series: dict[str, list[float]] = {}  # decode tok/s per KV cache, by context
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(contexts) + args.new_tokens
        path = write_checkpoint(Path(tmp) / "m", "deepseek_v32", tokenizer=False, hidden_size=args.hidden,
                                moe_intermediate_size=args.hidden // 2, intermediate_size=2 * args.hidden,
                                index_topk=args.index_topk, max_position_embeddings=longest + 64)
        tokens = args.batch * (longest + 64) + 256
        engines = {name: LLM(str(path), dtype="bfloat16", kv_cache_dtype=kvd, max_num_seqs=args.batch,
                             kv_cache_tokens=tokens, enable_prefix_caching=True, max_num_batched_tokens=8192)
                   for name, kvd in CONFIGS.items()}
        per_token = {name: kv_bytes_per_token(llm) for name, llm in engines.items()}
        costs = {name: TokenCost.of(llm.engine.model, int(per_token[name])) for name, llm in engines.items()}
        vocab = engines["bf16"].engine.model_config.vocab_size
        for context in contexts:
            tail = context if args.distinct else args.tail
            prefix = torch.randint(2, vocab, (context - tail,), generator=gen).tolist()
            tails = torch.randint(2, vocab, (args.batch, tail), generator=gen).tolist()
            prompts = [prefix + tail for tail in tails]
            for name, llm in engines.items():  # prefill once; the batch and the rounds find the prompts cached
                t0 = time.perf_counter()
                decode_step_seconds(llm, prompts if args.distinct else prompts[:1], 2)
                print(f"context {context}: {name} prefill + 2 tokens {time.perf_counter() - t0:.1f} s", flush=True)
            best: dict[str, float] = {}
            runs: dict[str, list[float]] = {name: [] for name in engines}
            plotted.append(str(context))
            for r in range(args.repeat):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for name in order:
                    step = decode_step_seconds(engines[name], prompts, args.new_tokens)
                    best[name] = min(best.get(name, step), step)
                    runs[name].append(step)
                    print(f"  context {context} round {r + 1}: {name:4s} decode step {step * 1e3:7.2f} ms "
                          f"({args.batch / step:7.1f} tok/s)", flush=True)
            parts = fastest_parts(engines, prompts, args.new_tokens)
            (bf16_ms, b), c8_ms = parts["bf16"], parts["C8"][0]
            ratio = per_token["C8"] / per_token["bf16"]
            read, most = kv_read_bound(bf16_ms, b, ratio)
            bounds.append(f"context {context}: attention and the indexer's top-k (what C8 changes) {read:.2f} ms of a "
                          f"{bf16_ms:.2f} ms bf16 step ({100 * read / bf16_ms:.0f}%); were they bound by bytes alone, "
                          f"C8's {ratio:.2f}x bytes would make it at most {most:.2f}x bf16 (this run: "
                          f"{bf16_ms / c8_ms:.2f}x)")
            mode = "dense" if context + args.new_tokens <= args.index_topk else "indexer + sparse"
            for name in engines:
                tok_s = args.batch / best[name]
                series.setdefault(name, []).append(tok_s)
                ctx = context + args.new_tokens // 2
                rows.append([context, mode, name, f"{per_token[name]:,.0f}",
                             f"{per_token[name] / per_token['bf16']:.2f}x", best[name] * 1e3, tok_s,
                             f"{best['bf16'] / best[name]:.2f}x",
                             f"{statistics.median(runs['bf16']) / statistics.median(runs[name]):.2f}x"])
                notes.append(f"context {context} {name}: " + against_limits(
                    limits, costs[name].flop(ctx) * tok_s, costs[name].kv_bytes(ctx) * tok_s, "bfloat16"))
    print(f"\n## C8 vs bf16 KV cache, decode at long contexts: generated V3.2 (hidden {args.hidden}, 4 layers, "
          f"4 heads, "
          f"index_topk {args.index_topk}), batch {args.batch}, {args.new_tokens} new tokens, best of {args.repeat} "
          f"rounds, {torch.get_num_threads()} thread(s), "
          f"{'distinct contexts' if args.distinct else f'contexts sharing all but {args.tail} tokens'}")
    print(table(["context", "attention", "KV cache", "KV B/token", "vs bf16", "decode step ms", "decode tok/s",
                 "vs bf16", "median round vs bf16"], rows))
    for bound in bounds:
        print(bound)
    print(limits.describe())
    print(kernels_used())
    for note in notes:
        print("  " + note)
    png = bar_plot(OUT / ("c8_distinct.png" if args.distinct else "c8.png"),
                   f"decode tok/s, batch {args.batch}: bf16 vs C8 KV cache", plotted, series,
                   "decode tokens/s")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
