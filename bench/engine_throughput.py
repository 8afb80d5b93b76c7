"""Offline throughput: pdserve's engine vs transformers `generate`, same checkpoint, same prompts.

    python bench/engine_throughput.py [--prompts 64] [--prompt-len 128] [--new-tokens 128] [--dtype bfloat16]

Tiny deepseek_v3 (hidden 256, 4 layers, 8 experts top-2) and the same with the indexer
(deepseek_v32, index_topk 64); greedy, ignore_eos. Prints a table and saves bench/out/engine_throughput.png.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

from bench.common import OUT, bar_plot, table  # noqa: E402
from shared.engine import LLM, SamplingParams  # noqa: E402
from shared.loader.tiny import write_checkpoint  # noqa: E402


def run_pdserve(path: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> float:
    llm = LLM(str(path), dtype=dtype, block_size=16, max_num_batched_tokens=4096)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt


def run_transformers(path: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    torch.manual_seed(0)
    rows, ours, theirs, labels = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, extra in (("deepseek_v3", {}), ("deepseek_v32", {"index_topk": 64})):
            path = write_checkpoint(Path(tmp) / model_type, model_type, tokenizer=False, **extra)
            prompts = torch.randint(2, 1024, (args.prompts, args.prompt_len)).tolist()
            print(f"[{model_type}] pdserve engine ...", flush=True)
            a = run_pdserve(path, prompts, args.new_tokens, args.dtype)
            print(f"[{model_type}]   {a:,.1f} tok/s; transformers generate ...", flush=True)
            b = run_transformers(path, prompts, args.new_tokens, args.dtype)
            print(f"[{model_type}]   {b:,.1f} tok/s", flush=True)
            rows.append([model_type, args.dtype, args.prompts, a, b, f"{a / b:.2f}x"])
            ours.append(a)
            theirs.append(b)
            labels.append(model_type)
    print()
    print(table(["model", "dtype", "batch", "pdserve tok/s", "transformers tok/s", "ratio"], rows))
    png = bar_plot(OUT / "engine_throughput.png",
                   f"{args.prompts}×{args.prompt_len} prompts → {args.new_tokens} tokens, {args.dtype}, "
                   f"{torch.get_num_threads()} threads", labels, {"pdserve": ours, "transformers": theirs},
                   "output tokens/s")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
