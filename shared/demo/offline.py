"""Offline greedy generation with the engine on the embedded tiny model (no services).

    python -m shared.demo.offline [--model DIR] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import time

from shared.engine import LLM, SamplingParams
from shared.loader.tiny import ensure_tiny_model

PROMPTS = ["Hello world.", "The capital of France is", "Once upon a time", "def add(a, b):"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-v32", help="checkpoint dir (generated if missing)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    path = ensure_tiny_model(args.model)
    llm = LLM(str(path), dtype=args.dtype, progress=True)
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    dt = time.perf_counter() - t0
    for prompt, out in zip(PROMPTS, outs):
        print(f"prompt: {prompt!r}\n  tokens: {out.token_ids}\n  text:   {out.text!r}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"{n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s (random weights: the text is noise)")


if __name__ == "__main__":
    main()
