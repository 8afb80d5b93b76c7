"""Parallelism on this machine: CP prefill of a 2k-token prompt (cp=1 vs cp=2) and decode throughput
(dp=1 vs dp=2 with ep=2), tiny model, gloo ranks as real processes.

    python bench/parallel.py [--prompt-len 2048] [--decode-requests 32] [--decode-tokens 64]

Caveat: this machine has 2 cores, so two ranks split the same cores a single rank uses with two
threads; the numbers show the machinery's overhead here, not the scaling on real accelerators.
Prints a table; saves bench/out/parallel.png.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import os
import time

import torch

from bench.common import OUT, bar_plot, table
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.kvcache import KVCache, KVLayout
from shared.loader import load_model
from shared.loader.tiny import ensure_tiny_model
from shared.model import ForwardBatch, SeqChunk
from shared.model.cp import build_cp_batch
from shared.parallel import ParallelConfig, ParallelState
from shared.parallel.launch import run_ranks

CPU = torch.device("cpu")


def prefill_rank(rank: int, world: int, model_dir: str, prompt: list[int], repeat: int) -> float:
    state = ParallelState.initialize(ParallelConfig(world=world, cp=world, ep=world), rank, CPU)
    model, _ = load_model(model_dir, "float32", parallel=state)
    layout = KVLayout.from_model_config(model.config, 16, torch.float32)
    kv = KVCache(layout, len(prompt) // 16 + 4, CPU)
    table_ = kv.allocator.allocate(kv.blocks_needed(len(prompt)))
    scratch = kv.allocator.allocate(1)[0]
    best = float("inf")
    for _ in range(repeat):
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        if world > 1:
            fb = build_cp_batch([SeqChunk(prompt, 0, table_)], rank, world, 16, CPU, state.world_group, scratch)
        else:
            fb = ForwardBatch.build([SeqChunk(prompt, 0, table_)], 16, CPU)
        model(fb, kv)
        best = min(best, time.perf_counter() - t0)
    return best


def decode_rank(rank: int, world: int, model_dir: str, prompts: list[list[int]], new_tokens: int) -> tuple[int, float]:
    parallel = ParallelConfig(world=world, dp=world, ep=world)
    state = ParallelState.initialize(parallel, rank, CPU)
    engine = LLMEngine(EngineConfig(model=model_dir), state)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    mine = prompts[rank::world]
    for p in mine:
        engine.add_request(p, params)
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:  # prefill first
        engine.step()
    if world > 1:
        torch.distributed.barrier()
    t0, tokens = time.perf_counter(), 0
    while True:
        events = engine.step()
        stepped = engine.stepped
        tokens += len(events)
        if not stepped and not events:
            break
    return tokens, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-v32")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-requests", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    model_dir = str(ensure_tiny_model(args.model))
    cores = os.cpu_count() or 1
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 1000, (args.prompt_len,), generator=g).tolist()
    prompts = torch.randint(2, 1000, (args.decode_requests, 64), generator=g).tolist()
    rows, prefill_ms, decode_tps = [], [], []
    for world in (1, 2):
        threads = max(1, cores // world)
        print(f"prefill {args.prompt_len} tokens, cp={world} ...", flush=True)
        t = max(run_ranks(prefill_rank, world, model_dir, prompt, args.repeat, timeout=900, threads=threads))
        print(f"decode {args.decode_requests} requests × {args.decode_tokens} tokens, dp={world} ep={world} ...",
              flush=True)
        res = run_ranks(decode_rank, world, model_dir, prompts, args.decode_tokens, timeout=900, threads=threads)
        tps = sum(n for n, _ in res) / max(dt for _, dt in res)
        rows.append([world, threads, f"{t * 1e3:.0f}", f"{tps:.1f}"])
        prefill_ms.append(t * 1e3)
        decode_tps.append(tps)
    print()
    print(table(["cp = dp = ep", "threads/rank", f"prefill {args.prompt_len} ms", "decode tok/s"], rows))
    print(f"(this machine: {cores} cores shared by all ranks)")
    OUT.mkdir(parents=True, exist_ok=True)
    bar_plot(OUT / "parallel_prefill.png", f"{args.prompt_len}-token prefill, {cores} cores",
             ["cp=1", "cp=2"], {"prefill": prefill_ms}, "milliseconds (lower is better)")
    bar_plot(OUT / "parallel_decode.png", f"decode {args.decode_requests} requests, {cores} cores",
             ["dp=ep=1", "dp=ep=2"], {"decode": decode_tps}, "tokens/s (higher is better)")
    print(f"plots: {OUT / 'parallel_prefill.png'}, {OUT / 'parallel_decode.png'}")


if __name__ == "__main__":
    main()
