"""Real shapes: one layer at the 671B model's per-layer dims — prefill time and peak memory vs context,
decode step time vs context, and the sampler at the real vocabulary.

    python bench/real_shapes.py [--contexts 2048,8192,32768] [--chunk 2048] [--dtype float32]
                                [--decode-batch 1,16] [--workspace-mb 256] [--threads 1]
                                [--model-type deepseek_v32|deepseek_v3] [--absorbed-baseline]
                                [--quantization w8a8] [--kv-cache-dtype int8] [--sampler-rows 256]

Prefill runs the longest prompt once in `--chunk`-token chunks; the time and peak RSS to prefill a
C-token prompt are those of its first C / chunk chunks (the peak is reset before every chunk through
/proc/self/clear_refs). Dense prompt chunks attend in MLA's expanded form (shared.model.attention.
prompt_form); `--absorbed-baseline` also runs every chunk with the absorbed form only (the form dense
prompts past a few hundred tokens took before the expanded form was tiled over keys), alternating which
goes first, and prints both. deepseek_v32 attends densely up to index_topk (2048) and sparsely beyond;
deepseek_v3 (no indexer) densely at every length. Decode steps run over KV rows filled with random
values (a step's cost depends on the context length, not on the values), stored as `--kv-cache-dtype` says
(int8: C8, encoded by its codecs). On CPUs without bf16
arithmetic use float32 (the default): bf16 matmuls are emulated there and 10-250x slower. `--quantization
w8a8` gives the layer W8A8 linears (random int8 weights; int8 x int8 -> int32 kernels) to compare with
`--dtype bfloat16`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OUT, MachineLimits, TokenCost, kernels_used, table
from shared.engine.sampler import SamplingParams, sample
from shared.kvcache import KVCache, KVLayout
from shared.loader.synthetic import random_model, real_layer_config
from shared.model import ForwardBatch, SeqChunk
from shared.model.mla import MLA

GiB = 1 << 30


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def set_expanded_prompts(model, expanded: bool) -> None:
    """Dense prompt chunks in expanded form where it pays (the default), or every chunk absorbed."""
    for m in model.modules():
        if isinstance(m, MLA):
            m.expanded_prompts = expanded


def prefill(model, cfg, contexts: list[int], chunk: int, workspace: int, forms: list[bool]) -> list[list]:
    """Per context: for each form of `forms` (expanded prompts on / off), the seconds, tok/s and peak RSS
    (total and over the model + KV) of the first context / chunk chunks. Every chunk runs once per form,
    the order alternating chunk by chunk; a chunk writes the same KV rows whichever form runs it."""
    bs, longest = 64, max(contexts)
    kv = KVCache(KVLayout.from_model_config(cfg, bs, model.dtype), longest // bs + 1, torch.device("cpu"))
    table_ = kv.allocator.allocate(kv.blocks_needed(longest))
    ids = torch.randint(2, cfg.vocab_size, (longest,)).tolist()
    for expanded in forms:  # warm-up: first-call costs (kernel loads, allocator growth) counted for no form
        set_expanded_prompts(model, expanded)
        model(ForwardBatch.build([SeqChunk(ids[:64], 0, table_)], bs, torch.device("cpu"), workspace), kv)
    base = _status("VmRSS")
    elapsed, peak, rows = dict.fromkeys(forms, 0.0), dict.fromkeys(forms, 0), []
    for i, start in enumerate(range(0, longest, chunk)):
        fb = ForwardBatch.build([SeqChunk(ids[start : start + chunk], start, table_)], bs, torch.device("cpu"),
                                workspace)
        for expanded in forms if i % 2 == 0 else forms[::-1]:
            set_expanded_prompts(model, expanded)
            _reset_peak()
            t0 = time.perf_counter()
            model(fb, kv)
            elapsed[expanded] += time.perf_counter() - t0
            peak[expanded] = max(peak[expanded], _status("VmHWM"))
        done = start + len(fb.input_ids)
        print(f"  prefill {done:6d}/{longest} tokens  " + "  ".join(
            f"{'expanded' if e else 'absorbed'} {elapsed[e]:7.1f}s peak RSS {peak[e] / GiB:.2f} GiB" for e in forms),
            flush=True)
        if done in contexts:
            rows.append([done] + [x for e in forms for x in (elapsed[e], done / elapsed[e], peak[e] / GiB,
                                                             (peak[e] - base) / GiB)])
    set_expanded_prompts(model, True)
    return rows


def prefill_flop(cfg, cost: TokenCost, tokens: int, chunk: int) -> float:
    """FLOP of prefilling `tokens` in `chunk`-token chunks as the layer runs them: weights per token; dense
    chunks in expanded form (each visible query-key pair H·2·(nope + rope + v), each key of the chunk's
    context expanded once, H·2·c·(nope + v)); past index_topk (deepseek_v32) sparse absorbed attention and
    the indexer, as TokenCost counts them."""
    heads, c, nope, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    qk = nope + cfg.qk_rope_head_dim
    total = 0.0
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        if cfg.has_indexer and end > cfg.index_topk:
            total += sum(cost.flop(t) for t in range(start + 1, end + 1))
        else:
            pairs = sum(range(start + 1, end + 1))
            total += cost.weight_flop * (end - start) + heads * 2.0 * (pairs * (qk + v) + end * c * (nope + v))
    return total


def fill_rows(kv: KVCache, gen: torch.Generator, distinct: int = 4096) -> None:
    """Every slot of the pools holds a row as its codec stores it: `distinct` random rows encoded (C8: int8
    latents with their scales, FP8 keys), repeated (a step's cost depends on the context length, not the values)."""
    for pool, codec in ((kv.mla, kv.mla_codec), (kv.index, kv.index_codec)):
        if pool is None:
            continue
        rows = codec.encode(torch.randn(distinct, codec.dim, generator=gen))
        flat = pool.view(-1, pool.shape[-1])
        for start in range(0, flat.shape[0], distinct):
            flat[start:start + distinct] = rows[: flat.shape[0] - start]


def decode(model, cfg, contexts: list[int], batches: list[int], workspace: int, kv_cache_dtype: str,
           steps: int = 3) -> list[list]:
    bs, rows = 64, []
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        for ctx in contexts:
            layout = KVLayout.from_model_config(cfg, bs, model.dtype, kv_cache_dtype=kv_cache_dtype)
            kv = KVCache(layout, batch * (ctx // bs + 2), torch.device("cpu"))
            fill_rows(kv, gen)
            tables = [kv.allocator.allocate(kv.blocks_needed(ctx + steps)) for _ in range(batch)]
            times = []
            for step in range(steps):
                chunks = [SeqChunk([5], ctx + step, t, generated=True) for t in tables]  # decodes, as the engine's
                fb = ForwardBatch.build(chunks, bs, torch.device("cpu"), workspace)
                t0 = time.perf_counter()
                model(fb, kv)
                times.append(time.perf_counter() - t0)
            best = min(times[1:] or times)
            print(f"  decode batch {batch:3d} context {ctx:6d}: {best * 1e3:8.1f} ms/step", flush=True)
            rows.append([batch, ctx, best * 1e3, batch / best])
            del kv
    return rows


def sampler(rows: int = 256, vocab: int = 129280) -> list[list]:
    gen = torch.Generator().manual_seed(0)
    # trained-like: probabilities ∝ rank^-2 (a few hundred tokens hold 90% of the mass), shuffled per row
    zipf = -2.0 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    peaked = torch.stack([zipf[torch.randperm(vocab, generator=gen)] for _ in range(rows)])
    flat = torch.randn(rows, vocab, generator=gen)
    cases = [("greedy", peaked, SamplingParams(temperature=0)),
             ("temperature 0.8", peaked, SamplingParams(temperature=0.8)),
             ("top_k 50", peaked, SamplingParams(temperature=0.8, top_k=50)),
             ("top_p 0.9 (Zipf-like logits)", peaked, SamplingParams(temperature=0.8, top_p=0.9)),
             ("top_p 0.9 (flat logits: full sort)", flat, SamplingParams(temperature=0.8, top_p=0.9)),
             ("top_k 100 + top_p 0.9, seeded", peaked, SamplingParams(temperature=0.8, top_k=100, top_p=0.9, seed=1))]
    out = []
    for name, logits, p in cases:
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        sample(logits[:8], [p] * 8, gens[:8])
        t0 = time.perf_counter()
        sample(logits, [p] * rows, gens)
        ms = (time.perf_counter() - t0) * 1e3
        print(f"  sampler {name:36s} {ms:8.1f} ms", flush=True)
        out.append([name, rows, vocab, ms])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decode-batch", default="1,16")
    p.add_argument("--workspace-mb", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--model-type", default="deepseek_v32", choices=["deepseek_v32", "deepseek_v3"],
                   help="deepseek_v3 has no indexer: dense attention at every context")
    p.add_argument("--absorbed-baseline", action="store_true",
                   help="also prefill every chunk with the absorbed form only, alternating, and print both")
    p.add_argument("--quantization", default=None, choices=["w8a8"],
                   help="W8A8 linears (random int8 weights) instead of --dtype ones")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the decode steps' KV cache: the model's dtype, or C8 (int8 latents, FP8 index keys)")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--sampler-rows", type=int, default=256, help="rows of the sampler's table (real vocabulary)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.decode_batch.split(",")]
    workspace = args.workspace_mb << 20
    limits = MachineLimits.measure() if not args.skip_prefill else None  # before the model: a quiet machine
    cfg = real_layer_config(model_type=args.model_type)
    weights_kind = f"{args.dtype}, W8A8" if args.quantization else args.dtype
    print(f"building one layer at the 671B per-layer dims ({args.model_type}, {weights_kind}) ...", flush=True)
    model = random_model(cfg, getattr(torch, args.dtype), quantization=args.quantization)
    weights = sum(x.numel() * x.element_size() for x in model.parameters())
    print(f"weights {weights / GiB:.2f} GiB; {torch.get_num_threads()} threads", flush=True)

    forms = [True, False] if args.absorbed_baseline else [True]
    pre = [] if args.skip_prefill else prefill(model, cfg, contexts, args.chunk, workspace, forms)
    dec = [] if args.skip_decode else decode(model, cfg, contexts, batches, workspace, args.kv_cache_dtype)
    smp = sampler(args.sampler_rows)

    index = "indexer 64x128, index_topk 2048" if cfg.has_indexer else "no indexer: dense at every context"
    head = (f"one layer at the 671B per-layer dims ({args.model_type}: hidden 7168, 128 heads, kv_lora 512, {index}, "
            f"4 experts), {weights_kind}, workspace {args.workspace_mb} MiB, {torch.get_num_threads()} threads")
    print("\n" + head)
    if pre:
        cols = ["prompt tokens", "prefill s", "tok/s", "peak RSS GiB", "peak over model GiB"]
        if args.absorbed_baseline:
            cols += ["absorbed s", "absorbed tok/s", "absorbed peak GiB", "absorbed over model GiB"]
            print(table(cols + ["speedup"], [r + [r[1 + 4] / r[1]] for r in pre]))
        else:
            print(table(cols, pre))
        cost = TokenCost.of(model, 0)
        peak = limits.bf16_gflops if args.dtype == "bfloat16" else limits.fp32_gflops
        print(limits.describe())
        for r in pre:
            flop = prefill_flop(cfg, cost, r[0], args.chunk)
            print(f"  prefill {r[0]} tokens (expanded where dense): {flop / 1e12:.2f} TFLOP in {r[1]:.1f} s = "
                  f"{flop / r[1] / 1e9:,.1f} GFLOP/s, {100 * flop / r[1] / 1e9 / peak:.0f}% of the {args.dtype} GEMM "
                  "rate")
    if dec:
        kv_kind = "C8 (int8 latents, FP8 index keys)" if args.kv_cache_dtype == "int8" else f"{args.dtype} rows"
        print(f"decode, KV cache {kv_kind}")
        print(table(["decode batch", "context", "ms/step", "tok/s"], dec))
    print(table(["sampler", "rows", "vocab", "ms"], smp))
    print(kernels_used())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ticks = (contexts, [f"{c // 1024}k" for c in contexts])
    if pre:
        axes[0].plot([r[0] for r in pre], [r[1] for r in pre], "o-", label="expanded where dense")
        if args.absorbed_baseline:
            axes[0].plot([r[0] for r in pre], [r[5] for r in pre], "o-", label="absorbed")
        axes[0].legend()
        axes[0].set(title="prefill time (2k chunks)", xlabel="prompt tokens", ylabel="seconds", xscale="log")
        axes[1].plot([r[0] for r in pre], [r[4] for r in pre], "o-")
        axes[1].set(title="peak RSS over the model + KV", xlabel="prompt tokens", ylabel="GiB", xscale="log",
                    ylim=(0, None))
    for batch in batches:
        pts = [r for r in dec if r[0] == batch]
        axes[2].plot([r[1] for r in pts], [r[2] for r in pts], "o-", label=f"batch {batch}")
    axes[2].set(title="decode step time", xlabel="context tokens", ylabel="ms / step", xscale="log", ylim=(0, None))
    axes[2].legend()
    for ax in axes:
        ax.minorticks_off()
        ax.set_xticks(*ticks)
    fig.suptitle(head, fontsize=8)
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / "real_shapes.png", dpi=120)
    print(f"plot: {OUT / 'real_shapes.png'}")


if __name__ == "__main__":
    main()
