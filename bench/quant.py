"""Quantization: weight and KV memory in bf16 vs W8A8 / C8 — analytic for the real 671B config, measured
on a tiny model — and the throughput of W8A8 and C8 vs bf16 on this machine.

    python bench/quant.py [--batches 1,16,64] [--prompt-len 64] [--new-tokens 64] [--repeat 3]
                          [--hidden 1024] [--threads N] [--ep 32] [--context 131072] [--no-breakdown]

1. Analytic, real DeepSeek-V3.2 config (shared.loader.synthetic.REAL_671B, main model without the MTP
   layer): every tensor's shape comes from the model built on the meta device (nothing allocated).
   bf16 holds each tensor as the model keeps it: bf16, except lm_head, the final norm, the indexer's
   weights_proj and the router bias, which DeepSeek keeps in fp32. FP8 is DeepSeek's release: the
   linears it ships in FP8 e4m3 take 1 byte + one fp32 scale per 128×128 block. W8A8 (shared.quant.int8):
   `is_w8a8_target` tensors take 1 byte + one fp32 scale per output channel. Everything else as bf16.
   EP rank: the routed experts split over `--ep` ranks, the rest replicated. KV per token via KVLayout
   (bf16 rows vs C8), over all layers, and per request at `--context` tokens.
2. Measured: the tiny model (models/tiny-v32, hidden 256; with `--hidden H` a generated one with hidden H,
   moe_intermediate H/2, intermediate 2H) loaded in bf16 with quantization none / w8a8 and KV auto / int8:
   bytes of every parameter, buffer and tensor attribute (MLA's absorbed w_uk / w_uv_t), and KV bytes
   per token of the allocated pools.
3. Throughput of the same four engines — bf16, W8A8, W8A8+C8, C8 — batch by batch, configurations
   alternating (order reversed on every repeat, best of `--repeat`): prefill tok/s (the steps until every
   prompt has its first token) and decode tok/s (median step of the rest). Greedy, ignore_eos, no prefix
   cache. One torch thread by default: the ratios are what this measures, and on a shared 2-core machine a
   second OpenMP thread makes every op wait for whichever core another process holds (steps 10-20x slower,
   measured); `--threads 0` for torch's default. The 1-minute load average before and after is printed, and
   the instruction set the W8A8 kernels multiply with (AVX-512 VNNI, AVX2 or portable C).
   Prints the tables and saves bench/out/quant.png (quant_h{H}.png with --hidden).
4. Where a decode step goes (`--no-breakdown` skips it): at the largest batch, each configuration once more
   (alternating, twice, the faster kept) with timers on the model's ops (bench.common.decode_parts: linears,
   W8A8 linears, MoE, attention, the indexer's top-k, the absorbed heads, the rest), and from the bf16 step
   what each option can gain at most: W8A8 with its linears and experts free, C8 with attention and the
   indexer bound by bytes alone (its KV bytes ratio applied to them).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    OUT,
    ROOT,
    STEP_PARTS,
    MachineLimits,
    TokenCost,
    against_limits,
    fastest_parts,
    kernels_used,
    kv_read_bound,
    table,
)
from shared.config import ModelConfig
from shared.device import compute_dtype
from shared.engine import LLM, SamplingParams
from shared.kvcache import KVLayout
from shared.loader.synthetic import REAL_671B
from shared.loader.tiny import _FP8_SKIP, ensure_tiny_model, write_checkpoint
from shared.model import DeepseekForCausalLM
from shared.quant.int8 import is_w8a8_target

GiB, MiB = 1 << 30, 1 << 20
FP8_BLOCK = 128
# name: (quantization, kv_cache_dtype)
CONFIGS = {"bf16": ("none", "auto"), "W8A8": ("w8a8", "auto"), "W8A8+C8": ("w8a8", "int8"), "C8": ("none", "int8")}
_ROUTED = re.compile(r"\.mlp\.experts\.")


# ---------------------------------------------------------------- 1. analytic, real config


def real_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], int]]:
    """(checkpoint name, shape, bytes per element as the model keeps it) of every tensor, from the model
    built on the meta device (no storage)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, torch.bfloat16, device=torch.device("meta"))
    return [(name, tuple(p.shape), p.element_size()) for name, p in model.named_parameters()]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_bytes(name: str, shape: tuple[int, ...], elem: int, fmt: str) -> int:
    numel = _numel(shape)
    if fmt == "fp8" and len(shape) >= 2 and not _FP8_SKIP.search(name):
        rows, cols = shape[-2:]
        blocks = _numel(shape[:-2]) * -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
        return numel + 4 * blocks
    if fmt == "w8a8" and is_w8a8_target(name):
        return numel + 4 * (numel // shape[-1])  # one fp32 scale per output channel
    return numel * elem


def analytic_weights(cfg: ModelConfig, ep: int) -> tuple[list[list[object]], dict[str, float]]:
    tensors = real_tensors(cfg)
    params = sum(_numel(s) for _, s, _ in tensors)
    routed_params = sum(_numel(s) for n, s, _ in tensors if _ROUTED.search(n))
    fp32 = [(n, _numel(s)) for n, s, e in tensors if e == 4]
    rows, base = [], 0
    for fmt, label in (("bf16", "bf16 (model's own: lm_head etc. fp32)"), ("fp8", "FP8 release (128x128 scales)"),
                       ("w8a8", "W8A8 (per-channel scales)")):
        total = sum(tensor_bytes(n, s, e, fmt) for n, s, e in tensors)
        routed = sum(tensor_bytes(n, s, e, fmt) for n, s, e in tensors if _ROUTED.search(n))
        rest = total - routed
        base = base or total
        rows.append([label, total / GiB, routed / GiB, rest / GiB, (routed / ep + rest) / GiB,
                     f"{total / base:.2f}x"])
    info = {"params": params / 1e9, "routed": routed_params / 1e9, "fp32": sum(n for _, n in fp32) / 1e9}
    return rows, info


def analytic_kv(cfg: ModelConfig, context: int) -> list[list[object]]:
    rows, base = [], 0
    for label, kv_dtype in (("bf16", "auto"), ("C8 (int8 latent, FP8 index key)", "int8")):
        layout = KVLayout.from_model_config(cfg, 64, torch.bfloat16, kv_cache_dtype=kv_dtype)
        per_token = layout.bytes_per_token()
        base = base or per_token
        rows.append([label, layout.mla_bytes_per_token, layout.index_bytes_per_token,
                     layout.bytes_per_token_per_layer(), f"{per_token:,}", per_token * context / GiB,
                     f"{per_token / base:.2f}x"])
    return rows


# ---------------------------------------------------------------- 2. measured


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and plain tensor attributes of modules (MLA's absorbed w_uk / w_uv_t)."""
    out = list(model.named_parameters()) + list(model.named_buffers())
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not key.startswith("_"):
                out.append((f"{prefix}.{key}", value))
    return out


def weight_bytes(model: DeepseekForCausalLM) -> tuple[int, int, dict[torch.dtype, int]]:
    """(allocated bytes, bytes as bf16-capable hardware would hold them, allocated bytes per dtype)."""
    allocated, native, by_dtype = 0, 0, {}
    kv_b = {f"{prefix}.{key}": getattr(m, "kv_b_dtype", None) for prefix, m in model.named_modules()
            for key in ("w_uk", "w_uv_t")}
    for name, t in model_tensors(model):
        size = t.numel() * t.element_size()
        allocated += size
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + size
        held = model.stored_dtypes.get(name) or kv_b.get(name) or t.dtype
        native += t.numel() * held.itemsize
    return allocated, native, by_dtype


def kv_bytes_per_token(llm: LLM) -> tuple[float, int]:
    """(allocated pool bytes per token, bytes per token of the same layout with bf16 rows)."""
    eng = llm.engine
    kv, layout = eng.kv, eng.layout
    pools = [p for p in (kv.mla, kv.index) if p is not None]
    allocated = sum(p.numel() * p.element_size() for p in pools) / (kv.num_blocks * layout.block_size)
    native = KVLayout.from_model_config(eng.model_config, layout.block_size, eng.dtype,
                                        kv_cache_dtype=layout.kv_cache_dtype).bytes_per_token()
    return allocated, native


def measured_rows(engines: dict[str, LLM]) -> list[list[object]]:
    rows = []
    base = None
    for name, llm in engines.items():
        allocated, native, by_dtype = weight_bytes(llm.engine.model)
        kv_alloc, kv_native = kv_bytes_per_token(llm)
        base = base or (allocated, native, kv_alloc, kv_native)
        split = " / ".join(f"{str(d).removeprefix('torch.')} {b / MiB:.1f}" for d, b in
                           sorted(by_dtype.items(), key=lambda kv: -kv[1]))
        rows.append([name, allocated / MiB, f"{allocated / base[0]:.2f}x", split, native / MiB,
                     f"{native / base[1]:.2f}x", f"{kv_alloc:,.0f}", f"{kv_native:,}", f"{kv_native / base[3]:.2f}x"])
    return rows


# ---------------------------------------------------------------- 3. throughput


def run_once(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s). Prefill: prompt tokens over the time of the steps until every prompt
    has its first token. Decode: the median over the remaining steps of tokens / step time (robust to
    other processes' bursts on a shared machine)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in prompts]
    started: set[str] = set()
    prefill_s, decode = 0.0, []
    while eng.has_work:
        in_prefill = len(started) < len(seqs)
        t0 = time.perf_counter()
        events = eng.step()
        dt = time.perf_counter() - t0
        if in_prefill:
            prefill_s += dt
        elif events:
            decode.append(len(events) / dt)
        started.update(ev.seq.request_id for ev in events)
    assert all(len(s.output_token_ids) == new_tokens for s in seqs)
    return sum(map(len, prompts)) / prefill_s, statistics.median(decode) if decode else 0.0


def breakdown(engines: dict[str, LLM], batch: int, prompt_len: int, new_tokens: int, vocab: int
              ) -> tuple[list[list[object]], list[str]]:
    """The decode step's parts per configuration (configurations alternating, twice, the faster run kept) and
    what each option could gain at most: W8A8 rewrites the quantized linears and the experts, C8 what attention
    and the indexer read."""
    prompts = torch.randint(2, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
    runs = fastest_parts(engines, prompts, new_tokens)
    rows = []
    for name, (step, parts) in runs.items():
        rest = step - sum(parts.values())
        rows.append([name, f"{step:.2f}", *(f"{ms:.2f} ({100 * ms / step:.0f}%)" for ms in parts.values()),
                     f"{rest:.2f} ({100 * rest / step:.0f}%)"])
    (bf16, b), (w8, w) = runs["bf16"], runs["W8A8"]
    linears = "linears (bf16 / fp32)"
    touched = b[linears] - w[linears] + b["MoE"]  # W8A8 leaves the other linears (fp32 head, indexer wk) as they are
    own = w["W8A8 linears"] + w["MoE"]
    kv_ratio = engines["C8"].engine.layout.bytes_per_token() / engines["bf16"].engine.layout.bytes_per_token()
    read, most = kv_read_bound(bf16, b, kv_ratio)
    notes = [
        f"W8A8 replaces {touched:.2f} ms of the {bf16:.2f} ms bf16 step ({100 * touched / bf16:.0f}%: the quantized "
        f"linears and the experts). Were they free, W8A8 would decode at most {bf16 / (bf16 - touched):.2f}x bf16; "
        f"they take {own:.2f} ms in int8 ({touched / own:.2f}x faster than in bf16), and the step "
        f"{w8:.2f} ms: {bf16 / w8:.2f}x.",
        f"C8 changes what attention and the indexer's top-k read: {read:.2f} ms of the bf16 step "
        f"({100 * read / bf16:.0f}%). Were those bound by bytes alone, C8's {kv_ratio:.2f}x bytes would make it at "
        f"most {most:.2f}x bf16; measured here {bf16 / runs['C8'][0]:.2f}x."]
    return rows, notes


def throughput(engines: dict[str, LLM], batches: list[int], prompt_len: int, new_tokens: int, repeat: int,
               vocab: int) -> dict[str, dict[int, tuple[float, float]]]:
    results: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in engines}
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = torch.randint(2, vocab, (batch, prompt_len), generator=gen).tolist()
        for r in range(repeat):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                pre, dec = run_once(engines[name], prompts, new_tokens)
                best = results[name].get(batch, (0.0, 0.0))
                results[name][batch] = (max(best[0], pre), max(best[1], dec))
                print(f"  batch {batch:3d} repeat {r + 1}: {name:8s} prefill {pre:9,.0f} tok/s  decode {dec:8,.0f} "
                      f"tok/s", flush=True)
    return results


def throughput_rows(results: dict[str, dict[int, tuple[float, float]]], batches: list[int]) -> list[list[object]]:
    rows = []
    for batch in batches:
        base = results["bf16"][batch]
        for name, per_batch in results.items():
            pre, dec = per_batch[batch]
            rows.append([batch, name, pre, f"{pre / base[0]:.2f}x", dec, f"{dec / base[1]:.2f}x" if base[1] else "-"])
    return rows


def plot(path: Path, title: str, results: dict[str, dict[int, tuple[float, float]]], batches: list[int]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(results)
    for ax, phase, label in ((axes[0], 1, "decode"), (axes[1], 0, "prefill")):
        for i, (name, per_batch) in enumerate(results.items()):
            xs = [x + i * width for x in range(len(batches))]
            bars = ax.bar(xs, [per_batch[b][phase] for b in batches], width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks([x + width * (len(results) - 1) / 2 for x in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set(title=f"{label} tok/s", ylabel="tokens/s")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n != 1 else ''}"


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="runs per (batch, configuration); the best counts")
    p.add_argument("--hidden", type=int, default=0,
                   help="measure a generated model with this hidden size (moe_intermediate H/2, intermediate 2H) "
                        "instead of models/tiny-v32 (hidden 256)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default, one per core)")
    p.add_argument("--ep", type=int, default=32, help="expert-parallel ranks of the per-rank column")
    p.add_argument("--context", type=int, default=131072, help="tokens per request of the KV GiB column")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="time the parts of a decode step at the largest batch, and what W8A8 / C8 can gain at most")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    real = ModelConfig.from_dict(REAL_671B)
    weights, info = analytic_weights(real, args.ep)
    kv = analytic_kv(real, args.context)

    with tempfile.TemporaryDirectory() as tmp:
        if args.hidden:
            h = args.hidden
            path = write_checkpoint(Path(tmp) / f"h{h}", "deepseek_v32", tokenizer=False, hidden_size=h,
                                    moe_intermediate_size=h // 2, intermediate_size=2 * h)
            model_name = f"generated tiny V3.2, hidden {h} (moe_inter {h // 2}, inter {2 * h}, 4 layers, 8 experts)"
        else:
            path = ensure_tiny_model(ROOT / "models" / "tiny-v32")
            model_name = "models/tiny-v32 (hidden 256, moe_inter 128, inter 512, 4 layers, 8 experts)"
        tokens = max(batches) * (args.prompt_len + args.new_tokens) + 256
        engines = {name: LLM(str(path), dtype="bfloat16", quantization=quant, kv_cache_dtype=kvd,
                             max_num_seqs=max(batches), kv_cache_tokens=tokens, enable_prefix_caching=False)
                   for name, (quant, kvd) in CONFIGS.items()}
        vocab = next(iter(engines.values())).engine.model_config.vocab_size
        for llm in engines.values():
            run_once(llm, [[5, 6, 7, 8]] * 2, 4)  # warm-up
        measured = measured_rows(engines)
        print(f"throughput, {model_name}: {args.prompt_len}-token prompts → {args.new_tokens} tokens, "
              f"{_threads()}", flush=True)
        load = _load()
        results = throughput(engines, batches, args.prompt_len, args.new_tokens, args.repeat, vocab)
        load += f" before / {_load()} after"
        parts = breakdown(engines, batches[-1], args.prompt_len, args.new_tokens, vocab) if args.breakdown else None
        costs = {name: TokenCost.of(llm.engine.model, llm.engine.layout.bytes_per_token())
                 for name, llm in engines.items()}

    cpu_fp32 = compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    print(f"\n## Real DeepSeek-V3.2 config: weights (analytic; {info['params']:.1f}B parameters without the MTP "
          f"layer, {info['routed']:.1f}B in routed experts; EP={args.ep}: {real.n_routed_experts // args.ep} "
          f"experts per rank, the rest replicated)")
    print(table(["format", "total GiB", "routed experts GiB", "rest GiB", f"per EP-{args.ep} rank GiB", "vs bf16"],
                weights))
    print(f"bf16 keeps lm_head, the final norm, indexer weights_proj and the router bias in fp32 "
          f"({info['fp32']:.2f}B parameters) as the model does; FP8 / W8A8 leave every non-quantized tensor so.")
    print(f"\n## Real DeepSeek-V3.2 config: KV cache per token ({real.num_hidden_layers} layers) and per request at "
          f"{args.context:,} tokens")
    print(table(["KV cache", "MLA B/token/layer", "index B/token/layer", "B/token/layer", "B/token",
                 f"GiB @ {args.context // 1024}k", "vs bf16"], kv))
    print(f"\n## Measured: {model_name}, loaded in bfloat16")
    print(table(["config", "weights MiB (allocated)", "vs bf16", "by dtype (MiB)", "weights MiB (bf16 hardware)",
                 "vs bf16", "KV B/token (allocated)", "KV B/token (bf16 hardware)", "vs bf16"], measured))
    if cpu_fp32:
        print("Note: this CPU has no bf16 arithmetic, so a bf16 model keeps its matmul weights (and the bf16 KV "
              "rows) as exact fp32 copies (store_for_compute): the 'allocated' columns are what this process "
              "holds; the 'bf16 hardware' columns count the same tensors at their bf16 storage dtype.")
    print(f"\n## Throughput: {model_name}, {args.prompt_len}-token prompts → {args.new_tokens} tokens, greedy, "
          f"best of {args.repeat}, {_threads()}, load average {load}")
    print(table(["batch", "config", "prefill tok/s", "vs bf16", "decode tok/s", "vs bf16"],
                throughput_rows(results, batches)))
    print(kernels_used())
    limits = MachineLimits.measure()
    context = args.prompt_len + args.new_tokens // 2
    print(f"{limits.describe()}; the model: {costs['bf16'].describe(context)} in bf16")
    for name, cost in costs.items():  # the largest batch's decode against the machine
        dec = results[name][batches[-1]][1]
        print(f"  {name} decode at batch {batches[-1]}: "
              f"{against_limits(limits, cost.flop(context) * dec, cost.kv_bytes(context) * dec, 'bfloat16')}")
    if parts is not None:
        rows, notes = parts
        print(f"\n## Where a decode step goes at batch {batches[-1]} (ms per step, each part exclusive of the others; "
              f"the faster of two runs)")
        print(table(["config", "step ms", *STEP_PARTS, "rest"], rows))
        print("\n".join(notes))
    png = plot(OUT / (f"quant_h{args.hidden}.png" if args.hidden else "quant.png"),
               f"{model_name}: {args.prompt_len} → {args.new_tokens} tokens, {_threads()}",
               results, batches)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
