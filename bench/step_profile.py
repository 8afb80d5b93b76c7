"""Where a decode step goes: kernels by kind against host time, per batch size.

    python bench/step_profile.py [--batches 1,64,256] [--prompt-len 128] [--steps 16] [--dtype bfloat16]
                                 [--model-type deepseek_v3] [--threads 0] [--label NAME] [--enforce-eager]

The model is engine_throughput's tiny DeepSeek (the same checkpoint vLLM's CPU build runs). Per batch size the
engine prefills the batch, then decodes: `--steps` steps timed plainly (the step's wall time), then as many
under torch.profiler, where each op's own time is sorted into

* **matmul** — aten mm / addmm / bmm / grouped mm / int8 mm and the C matmuls (decode linears, absorbed
  heads, W8A8), wherever they run;
* **attention**, **indexer**, **MoE**, **sampling**, **other compute** — every other op's own time inside that
  part of the step (the MLA module, the indexer, the MoE block, the sampler), the C kernels' (paged attention,
  index scores, KV writes, routed experts, norms: each ctypes call) included;
* **copies and gathers** (copy_, to, index, gather, cat, clone, contiguous, ...) and **allocation** (empty,
  zeros, full, ...), wherever they run;
* **host** — the step's wall time less every op's own time: Python, dispatch, the engine's bookkeeping.

With `--enforce-eager` the shares are the profiled steps'; the ms are those shares of the plain steps' median
(the profiler slows the host part, so its share is an upper bound). As the engine ships, plain decode steps replay
a recorded step (shared.engine.graphs): the same kernels and ops without the host code around them, which the
profiler cannot see into; the parts are then the time the replayed calls take (each timed) split as the eager
steps' own times (profiled with the recordings set aside), and host is what the replayed steps' median wall time
leaves. Prints a table and saves bench/out/step_profile[-LABEL].png (stacked ms per part and batch) and .json (to
compare a later run: `--label after`).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import OUT, eager_steps, proxy_shapes, table
from bench.peers import VLLM_CONFIG
from shared.engine import LLM, SamplingParams
from shared.loader.tiny import write_checkpoint

PARTS = ("matmul", "attention", "indexer", "MoE", "sampling", "other compute", "copies and gathers", "allocation",
         "host")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_int_mm",
          "aten::_weight_int8pack_mm"}
MOVES = {"aten::copy_", "aten::_to_copy", "aten::index", "aten::index_select", "aten::gather", "aten::cat",
         "aten::clone", "aten::contiguous", "aten::index_put_", "aten::_index_put_impl_", "aten::scatter_",
         "aten::scatter", "aten::stack", "aten::repeat_interleave", "aten::masked_select", "aten::take"}
ALLOCS = {"aten::empty", "aten::empty_strided", "aten::zeros", "aten::full", "aten::new_empty", "aten::empty_like",
          "aten::new_zeros", "aten::zeros_like", "aten::resize_", "aten::ones", "aten::arange"}
SCOPES = {"pdserve.attention": "attention", "pdserve.indexer": "indexer", "pdserve.moe": "MoE",
          "pdserve.sampling": "sampling"}
KERNEL_PREFIX = "pdserve.kernel."  # a C kernel's scope: its own time is compute of the part it runs in ...
C_MATMULS = {"linear_rows", "linear_rows_many", "dots_bf16", "head_matmul", "w8a8_matmul"}  # ... or matmul


def _scoped(stack: ExitStack, owner: object, name: str, label: str) -> None:
    """Wrap owner.name in a profiler scope for the run (restored when `stack` closes)."""
    fn = getattr(owner, name)

    def scoped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    setattr(owner, name, scoped)
    stack.callback(setattr, owner, name, fn)


def instrument(stack: ExitStack, llm: LLM) -> None:
    """Scopes for the step's parts (module instances) and the C kernels (each ctypes entry point of the built
    kernel libraries: its own time is the kernel's; the Python wrapper around it stays host time)."""
    import ctypes

    import shared.model.cpu_kernels as cpu_kernels
    import shared.model.int8_kernels as int8_kernels
    from shared.model.indexer import Indexer
    from shared.model.mla import MLA
    from shared.model.moe import MoE

    for module in llm.engine.model.modules():
        for cls, label in ((MLA, "pdserve.attention"), (Indexer, "pdserve.indexer"), (MoE, "pdserve.moe")):
            if isinstance(module, cls):
                _scoped(stack, module, "forward", label)
    _scoped(stack, llm.engine, "sample", "pdserve.sampling")
    for mod in (cpu_kernels, int8_kernels):
        lib = mod.library()
        for name, fn in list(vars(lib).items()) if lib is not None else []:
            if isinstance(fn, ctypes._CFuncPtr):
                _scoped(stack, lib, name, KERNEL_PREFIX + name)


def _part_of(event) -> str:
    """The step part an op runs in: its innermost part scope (attention, indexer, MoE, sampling) or other."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in SCOPES:
            return SCOPES[parent.name]
        parent = parent.cpu_parent
    return "other compute"


def classify(events) -> dict[str, float]:
    """Seconds of own time per part (host excluded) over a profile's events."""
    out: dict[str, float] = defaultdict(float)
    for ev in events:
        own = ev.self_cpu_time_total / 1e6
        if ev.name in SCOPES or ev.name == "ProfilerStep*":
            continue  # a scope's own time is the Python around its ops: host
        if ev.name.startswith(KERNEL_PREFIX):  # the C kernel's own time (its aten children counted on their own)
            out["matmul" if ev.name.removeprefix(KERNEL_PREFIX) in C_MATMULS else _part_of(ev)] += own
        elif ev.name in MATMUL:
            out["matmul"] += own
        elif ev.name in MOVES:
            out["copies and gathers"] += own
        elif ev.name in ALLOCS:
            out["allocation"] += own
        elif ev.name.startswith("aten::"):
            out[_part_of(ev)] += own
    return out


def replayed_calls_ms(eng, steps: int) -> float:
    """Median ms per step spent inside the calls of the replayed recordings (kernels and torch ops), each timed."""
    from shared.model import tape

    spent: list[float] = []

    def timed(self) -> None:
        inside = 0.0
        with torch.inference_mode():
            for call in self.calls:
                t0 = time.perf_counter()
                call()
                inside += time.perf_counter() - t0
        spent.append(inside)

    plain, tape.Tape.replay = tape.Tape.replay, timed
    try:
        for _ in range(steps):
            eng.step()
    finally:
        tape.Tape.replay = plain
    return 1e3 * statistics.median(spent) if spent else 0.0


def profile_batch(llm: LLM, batch: int, prompt_len: int, steps: int) -> tuple[float, dict[str, float]]:
    """(median ms per decode step, ms per part) at a batch size."""
    eng = llm.engine
    params = SamplingParams(max_tokens=4 * steps + 4, temperature=0.0, ignore_eos=True)
    vocab = min(1000, eng.model_config.vocab_size)
    seqs = [eng.add_request(torch.randint(2, vocab, (prompt_len,)).tolist(), params) for _ in range(batch)]
    while any(not s.output_token_ids for s in seqs):
        eng.step()
    for _ in range(2):
        eng.step()
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        wall.append(time.perf_counter() - t0)
    graphs = eng.graphs
    with ExitStack() as stack, eager_steps(eng):
        instrument(stack, llm)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            profiled = time.perf_counter() - t0
    calls_ms = replayed_calls_ms(eng, steps) if graphs is not None else 0.0
    while eng.has_work:
        eng.step()
    own = classify(prof.events())
    step_ms = 1e3 * statistics.median(wall)
    if calls_ms > 0:  # replayed: the recorded calls' own time split as the eager ops', sampling as it ran
        # (a key whose recording was refused, past graph_memory_mb at a large model's batch, ran eagerly: below)
        sampling = 1e3 * own.get("sampling", 0.0) / steps  # after the forward, outside the recording
        total = sum(v for k, v in own.items() if k != "sampling")
        inside = min(calls_ms, step_ms - sampling)  # (each call's timer costs a little: never past the wall)
        parts = {part: inside * own.get(part, 0.0) / total for part in PARTS if part != "sampling"}
        parts.update(sampling=sampling, host=max(0.0, step_ms - inside - sampling))
        return step_ms, parts
    own["host"] = max(0.0, profiled - sum(own.values()))
    total = sum(own.values())
    return step_ms, {part: step_ms * own.get(part, 0.0) / total for part in PARTS}


def stacked_plot(path: Path, title: str, batches: list[int], parts: list[dict[str, float]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(batches)
    labels = [str(b) for b in batches]
    for part in PARTS:
        values = [p[part] for p in parts]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("batch (requests decoding)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed, then as many profiled")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-type", default="deepseek_v3", choices=["deepseek_v3", "deepseek_v32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--hidden", type=int, default=0, help="a proxy of DeepSeek-V3's layer shapes at this hidden size "
                                                         "(bench.common.proxy_shapes) instead of the tiny model")
    p.add_argument("--label", default="", help="suffix of the output files (e.g. before / after)")
    p.add_argument("--enforce-eager", action="store_true", help="every step eagerly (default: plain decode steps "
                                                                "replay recorded ones, as the engine ships)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"index_topk": 64} if args.model_type == "deepseek_v32" else VLLM_CONFIG
        extra = {**extra, **proxy_shapes(args.hidden)} if args.hidden else extra
        path = write_checkpoint(Path(tmp) / args.model_type, args.model_type, tokenizer=False, **extra)
        llm = LLM(str(path), dtype=args.dtype, max_num_seqs=max(batches), enforce_eager=args.enforce_eager)
        results = []
        for batch in batches:
            print(f"batch {batch} ...", flush=True)
            results.append(profile_batch(llm, batch, args.prompt_len, args.steps))
    rows = []
    for batch, (step_ms, parts) in zip(batches, results):
        rows.append([batch, f"{step_ms:.2f}", *(f"{parts[x]:.2f}" for x in PARTS), f"{parts['host'] / step_ms:.0%}",
                     f"{batch / step_ms * 1e3:,.0f}"])
    print(f"\n{args.model_type}, {args.dtype}, {args.prompt_len}-token prompts, {torch.get_num_threads()} threads: "
          f"ms per decode step by part (own time; host = wall less every op's own time)")
    print(table(["batch", "step ms", *PARTS, "host share", "tok/s"], rows))
    suffix = f"-{args.label}" if args.label else ""
    OUT.mkdir(parents=True, exist_ok=True)
    out = {"batches": batches, "step_ms": [r[0] for r in results], "parts": [r[1] for r in results],
           "model_type": args.model_type, "dtype": args.dtype, "threads": torch.get_num_threads()}
    (OUT / f"step_profile{suffix}.json").write_text(json.dumps(out, indent=1))
    png = stacked_plot(OUT / f"step_profile{suffix}.png", f"decode step by part ({args.model_type}, {args.dtype})",
                       batches, [r[1] for r in results])
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
