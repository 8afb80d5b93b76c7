"""MTP speculative decoding: decode tok/s and TPOT with and without MTP drafts, and acceptance.

    python bench/speculative.py [--model models/demo-v32] [--batches 1,16,64] [--k 1,2,3]
                                [--prompt-len 32] [--new-tokens 64] [--temperature 0]

Same engine, same prompts (windows of the model's own tokenizer over a fixed English text when the model
has one, else random ids), greedy by default; configurations alternate batch by batch. Decode tok/s
counts generated tokens after the first over the time after the first token; TPOT is its inverse per
request. Acceptance per draft position comes from the engine's counters. Prints a table and saves
bench/out/speculative.png.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import time
from pathlib import Path

import torch

from bench.common import OUT, bar_plot, table
from shared.engine import LLM, SamplingParams

TEXT = ("And it came to pass in those days, that there went out a decree from Caesar Augustus, that all the "
        "world should be taxed. And all went to be taxed, every one into his own city. In the beginning God "
        "created the heaven and the earth. And the earth was without form, and void; and darkness was upon the "
        "face of the deep. And the Spirit of God moved upon the face of the waters. ")


def prompts_for(llm: LLM, n: int, length: int, vocab: int) -> list[list[int]]:
    tok = llm.engine.tokenizer
    if tok is not None:
        ids = tok.encode(TEXT * 4)
        return [ids[(7 * i) % (len(ids) - length):][:length] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(decode tok/s after the first token, mean TPOT ms) for one batch run to completion."""
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):  # prefill: every request has its first token
        engine.step()
    t0, first = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    while engine.has_work:
        engine.step()
    dt = time.perf_counter() - t0
    generated = sum(len(s.output_token_ids) for s in seqs) - first
    per_request = dt / max(1, generated / len(seqs))
    return generated / dt, 1000 * per_request


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo-v32")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", default="1,2,3", help="draft counts to measure")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--random-mtp", action="store_true",
                   help="a tiny random checkpoint with an MTP layer instead of --model (drafts are never right)")
    args = p.parse_args(argv)
    if args.random_mtp:
        import tempfile

        from shared.loader.tiny import write_checkpoint

        args.model = str(write_checkpoint(Path(tempfile.mkdtemp()) / "tiny-mtp", tokenizer=False, mtp=True))
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True, seed=None)
    configs = {"no MTP": LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)}
    for k in ks:
        configs[f"MTP K={k}"] = LLM(args.model, dtype=args.dtype, speculative="mtp", num_speculative_tokens=k)
    vocab = configs["no MTP"].engine.model_config.vocab_size
    rates: dict[str, list[float]] = {name: [] for name in configs}
    tpots: dict[str, list[float]] = {name: [] for name in configs}
    for b in batches:
        prompts = prompts_for(configs["no MTP"], b, args.prompt_len, vocab)
        for name, llm in configs.items():
            rate, tpot = decode_rate(llm, prompts, params)
            rates[name].append(rate)
            tpots[name].append(tpot)
            print(f"batch {b:3d} {name:>9}: {rate:8.1f} tok/s, TPOT {tpot:6.1f} ms", file=_sys.stderr, flush=True)
    rows = []
    for name, llm in configs.items():
        spec = llm.engine.speculator
        acc = ", ".join(f"{a:.2f}" for a in spec.stats.acceptance()[: spec.k]) if spec else "-"
        mean = f"{spec.stats.mean_accepted + 1:.2f}" if spec else "1.00"
        rows.append([name, *(f"{r:.0f} ({r / rates['no MTP'][i]:.2f}x)" for i, r in enumerate(rates[name])),
                     *(f"{t:.1f}" for t in tpots[name]), acc, mean])
    headers = ["config", *(f"tok/s b={b}" for b in batches), *(f"TPOT ms b={b}" for b in batches),
               "acceptance per position", "tokens / step"]
    print(table(headers, rows))
    path = bar_plot(OUT / "speculative.png", f"MTP speculative decoding ({_Path(args.model).name}, {args.dtype})",
                    [f"batch {b}" for b in batches], rates, "decode tok/s")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
