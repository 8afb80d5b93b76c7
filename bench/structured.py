"""Structured outputs: decode TPOT under a JSON-schema constraint vs unconstrained, grammar compile time
(cold and cached), and the per-step mask cost (llguidance's bitmask fill + applying it to the logits).

    python bench/structured.py [--model models/demo-v32] [--batches 1,16,64] [--new-tokens 64]
                               [--rounds 5] [--dtype bfloat16] [--mask-vocab model,129280]
                               [--baseline-mask GIT_REV[,GIT_REV]] [--quiet-below 0.3] [--quiet-wait 10]

TPOT: the same engine (`LLM.generate`, in-process) decodes the same prompts (windows of the model's own
text), greedy, `ignore_eos`, `--new-tokens` each, unconstrained and under a JSON schema that cannot end
before (an object holding an array of 64 strings of 8 to 64 characters), so every request of both
variants generates exactly `--new-tokens` tokens (the `tokens` column: min-max per request). Per-step
timing: each `engine.step` inside `generate` is timed, and the decode steps are those after every
request has its first token (each then gives every request one token). TPOT p50 = the median decode
step; mean = decode time / tokens after the first. The variants alternate within each round (ABBA order
over rounds); `/ free` is the median over rounds of that round's p50 ratio (the machine's speed drifts
2x between minutes; a ratio within one round much less). `--baseline-mask REV` adds the same constrained
runs masked by shared/engine/structured.py as of git revision REV (before/after in one run). During the
constrained runs `Grammars.mask` (median ms per step, mean µs per constrained row) and
`GrammarState.advance` (µs per token) are timed. The machine is shared: before each round the bench waits
(--quiet-wait s at most) until other programs use under --quiet-below cores, measures the cores they
used during each batch's runs (bench/hostload), and the table keeps the rounds in which they stayed
under --quiet-below (all rounds when none did; the `quiet rounds` column says how many).

Compile: 6 schemas of rising size, each compiled cold (`ConstraintCompiler.matcher` with an empty
cache and llguidance's grammar text not cached: JSON schema → grammar → LLMatcher, checked by one
bitmask) and then from the cache (validate + deep copy of the compiled matcher), at the model's
vocabulary and at DeepSeek-V3.2's 129,280 tokens. There is no DeepSeek tokenizer on this machine: the
real-size vocabulary is the model's tokenizer.json padded with random byte-level words (a token trie of
the real size; the real tokenizer's words differ). Mask: `Grammars.mask` on [batch, vocab] fp32 logits
at each vocabulary, every row in one grammar state (start of the object, inside a string, between array
items), split into llguidance's fill and the rest (apply: unpack + fill), each implementation
alternating. Prints tables and saves bench/out/structured.png (TPOT p50 per batch and variant).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import llguidance
import llguidance.torch
import torch

from bench.common import OUT, ROOT, bar_plot, table
from bench.hostload import ForeignLoad, wait_quiet
from bench.speculative import prompts_for
from shared.engine import LLM, SamplingParams
from shared.engine import structured as engine_structured
from shared.engine.structured import Grammars, MaskRow
from shared.protocol import structured as protocol_structured
from shared.protocol.structured import ConstraintCompiler, ConstraintKind, StructuredOutput

REAL_VOCAB = 129_280  # DeepSeek-V3.2's logits

# Keeps generating: 64 strings of at least 8 characters cannot close within a few hundred tokens.
TPOT_SCHEMA = {"type": "object", "properties": {"verses": {
    "type": "array", "items": {"type": "string", "minLength": 8, "maxLength": 64}, "minItems": 64, "maxItems": 64}},
    "required": ["verses"], "additionalProperties": False}


def compile_schemas() -> dict[str, dict]:
    """Rising size: flat object, nested objects, arrays, enums, bounded numbers, 50 properties."""
    big = {f"field_{i:02d}": ({"type": "string", "maxLength": 32} if i % 5 == 0 else
                              {"type": "integer", "minimum": 0, "maximum": 10_000} if i % 5 == 1 else
                              {"type": "number", "minimum": -1.5, "maximum": 1e6} if i % 5 == 2 else
                              {"enum": [f"v{i}_{k}" for k in range(6)]} if i % 5 == 3 else
                              {"type": "array", "items": {"type": "string"}, "maxItems": 8})
           for i in range(50)}
    return {
        "flat object (3 props)": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"], "additionalProperties": False},
        "nested (3 levels)": {"type": "object", "properties": {"who": {"type": "object", "properties": {
            "name": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                     "required": ["first", "last"], "additionalProperties": False},
            "tribe": {"type": "string"}}, "required": ["name", "tribe"], "additionalProperties": False}},
            "required": ["who"], "additionalProperties": False},
        "arrays": {"type": "object", "properties": {
            "verses": {"type": "array", "items": {"type": "string", "maxLength": 64}, "maxItems": 64},
            "refs": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}},
            "required": ["verses", "refs"], "additionalProperties": False},
        "enums (4 x 12 values)": {"type": "object", "properties": {
            f"e{j}": {"enum": [f"value_{j}_{k}" for k in range(12)]} for j in range(4)},
            "required": [f"e{j}" for j in range(4)], "additionalProperties": False},
        "bounded numbers (8)": {"type": "object", "properties": {
            **{f"i{j}": {"type": "integer", "minimum": -j * 100, "maximum": 10 ** (j + 1)} for j in range(4)},
            **{f"x{j}": {"type": "number", "minimum": -1.0, "exclusiveMaximum": 10.0 ** j} for j in range(4)}},
            "required": [*(f"i{j}" for j in range(4)), *(f"x{j}" for j in range(4))], "additionalProperties": False},
        "big (50 props)": {"type": "object", "properties": big, "required": list(big), "additionalProperties": False},
    }


def real_vocab_tokenizer(src: Path, vocab_size: int, dst: Path) -> Path:
    """`src`'s tokenizer.json with its vocabulary padded to `vocab_size` - 64 entries by random byte-level
    words (the last 64 ids stay padding, as a checkpoint's logits pad its tokenizer's)."""
    tok = json.loads(src.read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    rng, letters, n = random.Random(0), "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", len(vocab)
    while n < vocab_size - 64:
        word = ("Ġ" if rng.random() < 0.5 else "") + "".join(rng.choices(letters, k=rng.randint(2, 9)))
        if word not in vocab:
            vocab[word], n = n, n + 1
    dst.write_text(json.dumps(tok))
    return dst


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


# ------------------------------------------------------------------ TPOT
def baseline_module(rev: str) -> types.ModuleType:
    """shared/engine/structured.py as of git revision `rev` (its Grammars beside this tree's: a
    before/after comparison inside one run)."""
    source = subprocess.run(["git", "show", f"{rev}:shared/engine/structured.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    name = f"_structured_{rev.replace('~', '_').replace('^', '_')}"
    module = types.ModuleType(name)
    _sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:shared/engine/structured.py", "exec"), module.__dict__)  # noqa: S102
    return module


class StepTimer:
    """Times each `engine.step` that `LLM.generate` calls, and `Grammars.mask` and
    `GrammarState.advance` inside them; `grammars` replaces the engine's for the run."""

    def __init__(self, llm: LLM, grammars: Grammars | None):
        self.engine, self.steps, self.masks, self.mask_rows, self.advance_s = llm.engine, [], [], 0, 0.0
        self.own_grammars = self.engine.grammars
        grammars = grammars or self.own_grammars
        self.state_class = _sys.modules[type(grammars).__module__].GrammarState
        step, mask, advance = self.engine.step, grammars.mask, self.state_class.advance

        def timed_step(*a, **k):
            t0 = time.perf_counter()
            events = step(*a, **k)
            self.steps.append((time.perf_counter() - t0, events))
            return events

        def timed_mask(logits, rows):
            t0 = time.perf_counter()
            mask(logits, rows)
            self.masks.append(time.perf_counter() - t0)
            self.mask_rows += len(rows)

        def timed_advance(state, token):
            t0 = time.perf_counter()
            out = advance(state, token)
            self.advance_s += time.perf_counter() - t0
            return out

        self.engine.grammars = grammars
        self.engine.step, grammars.mask = timed_step, timed_mask
        self.grammars, self._advance, self.state_class.advance = grammars, advance, timed_advance

    def close(self) -> None:
        del self.engine.step, self.grammars.mask  # the classes' methods again
        self.state_class.advance = self._advance
        self.engine.grammars = self.own_grammars

    def decode_steps(self, n_requests: int) -> list[float]:
        """Seconds of each step after every request had its first token (each gives every request one)."""
        seen: set[str] = set()
        times = []
        for dt, events in self.steps:
            if len(seen) == n_requests:
                times.append(dt)
            seen.update(e.seq.request_id for e in events)
        return times


def run_tpot(llm: LLM, prompts: list[list[int]], params: SamplingParams, grammars: Grammars | None) -> dict:
    timer = StepTimer(llm, grammars)
    try:
        outs = llm.generate(prompts, params)
    finally:
        timer.close()
    steps = timer.decode_steps(len(prompts))
    lengths = [len(o.token_ids) for o in outs]
    per_request = sum(n - 1 for n in lengths) / len(lengths)  # tokens after the first, mean over requests
    if params.structured is not None:
        opening = '{"verses":["'
        for o in outs:  # the output follows the schema: the object and its array opened
            assert o.text is None or o.text.startswith(opening) or opening.startswith(o.text), o.text
    return {"p50_ms": 1000 * statistics.median(steps), "mean_ms": 1000 * sum(steps) / max(per_request, 1),
            "lengths": (min(lengths), max(lengths)), "finish": {o.finish_reason for o in outs},
            "mask_ms": 1000 * statistics.median(timer.masks) if timer.masks else 0.0,
            "mask_us_row": 1e6 * sum(timer.masks) / max(timer.mask_rows, 1),
            "advance_us_token": 1e6 * timer.advance_s / max(sum(lengths), 1)}


def bench_tpot(args, llm: LLM, baselines: dict[str, Grammars]) -> tuple[list[list[object]], dict[str, list[float]],
                                                                    dict[int, float]]:
    batches = [int(b) for b in args.batches.split(",")]
    vocab = llm.engine.model_config.vocab_size
    schema = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(TPOT_SCHEMA))
    free = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    constrained = dataclasses.replace(free, structured=schema)
    variants: dict[str, tuple[SamplingParams, Grammars | None]] = {"free": (free, None), "json": (constrained, None)}
    for rev, grammars in baselines.items():
        variants[f"json ({rev} mask)"] = (constrained, grammars)
    prompts = {b: prompts_for(llm, b, args.prompt_len, vocab) for b in batches}
    for params, grammars in variants.values():  # warm: first steps, the schema compiled
        run_tpot(llm, prompts[batches[-1]][:4], dataclasses.replace(params, max_tokens=4), grammars)
    results: dict[tuple[int, str], list[dict]] = {(b, v): [] for b in batches for v in variants}
    ratios: dict[tuple[int, str], list[float]] = {(b, v): [] for b in batches for v in variants}
    others: dict[int, list[float]] = {b: [] for b in batches}  # other programs' cores, per round
    for r in range(args.rounds):
        if args.quiet_below > 0:
            wait_quiet(args.quiet_below, args.quiet_wait)
        for b in batches:
            load = ForeignLoad()
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]  # ABBA over rounds
            for v in order:
                res = run_tpot(llm, prompts[b], *variants[v])
                results[b, v].append(res)
                print(f"round {r} batch {b:3d} {v:>4}: TPOT p50 {res['p50_ms']:6.2f} ms, mean {res['mean_ms']:6.2f} "
                      f"ms, mask p50 {res['mask_ms']:.3f} ms, tokens {res['lengths']}, {res['finish']}",
                      file=_sys.stderr, flush=True)
            for v in variants:
                ratios[b, v].append(results[b, v][-1]["p50_ms"] / results[b, "free"][-1]["p50_ms"])
            others[b].append(load.cores())
    rows, tpots, overhead = [], {v: [] for v in variants}, {}
    for b in batches:
        # the rounds in which other programs stayed under --quiet-below cores; all when none did
        quiet = [r for r, c in enumerate(others[b]) if c < args.quiet_below] or list(range(args.rounds))
        for v in variants:
            res, free_res, rat = ([xs[r] for r in quiet] for xs in (results[b, v], results[b, "free"], ratios[b, v]))
            tpots[v].append(statistics.median(x["p50_ms"] for x in res))
            ratio = statistics.median(rat)
            if v == "json":
                overhead[b] = ratio - 1
            mean_ratio = statistics.median(x["mean_ms"] / f["mean_ms"] for x, f in zip(res, free_res))
            rows.append([b, v, f"{len(quiet)}/{args.rounds}", f"{tpots[v][-1]:.2f}",
                         f"{statistics.median(x['mean_ms'] for x in res):.2f}",
                         f"{ratio:.3f}", f"{min(rat):.2f}-{max(rat):.2f}",
                         f"{100 * (ratio - 1):+.1f}%", f"{mean_ratio:.3f}",
                         f"{statistics.median(x['mask_ms'] for x in res):.3f}" if v != "free" else "-",
                         f"{statistics.median(x['mask_us_row'] for x in res):.1f}" if v != "free" else "-",
                         f"{statistics.median(x['advance_us_token'] for x in res):.1f}" if v != "free" else "-",
                         "/".join(f"{lo}-{hi}" for lo, hi in sorted({x["lengths"] for x in res})),
                         ",".join(sorted(set().union(*(x["finish"] for x in res))))])
    for b in batches:
        print(f"batch {b}: others' CPU during each round {', '.join(f'{c:.2f}' for c in others[b])} cores", flush=True)
    return rows, tpots, overhead


# ------------------------------------------------------------------ compile
def bench_compile(args, vocabularies: dict[str, tuple[Path, int]]) -> list[list[object]]:
    rows = []
    for schema_name, schema in compile_schemas().items():
        constraint = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
        row: list[object] = [schema_name, len(constraint.spec)]
        for tokenizer, size in vocabularies.values():
            row += compile_times(constraint, tokenizer, size, args.compile_repeat)
        rows.append(row)
    return rows


def compile_times(constraint: StructuredOutput, tokenizer: Path, size: int, repeat: int) -> list[str]:
    """First compile, median cold compile (ms), median cached `matcher` (µs)."""
    built = grammar_vocabulary_cached(tokenizer, size)

    def cold() -> ConstraintCompiler:
        protocol_structured._grammar.cache_clear()  # the schema's grammar text too
        compiler = ConstraintCompiler(tokenizer, size, [1])
        compiler._vocabulary = built  # the vocabulary is built once per process
        compiler.matcher(constraint)
        return compiler

    first = median_ms(cold, 1)  # the very first compile of this schema at this vocabulary
    cold_ms = median_ms(cold, repeat)
    compiler = cold()
    cached_us = 1000 * median_ms(lambda: compiler.matcher(constraint), 50)
    return [f"{first:.1f}", f"{cold_ms:.1f}", f"{cached_us:.0f}"]


_VOCABS: dict[tuple[str, int], llguidance.LLTokenizer] = {}


def grammar_vocabulary_cached(tokenizer: Path, size: int) -> llguidance.LLTokenizer:
    key = (str(tokenizer), size)
    if key not in _VOCABS:
        t0 = time.perf_counter()
        _VOCABS[key] = protocol_structured.grammar_vocabulary(tokenizer, size, [1])
        print(f"vocabulary {size:,}: built in {time.perf_counter() - t0:.2f} s", flush=True)
    return _VOCABS[key]


# ------------------------------------------------------------------ mask
MASK_STATES = {"start": "", "in string": '{"verses":["And the', "between items": '{"verses":["And the LORD said"'}


def bench_mask(args, vocabularies: dict[str, tuple[Path, int]], baselines: dict[str, types.ModuleType]
               ) -> list[list[object]]:
    batches = [int(b) for b in args.batches.split(",")]
    schema = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(TPOT_SCHEMA))
    rows = []
    for label, (tokenizer, size) in vocabularies.items():
        compiler = ConstraintCompiler(tokenizer, size, [1])
        compiler._vocabulary = grammar_vocabulary_cached(tokenizer, size)
        codes = {"this tree": Grammars(compiler, None)}
        for rev, module in baselines.items():
            codes[rev] = module.Grammars(compiler, None)
        for state_name, prefix in MASK_STATES.items():
            ids = compiler.vocabulary.tokenize_str(prefix)
            for b in batches:
                states = [codes["this tree"].start(schema) for _ in range(b)]
                for s in states:
                    assert s.matcher.consume_tokens(ids), prefix
                mask_rows = [MaskRow(s, i) for i, s in enumerate(states)]
                with torch.inference_mode():
                    logits = torch.randn(b, size)
                jobs = [(s.matcher, i) for i, s in enumerate(states)]
                allowed = llguidance.torch.allocate_token_bitmask(b, size)
                llguidance.torch.fill_next_token_bitmask_par(codes["this tree"].executor, jobs, allowed)
                frac = sum(bin(w & 0xFFFFFFFF).count("1") for w in allowed.view(-1).tolist()) / (b * size)
                times: dict[str, list[float]] = {code: [] for code in codes}
                fills = []
                for _ in range(args.mask_repeat):  # the implementations alternate
                    for code, grammars in codes.items():
                        times[code].append(median_ms(lambda: grammars.mask(logits, mask_rows), 1))  # noqa: B023
                    fills.append(median_ms(lambda: llguidance.torch.fill_next_token_bitmask_par(  # noqa: B023
                        codes["this tree"].executor, jobs, allowed), 1))  # noqa: B023
                fill = statistics.median(fills)
                row = [label, state_name, f"{frac:.3f}", b, f"{fill:.3f}"]
                for code in codes:
                    total = statistics.median(times[code])
                    row += [f"{total:.3f}", f"{total - fill:.3f}", f"{1000 * total / b:.1f}"]
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/demo-v32")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mask-vocab", default=f"model,{REAL_VOCAB}",
                   help="vocabularies for the compile and mask tables: `model` and/or sizes to pad to")
    p.add_argument("--compile-repeat", type=int, default=5)
    p.add_argument("--mask-repeat", type=int, default=20)
    p.add_argument("--quiet-below", type=float, default=0.3, help="wait until others use fewer cores (0: no wait)")
    p.add_argument("--quiet-wait", type=float, default=10, help="at most this many seconds per wait")
    p.add_argument("--baseline-mask", metavar="GIT_REV[,GIT_REV]", default="",
                   help="also run shared/engine/structured.py of these revisions (TPOT and mask tables)")
    p.add_argument("--skip-tpot", action="store_true")
    args = p.parse_args(argv)

    llm = LLM(args.model, dtype=args.dtype)
    model_vocab = llm.engine.model_config.vocab_size
    tokenizer = Path(args.model) / "tokenizer.json"
    tmp = Path(tempfile.mkdtemp())
    vocabularies: dict[str, tuple[Path, int]] = {}
    for v in args.mask_vocab.split(","):
        if v == "model":
            vocabularies[f"{model_vocab:,} (model)"] = (tokenizer, model_vocab)
        else:
            size = int(v)
            vocabularies[f"{size:,} (padded)"] = (real_vocab_tokenizer(tokenizer, size, tmp / f"tok{size}.json"), size)
    print(f"{Path(args.model).name} {args.dtype}, {torch.get_num_threads()} threads, llguidance "
          f"{llguidance.get_version() if hasattr(llguidance, 'get_version') else '?'}; "
          f"mask code: {engine_structured.__file__}", flush=True)

    baselines = {rev: baseline_module(rev) for rev in args.baseline_mask.split(",") if rev}
    if not args.skip_tpot:
        own = llm.engine.grammars
        rows, tpots, overhead = bench_tpot(args, llm, {rev: m.Grammars(own.compiler, own.reasoning_end)
                                                       for rev, m in baselines.items()})
        print(f"\nDecode TPOT, free vs JSON schema ({args.new_tokens} tokens/request, greedy, ignore_eos, "
              f"{args.rounds} alternating rounds): TPOT p50 = median decode step (each gives every request a "
              "token), mean = decode time / tokens after the first; / free = median over rounds of the round's "
              f"p50 ratio; over the rounds in which others used < {args.quiet_below} cores (all if none)")
        print(table(["batch", "variant", "quiet rounds", "TPOT p50 ms", "mean ms", "/ free", "rounds", "overhead",
                     "mean / free", "mask ms/step", "mask µs/row", "advance µs/tok", "tokens", "finish"], rows))
        batches = [int(b) for b in args.batches.split(",")]
        path = bar_plot(OUT / "structured.png",
                        f"Decode TPOT, JSON schema vs free ({Path(args.model).name}, {args.dtype}); "
                        + ", ".join(f"b{b} {100 * overhead[b]:+.0f}%" for b in batches),
                        [f"batch {b}" for b in batches],
                        {("JSON schema" if v == "json" else v): t for v, t in tpots.items()}, "TPOT p50 ms")
        print(f"plot: {path}")

    print("\nGrammar compile: first (cold), cold median, cached (validate + deep copy), per vocabulary")
    headers = ["schema", "bytes"]
    for label in vocabularies:
        headers += [f"first ms {label}", "cold ms", "cached µs"]
    print(table(headers, bench_compile(args, vocabularies)))

    print("\nGrammars.mask per step ([batch, vocab] fp32 logits, all rows constrained, median of "
          f"{args.mask_repeat}): total = llguidance fill + apply (unpack + masked fill)")
    headers = ["vocab", "state", "allowed", "batch", "fill ms"]
    for code in ["this tree", *baselines]:
        headers += [f"total ms {code}", "apply ms", "µs/row"]
    print(table(headers, bench_mask(args, vocabularies, baselines)))


if __name__ == "__main__":
    main()
