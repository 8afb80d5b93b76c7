"""Offline throughput: pdserve's engine vs vLLM's CPU build and transformers `generate`, same
checkpoint, same prompts, alternating the systems batch by batch in one run.

    python bench/engine_throughput.py [--batches 1,8,64,256] [--prompt-len 128] [--new-tokens 128]
                                      [--dtype bfloat16] [--peer vllm] [--peer transformers] [--peer eager]
                                      [--model-type deepseek_v3] [--compile] [--hidden 2048]

The model is the embedded tiny DeepSeek (hidden 256, 4 layers, kv_lora 512, rope 64, 8 experts
top-2), which vLLM's CPU MLA backend accepts; vLLM does not run the V3.2 indexer, so its rows use
deepseek_v3 (`--model-type deepseek_v32` measures pdserve's sparse path alone); `--hidden H` generates a
proxy of DeepSeek's layer shapes at hidden H instead (proxy_shapes). Greedy, ignore_eos, fresh random prompts every
round (no round reads another's prompts from a prefix cache).
`--peer vllm` installs vLLM into its own venv on first use (bench/peers). Prints a table of tok/s
and ratios and saves bench/out/engine_throughput.png. Under the table: this machine's GEMM rate and copy
bandwidth (bench.common.MachineLimits) and, per batch, the FLOP/s and KV bytes/s pdserve's runs imply
as shares of them (every prompt and generated token's matmul and attention FLOP; KV read by decode).
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

from bench.common import OUT, MachineLimits, TokenCost, against_limits, line_plot, proxy_shapes, table
from bench.peers import VLLM_CONFIG, VllmOffline
from shared.engine import LLM, SamplingParams
from shared.loader.tiny import write_checkpoint


def run_pdserve(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / dt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-type", default="deepseek_v3", choices=["deepseek_v3", "deepseek_v32"])
    p.add_argument("--compile", action="store_true", help="pdserve with torch.compile of the per-token parts")
    p.add_argument("--hidden", type=int, default=0, help="a proxy of DeepSeek-V3's layer shapes at this hidden size "
                                                         "(proxy_shapes) instead of the tiny model")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate the systems this many times per batch; the table shows medians (and ranges)")
    p.add_argument("--peer", action="append", choices=["vllm", "transformers", "eager", "none"], default=None,
                   help="systems to compare with in the same run (default: transformers; eager: pdserve's own engine "
                        "with --enforce-eager, no decode step replayed)")
    args = p.parse_args(argv)
    peers = [x for x in args.peer if x != "none"] if args.peer is not None else ["transformers"]
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    results: dict[str, list[float]] = {"pdserve": [], **{peer: [] for peer in peers}}
    spans: dict[str, list[str]] = {name: [] for name in results}  # per batch: the rounds' range
    ratios: list[list[float]] = []  # per batch, per peer: the median of the rounds' pdserve / peer
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"index_topk": 64} if args.model_type == "deepseek_v32" else VLLM_CONFIG
        extra = {**extra, **proxy_shapes(args.hidden)} if args.hidden else extra
        path = write_checkpoint(Path(tmp) / args.model_type, args.model_type, tokenizer=False, **extra)
        llm = LLM(str(path), dtype=args.dtype, max_num_seqs=max(batches), compile=args.compile)
        run_pdserve(llm, [[5, 6, 7, 8]], 4)  # warm-up
        cost = TokenCost.of(llm.engine.model, llm.engine.layout.bytes_per_token())
        seconds: list[float] = []
        vllm = VllmOffline(str(path), args.dtype) if "vllm" in peers else None
        eager = LLM(str(path), dtype=args.dtype, max_num_seqs=max(batches), enforce_eager=True) \
            if "eager" in peers else None
        hf = None
        if "transformers" in peers:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        try:
            for batch in batches:
                runs: dict[str, list[float]] = {name: [] for name in results}
                for r in range(args.rounds):
                    # fresh prompts every round (the systems of a round share them): a round on prompts pdserve
                    # saw before would read their KV from its prefix cache (vLLM's CPU MLA has none)
                    prompts = torch.randint(2, 1024, (batch, args.prompt_len)).tolist()
                    print(f"batch {batch} round {r + 1}: pdserve ...", end="", flush=True)
                    runs["pdserve"].append(run_pdserve(llm, prompts, args.new_tokens))
                    print(f" {runs['pdserve'][-1]:,.0f} tok/s", end="", flush=True)
                    if vllm is not None:
                        runs["vllm"].append(vllm.run(prompts, args.new_tokens))
                        print(f"; vLLM {runs['vllm'][-1]:,.0f} tok/s", end="", flush=True)
                    if eager is not None:
                        runs["eager"].append(run_pdserve(eager, prompts, args.new_tokens))
                        print(f"; eager {runs['eager'][-1]:,.0f} tok/s", end="", flush=True)
                    if hf is not None:
                        runs["transformers"].append(run_transformers(hf, prompts, args.new_tokens))
                        print(f"; transformers {runs['transformers'][-1]:,.0f} tok/s", end="", flush=True)
                    print(flush=True)
                for name, got in runs.items():
                    results[name].append(statistics.median(got))
                    spans[name].append(f"{min(got):,.0f}-{max(got):,.0f}")
                ratios.append([statistics.median(p / q for p, q in zip(runs["pdserve"], runs[peer])) for peer in peers])
                seconds.append(batch * args.new_tokens / results["pdserve"][-1])
        finally:
            if vllm is not None:
                vllm.close()
    headers = ["batch", "pdserve tok/s"] + (["range"] if args.rounds > 1 else [])
    for peer in peers:
        headers += [f"{peer} tok/s"] + (["range"] if args.rounds > 1 else []) + [f"pdserve / {peer}"]
    rows = []
    for i, batch in enumerate(batches):
        row: list[object] = [batch, results["pdserve"][i]] + ([spans["pdserve"][i]] if args.rounds > 1 else [])
        for j, peer in enumerate(peers):
            row += [results[peer][i]] + ([spans[peer][i]] if args.rounds > 1 else []) + [f"{ratios[i][j]:.2f}x"]
        rows.append(row)
    print()
    shape = f", hidden {args.hidden} proxy ({proxy_shapes(args.hidden)})" if args.hidden else ""
    print(f"{args.model_type}{shape}, {args.dtype}, {args.prompt_len}-token prompts → {args.new_tokens} tokens, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} alternating round(s) per batch")
    print(table(headers, rows))
    limits = MachineLimits.measure()
    print(f"{limits.describe()}; the model: {cost.describe(args.prompt_len + args.new_tokens)}")
    for batch, dt in zip(batches, seconds):
        flop = batch * cost.sequence_flop(args.prompt_len, args.new_tokens)
        kv = batch * cost.sequence_kv_read(args.prompt_len, args.new_tokens)
        print(f"  pdserve batch {batch}: {against_limits(limits, flop / dt, kv / dt, args.dtype)}")
    png = line_plot(OUT / "engine_throughput.png", f"{args.model_type} {args.dtype}: {args.prompt_len} → "
                    f"{args.new_tokens} tokens", batches, results, "batch (prompts)", "output tokens/s")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
