"""Train the demo model: a small DeepSeek-V3.2 on the King James Bible, so `make demo` streams English.

    python -m shared.demo.train [--out models/demo-v32] [--steps N] [--corpus PATH]

The random tiny model streams noise; this one has exactly the V3.2 architecture the engine serves (MLA,
lightning indexer with `index_topk` below the demo's context, MoE with a shared expert and aux-loss-free
router bias, YaRN RoPE, one MTP layer) at toy size, trained deterministically on 2 CPU cores in minutes.
transformers' `DeepseekV32ForCausalLM` is the trainable model (it is the reference the engine is tested
against). Its indexer runs under `no_grad` (top-k is not differentiable), so training follows DeepSeek's
recipe in three phases:

1. dense: main model + MTP layer (loss = main + 0.3·mtp) with every key selected (top-k ≥ context);
2. indexer alignment: everything else frozen, each indexer (main layers and MTP block) learns to match
   the dense attention (softmax of its scores vs the attention probabilities summed over heads, KL);
3. sparse: main model + MTP layer again, now with the shipped `index_topk` (the indexers frozen).

Corpus: Debian's `bible-kjv-text` (`make corpus` downloads and extracts it). Its `usr/lib/bible.data`
is the text in 64 KiB blocks of Unix-compress (LZW) data behind a block table; we decode it with gzip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from shared.demo.corpus import Corpus, TokenSplit, read_corpus, tokenize, train_tokenizer
from shared.demo.export import write_checkpoint
from shared.demo.model import DemoModel
from shared.demo.phases import align_indexers, evaluate, train_lm
from shared.demo.recipe import DEFAULT_CORPUS, DEFAULT_OUT, MAKE_HINT, TrainConfig, log

DEVICE = torch.device("cpu")  # the recipe is CPU; --device only for quick experiments


@dataclass
class _Data:
    """The corpus split into training and validation verses, tokenized, and each phase's fixed order of
    training windows."""

    corpus: Corpus
    n_val: int  # validation verses: the corpus's last
    train_split: TokenSplit
    val_split: TokenSplit
    tokenizer_file: Path
    dense_order: torch.Tensor
    align_order: torch.Tensor
    sparse_order: torch.Tensor


def _prepare(cfg: TrainConfig, corpus_path: str | Path, tok_dir: Path, t_start: float) -> _Data:
    """Read and split the corpus, train the tokenizer into `tok_dir`, draw the data order."""
    corpus = read_corpus(corpus_path)
    n_val = max(1, int(len(corpus.verses) * cfg.val_fraction))
    train_verses, val_verses = corpus.verses[:-n_val], corpus.verses[-n_val:]
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok_file = tok_dir / "tokenizer.json"
    tok = train_tokenizer(train_verses, cfg.model["vocab_size"], tok_file)
    train_split, val_split = tokenize(tok, train_verses), tokenize(tok, val_verses)
    log(f"corpus {corpus.info['package']} {corpus.info['version']}: {len(train_verses)} train verses "
        f"({len(train_split.ids)} tokens), {len(val_verses)} validation verses ({len(val_split.ids)} tokens); "
        f"tokenizer {time.monotonic() - t_start:.0f}s")

    # fixed data order: a seeded permutation of the training verse starts (those with a full window)
    usable = int((train_split.starts + cfg.seq_len - 1 <= len(train_split.ids)).sum())
    gen = torch.Generator().manual_seed(cfg.seed)
    total = (cfg.steps + cfg.sparse_steps) * cfg.batch + cfg.align_steps * cfg.align_batch
    order = torch.cat([torch.randperm(usable, generator=gen) for _ in range(-(-total // usable))])
    dense_order, order = order[: cfg.steps * cfg.batch], order[cfg.steps * cfg.batch :]
    align_order, sparse_order = order[: cfg.align_steps * cfg.align_batch], order[cfg.align_steps * cfg.align_batch :]
    return _Data(corpus, n_val, train_split, val_split, tok_file, dense_order, align_order, sparse_order)


def train(cfg: TrainConfig, corpus_path: str | Path = DEFAULT_CORPUS, out: str | Path | None = DEFAULT_OUT,
          work_dir: str | Path | None = None) -> dict[str, Any]:
    """The whole recipe. `out=None` trains without writing a checkpoint (what the test re-runs);
    the tokenizer then goes to `work_dir`. Returns the run's log (what train_log.json holds)."""
    import tokenizers
    import transformers

    t_start = time.monotonic()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data = _prepare(cfg, corpus_path, Path(out) if out is not None else Path(work_dir or "."), t_start)
    train_split, val_split = data.train_split, data.val_split

    model = DemoModel(cfg.model, cfg.seed).to(DEVICE)
    topk = cfg.model["index_topk"]
    params = [p for p in model.parameters()]
    n_params = sum(p.numel() for p in params)
    log(f"model: {n_params / 1e6:.2f}M parameters (incl. MTP layer)")

    t0 = time.monotonic()
    model.set_index_topk(None)  # phase 1: dense (every key selected)
    history = train_lm(model, train_split, cfg, cfg.steps, cfg.lr, data.dense_order, "dense", params)
    t_dense = time.monotonic() - t0
    result: dict[str, Any] = {"first_losses": history[:20], "final_dense_loss": history[-1] if history else None}
    if out is None:
        return result

    dense_eval = evaluate(model, val_split, cfg, None)
    log(f"dense validation: {dense_eval}")
    t0 = time.monotonic()
    align = align_indexers(model, train_split, cfg, data.align_order)
    t_align = time.monotonic() - t0
    aligned_eval = evaluate(model, val_split, cfg, topk)
    log(f"sparse (top-{topk}) validation after indexer alignment: {aligned_eval}")

    t0 = time.monotonic()
    model.set_index_topk(topk)  # phase 3: sparse, the shipped index_topk; indexers frozen
    lm_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    sparse = train_lm(model, train_split, cfg, cfg.sparse_steps, cfg.sparse_lr, data.sparse_order, "sparse",
                      lm_params)
    t_sparse = time.monotonic() - t0
    final_eval = evaluate(model, val_split, cfg, topk)
    final_dense = evaluate(model, val_split, cfg, None)
    log(f"final validation, sparse top-{topk}: {final_eval}; dense: {final_dense}")

    out = Path(out)
    write_checkpoint(out, model, cfg, data.tokenizer_file)
    result.update({
        "train_config": asdict(cfg),
        "corpus": {**data.corpus.info, "validation": f"last {data.n_val} verses ({cfg.val_fraction:.0%})"},
        "parameters": n_params,
        "validation": {
            "after_dense": dense_eval, "after_indexer_alignment_sparse": aligned_eval,
            "final_sparse": final_eval, "final_dense": final_dense,
        },
        "validation_perplexity": final_eval["perplexity"],
        "mtp_top1_accuracy": final_eval["mtp_top1"],
        "indexer_alignment": {"first": align[:3], "last": align[-3:]},
        "final_sparse_loss": sparse[-1] if sparse else None,
        "seconds": {"dense": round(t_dense, 1), "align": round(t_align, 1), "sparse": round(t_sparse, 1),
                    "total": round(time.monotonic() - t_start, 1)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "mtp": "x_i = eh_proj(cat([enorm(embed(t_{i+1})), hnorm(h_i)])), h_i = main post-final-norm state; "
               "decoder block at rotary position i, causal over MTP states <= i; "
               "logits_i = shared_head.head(shared_head.norm(block_i)) predict t_{i+2}; loss = main + 0.3 mtp",
    })
    (out / "train_log.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out} in {time.monotonic() - t_start:.0f}s")
    return result


def main(argv: list[str] | None = None) -> None:
    if argv is None and "OMP_WAIT_POLICY" not in os.environ:
        # libgomp reads this when torch loads, before any code of ours runs: start again with it set. Spinning
        # OpenMP workers make 2 threads ~8x slower on a busy 2-core machine; passive ones cost nothing.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "shared.demo.train", *sys.argv[1:]])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="bible.data of bible-kjv-text, or a text file")
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="dense-phase steps")
    p.add_argument("--align-steps", type=int, default=TrainConfig.align_steps)
    p.add_argument("--sparse-steps", type=int, default=TrainConfig.sparse_steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a TrainConfig field")
    p.add_argument("--losses-only", action="store_true",
                   help="run only the first --steps dense steps; print their losses as JSON (no checkpoint)")
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if not Path(args.corpus).exists():
        raise SystemExit(f"corpus {args.corpus} not found: {MAKE_HINT}")
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = TrainConfig(steps=args.steps, align_steps=args.align_steps, sparse_steps=args.sparse_steps, seed=args.seed,
                      **overrides)
    if args.losses_only:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(train(cfg, args.corpus, None, tmp)["first_losses"]))
        return
    train(cfg, args.corpus, args.out)


if __name__ == "__main__":
    main()
