"""MTP speculative decoding: decode tok/s and TPOT with and without MTP drafts, acceptance, and the
arithmetic behind the ratio (tokens per step against the cost of a step).

    python bench/speculative.py [--model models/demo-v32] [--batches 1,16,64] [--k 1,2,3] [--rounds 3]
                                [--prompt-len 32] [--new-tokens 64] [--temperature 0] [--threads 1]
                                [--max-draft-tokens N]

Same engine, same prompts (windows of the model's own tokenizer over a fixed English text when the model
has one, else random ids), greedy by default. Per batch size, `--rounds` rounds, each running every
configuration once in a rotated order; a configuration's figure is its median round. Decode tok/s counts
generated tokens after the first over the time after the first token; TPOT is its inverse per request.
Per configuration: acceptance per draft position and tokens per verification step (the engine's counters,
this batch size only), ms per step, and `speedup = tokens per step / step cost`, with the step cost
relative to a plain decode step of the same batch. Then, from one more run of each, the MTP layer's forwards'
share of a step (catch-up and chained drafts) and what MTP could gain at most were its verification rows
free: tokens per step x plain step / (plain step + MTP layer). Prints the tables and saves
bench/out/speculative.png.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import OUT, MachineLimits, OpTimes, TokenCost, against_limits, bar_plot, table
from shared.engine import LLM, SamplingParams
from shared.engine.speculative import SpecStats

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


@dataclass
class Run:
    """One configuration's decode of one batch: tokens after the first, time and engine steps, over the whole
    run and over its full-batch window (every request still decoding)."""

    tokens: int
    seconds: float
    steps: int
    requests: int
    full_tokens: int
    full_seconds: float
    full_steps: int

    @property
    def rate(self) -> float:
        """Decode tok/s while the whole batch decodes: the throughput at this batch size."""
        return self.full_tokens / self.full_seconds

    @property
    def completion_rate(self) -> float:
        """Decode tok/s to the last request's end (speculation ends requests unevenly: a tail of small steps)."""
        return self.tokens / self.seconds

    @property
    def tpot_ms(self) -> float:
        return 1000 * self.full_seconds / max(1, self.full_tokens / self.requests)

    @property
    def step_ms(self) -> float:
        return 1000 * self.full_seconds / max(1, self.full_steps)


def decode_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    """One batch run to completion, timed from the step after every request has its first token."""
    engine = llm.engine
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):  # prefill: every request has its first token
        engine.step()
    count = lambda: sum(len(s.output_token_ids) for s in seqs)  # noqa: E731
    t0, first, steps = time.perf_counter(), count(), 0
    full = None
    while engine.has_work:
        engine.step()
        steps += 1
        if full is None and any(s.finish_reason is not None for s in seqs):
            full = (count() - first, time.perf_counter() - t0, steps)
    dt = time.perf_counter() - t0
    full = full or (count() - first, dt, steps)
    return Run(count() - first, dt, steps, len(seqs), *full)


def mtp_share(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(ms per decode step, ms per step in the MTP layer's forwards: catch-up and chained drafts) of one run."""
    model = llm.engine.model
    with OpTimes({"mtp": (model, "forward_mtp")}) as parts:
        run = decode_run(llm, prompts, params)
    steps = max(run.steps, 1)
    return 1e3 * run.seconds / steps, 1e3 * parts.seconds["mtp"] / steps


def _stats_delta(after: SpecStats, before: SpecStats) -> SpecStats:
    return SpecStats([a - b for a, b in zip(after.drafted, before.drafted, strict=True)],
                     [a - b for a, b in zip(after.accepted, before.accepted, strict=True)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo-v32")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", default="1,2,3", help="draft counts to measure")
    p.add_argument("--rounds", type=int, default=3, help="rounds per batch size (configurations rotate each round)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-draft-tokens", type=int, default=None,
                   help="the engine's speculative_max_draft_tokens (default: the engine's; 0: no cap)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: comparable on a shared machine)")
    p.add_argument("--random-mtp", action="store_true",
                   help="a tiny random checkpoint with an MTP layer instead of --model (drafts are never right)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.random_mtp:
        import tempfile

        from shared.loader.tiny import write_checkpoint

        args.model = str(write_checkpoint(Path(tempfile.mkdtemp()) / "tiny-mtp", tokenizer=False, mtp=True))
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True, seed=None)
    configs = {"no MTP": LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)}
    cap = {} if args.max_draft_tokens is None else {"speculative_max_draft_tokens": args.max_draft_tokens}
    for k in ks:
        configs[f"MTP K={k}"] = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, speculative="mtp",
                                    num_speculative_tokens=k, **cap)
    names = list(configs)
    vocab = configs["no MTP"].engine.model_config.vocab_size
    rates: dict[str, list[float]] = {name: [] for name in names}
    rows, ceilings = [], []
    for b in batches:
        prompts = prompts_for(configs["no MTP"], b, args.prompt_len, vocab)
        runs: dict[str, list[Run]] = {name: [] for name in names}
        before = {name: _copy(configs[name]) for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                runs[name].append(decode_run(configs[name], prompts, params))
                print(f"batch {b:3d} round {r} {name:>9}: {runs[name][-1].rate:8.1f} tok/s, "
                      f"{runs[name][-1].step_ms:6.2f} ms/step", file=_sys.stderr, flush=True)
        median = {name: sorted(runs[name], key=lambda x: x.rate)[len(runs[name]) // 2] for name in names}
        base = median["no MTP"]
        plain_ms = mtp_share(configs["no MTP"], prompts, params)[0] if len(names) > 1 else 0.0  # for the ceilings
        for name in names:
            m = median[name]
            rates[name].append(m.rate)
            spec = configs[name].engine.speculator
            if spec is None:
                acc, per_step = "-", 1.0
            else:
                st = _stats_delta(spec.stats, before[name])
                acc, per_step = ", ".join(f"{a:.2f}" for a in st.acceptance()[: spec.k]), st.mean_accepted + 1
            cost = m.step_ms / base.step_ms
            to_end = statistics.median(r.completion_rate for r in runs[name]) / statistics.median(
                r.completion_rate for r in runs["no MTP"])
            rows.append([b, name, f"{m.rate:.0f}", f"{m.rate / base.rate:.2f}x", f"{to_end:.2f}x", f"{m.tpot_ms:.1f}",
                         f"{m.step_ms:.2f}", acc, f"{per_step:.2f}", f"{cost:.2f}", f"{per_step / cost:.2f}"])
            if spec is not None:  # the MTP layer's own share: what verification rows for free would still cost
                step_ms, mtp_ms = mtp_share(configs[name], prompts, params)
                ceilings.append([b, name, f"{plain_ms:.2f}", f"{step_ms:.2f}", f"{mtp_ms:.2f}",
                                 f"{step_ms - mtp_ms - plain_ms:.2f}", f"{per_step:.2f}",
                                 f"{per_step * plain_ms / (plain_ms + mtp_ms):.2f}x"])
    headers = ["batch", "config", "tok/s", "vs plain", "to the end", "TPOT ms", "ms/step", "acceptance per position",
               "tokens/step", "step cost", "tokens/step / cost"]
    print(table(headers, rows))
    if ceilings:
        print("\nWhere an MTP step goes (one more run each, whole run: ms per step): the MTP layer's forwards "
              "(catch-up over the accepted positions, chained drafts) and the verification rows (the step's main "
              "forward beyond a plain step's). Were the verification rows free, MTP would still pay its own layer: "
              "at most tokens/step x plain / (plain + MTP layer).")
        print(table(["batch", "config", "plain step ms", "MTP step ms", "MTP layer ms", "verification rows ms",
                     "tokens/step", "at most"], ceilings))
    spec = configs[names[-1]].engine.speculator if len(names) > 1 else None
    if spec is not None:
        print(f"drafts per step capped at {spec.max_draft_tokens or 'no cap'} (speculative_max_draft_tokens)")
    print(f"median of {args.rounds} rounds, while the whole batch decodes (until a request ends); 'to the end': "
          f"tok/s ratio to the last request's end; step cost: ms per step relative to plain decode at the same "
          f"batch; torch threads {torch.get_num_threads()}")
    plain = configs["no MTP"].engine
    cost, context = TokenCost.of(plain.model, plain.layout.bytes_per_token()), args.prompt_len + args.new_tokens // 2
    limits = MachineLimits.measure()
    print(f"{limits.describe()}; the model: {cost.describe(context)} (main model; a draft adds its MTP layer)")
    for b, rate in zip(batches, rates["no MTP"]):
        print(f"  plain decode at batch {b}: "
              f"{against_limits(limits, cost.flop(context) * rate, cost.kv_bytes(context) * rate, args.dtype)}")
    path = bar_plot(OUT / "speculative.png", f"MTP speculative decoding ({_Path(args.model).name}, {args.dtype})",
                    [f"batch {b}" for b in batches], rates, "decode tok/s")
    print(f"plot: {path}")


def _copy(llm: LLM) -> SpecStats:
    spec = llm.engine.speculator
    return SpecStats(list(spec.stats.drafted), list(spec.stats.accepted)) if spec else SpecStats()


if __name__ == "__main__":
    main()
