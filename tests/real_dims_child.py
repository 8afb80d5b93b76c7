"""Run in a subprocess by test_real_shapes: one layer at the 671B per-layer dims prefills a long prompt
in chunks; prints JSON with the peak RSS of each computed chunk (the peak is reset before each chunk
through /proc/self/clear_refs), the weights' and the KV pool's bytes, and a tiled-vs-untiled comparison.

    python tests/real_dims_child.py PROMPT_TOKENS CHUNK WORKSPACE_MB [DTYPE] [all|ends]
    python tests/real_dims_child.py decode-alone-vs-batched [native|fp32-copies] [bf16|w8a8-c8]

`ends` computes only the first chunk, the first sparse one (its context past index_topk) and the last,
and fills the cache rows in between with random values (what attention and the indexer read there does
not change how much memory they take), so the chunk at the full context is measured in a fraction of the
time. (The first chunk of a V3.2 prompt is dense, in expanded form; the chunks past index_topk are
sparse: the first sparse one and the last compare alike.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.kvcache import KVCache, KVLayout
from shared.loader.synthetic import random_model, real_layer_config
from shared.model import ForwardBatch, SeqChunk


def rss_peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def rss_now_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def decode_alone_vs_batched(arithmetic: str, options: str) -> None:
    """A bf16 layer at the real dims decodes one token alone and beside three others (generated rows, random
    KV rows at context 2,300: past index_topk, so sparse attention): prints JSON with whether its logits are the
    same bits. `fp32-copies` runs it as a CPU without bf16 arithmetic does (fp32 weight copies, fp32 compute);
    options `w8a8-c8`: W8A8 weights and a C8 KV cache (rows encoded as the codecs store them)."""
    if arithmetic == "fp32-copies":
        import shared.device

        shared.device._cpu_has_native_bf16 = lambda: False
    torch.manual_seed(0)
    cfg = real_layer_config()
    quantized = options == "w8a8-c8"
    model = random_model(cfg, torch.bfloat16, quantization="w8a8" if quantized else None)
    bs, context = 64, 2300
    layout = KVLayout.from_model_config(cfg, bs, model.dtype, kv_cache_dtype="int8" if quantized else "auto")
    kv = KVCache(layout, 4 * (context // bs + 2), torch.device("cpu"))
    for pool, codec in ((kv.mla, kv.mla_codec), (kv.index, kv.index_codec)):
        rows = torch.randn(pool.shape[:-1].numel(), codec.dim)
        pool.copy_(codec.encode(rows).view(pool.shape))
    tables = [kv.allocator.allocate(kv.blocks_needed(context + 1)) for _ in range(4)]

    def decode(requests: list[int]) -> torch.Tensor:
        chunks = [SeqChunk([5 + i], context, tables[i], generated=True) for i in requests]
        with torch.inference_mode():
            return model(ForwardBatch.build(chunks, bs, torch.device("cpu")), kv)

    alone, batched = decode([0])[0], decode([0, 1, 2, 3])[0]
    print(json.dumps({"equal": torch.equal(alone, batched), "maxabs": (alone - batched).abs().max().item()}))


def main() -> None:
    if sys.argv[1] == "decode-alone-vs-batched":
        args = sys.argv[2:]
        decode_alone_vs_batched(args[0] if args else "native", args[1] if len(args) > 1 else "bf16")
        return
    prompt_tokens, chunk, workspace_mb = (int(a) for a in sys.argv[1:4])
    dtype = getattr(torch, sys.argv[4]) if len(sys.argv) > 4 else torch.float32
    torch.manual_seed(0)
    cfg = real_layer_config()
    model = random_model(cfg, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bs = 64
    kv = KVCache(KVLayout.from_model_config(cfg, bs, model.dtype), -(-prompt_tokens // bs) + 1, torch.device("cpu"))
    kv_bytes = sum(t.numel() * t.element_size() for t in (kv.mla, kv.index) if t is not None)
    table = kv.allocator.allocate(kv.blocks_needed(prompt_tokens))
    ids = torch.randint(2, cfg.vocab_size, (prompt_tokens,)).tolist()
    baseline_model = rss_now_bytes()  # runtime + weights + KV pool
    which = sys.argv[5] if len(sys.argv) > 5 else "all"
    starts = list(range(0, prompt_tokens, chunk))
    first_sparse = next((s for s in starts if s + chunk > cfg.index_topk), starts[-1])
    chunks = []
    for start in starts:
        if which == "ends" and start not in (starts[0], first_sparse, starts[-1]):
            slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(start, start + chunk)])
            for pool in (kv.mla, kv.index):  # [layers, blocks, block_size, dim]: rows as a computed chunk leaves
                if pool is not None:
                    flat = pool.view(pool.shape[0], -1, pool.shape[-1])
                    flat[:, slots] = torch.randn(pool.shape[0], len(slots), pool.shape[-1]).to(pool.dtype)
            continue
        baseline = rss_now_bytes()
        reset_peak()
        fb = ForwardBatch.build([SeqChunk(ids[start : start + chunk], start, table)], bs, torch.device("cpu"),
                                workspace_mb << 20)
        logits = model(fb, kv)
        chunks.append({"context": start + len(fb.input_ids), "baseline": baseline, "peak": rss_peak_bytes(),
                       "finite": bool(torch.isfinite(logits).all())})

    # tiled == untiled on a short prompt at the same dims (dense: 256 tokens < index_topk)
    short = ids[:256]
    outs = []
    for budget in (1 << 36, 1 << 20):  # one tile vs key tiles of a few blocks (online softmax)
        kv2 = KVCache(KVLayout.from_model_config(cfg, bs, model.dtype), 8, torch.device("cpu"))
        fb = ForwardBatch.build([SeqChunk(short, 0, kv2.allocator.allocate(4))], bs, torch.device("cpu"), budget)
        fb.logits_index = torch.arange(len(short))
        outs.append(model(fb, kv2))
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1).min().item()
    print(json.dumps({"weights": weights, "kv": kv_bytes, "baseline_model": baseline_model, "chunks": chunks,
                      "tiled_vs_untiled_cos": cos,
                      "tiled_vs_untiled_maxabs": (outs[0] - outs[1]).abs().max().item()}))


if __name__ == "__main__":
    main()
