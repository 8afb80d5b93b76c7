"""Real shapes in bounded memory: the 671B model's per-layer dimensions, not a tiny config.

The attention and indexer working set is bounded by `attention_workspace_mb` whatever the context;
what else a step holds grows with the tokens of the step (max_prefill_tokens), never with the context.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.engine.sampler import SamplingParams, sample
from shared.kvcache import KVCache, KVLayout
from shared.loader import load_model
from shared.model import ForwardBatch, SeqChunk, attention, cpu_kernels
from tests.helpers import make_hf_checkpoint, random_prompts

GiB = 1 << 30
WORKSPACE_MB = 256
CHUNK = 1024
# Activations a step holds per new token at the real dims in fp32, besides the attention workspace:
# q (128·192), q_abs and the query (128·(512+576)), o_lat (128·512), o (128·128), MoE rows and their
# temporaries: about 1.2 MB. Stated budget for a 1k chunk = workspace + 1k · 1.25 MB.
ACTIVATION_BYTES_PER_TOKEN = 1.25 * (1 << 20)


@pytest.mark.timeout(1200)
def test_real_dims_8k_prefill_in_1k_chunks_bounded_memory():
    """One layer at the real dims (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, indexer
    64 × 128, index_topk 2048, four 7168×2048 experts) prefills 8,192 tokens in 1,024-token chunks
    (fp32: this CPU has no bf16 arithmetic). Untiled, the last chunk's scores alone would be
    1024 × 128 × 8192 × 4 B = 4 GiB; here the chunks at context 1k (dense), 3k (the first past
    index_topk: sparse) and 8k (the rows between them filled, not computed) stay under the stated
    budget, and the chunk at context 8k needs no more than the one at 3k (both sparse; the first,
    dense, takes the expanded form). The property holds per chunk whatever its size; 1k chunks
    halve the arithmetic of 2k ones (~100 s → ~50 s here)."""
    script = Path(__file__).with_name("real_dims_child.py")
    out = subprocess.run([sys.executable, str(script), "8192", str(CHUNK), str(WORKSPACE_MB), "float32", "ends"],
                         capture_output=True, text=True, timeout=1100, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    budget = WORKSPACE_MB * (1 << 20) + CHUNK * ACTIVATION_BYTES_PER_TOKEN
    print(f"\nweights {report['weights'] / GiB:.2f} GiB, KV {report['kv'] / GiB:.3f} GiB, "
          f"budget {budget / GiB:.2f} GiB")
    for c in report["chunks"]:
        grow = c["peak"] - c["baseline"]
        print(f"  context {c['context']:5d}: RSS before {c['baseline'] / GiB:.2f} GiB, peak {c['peak'] / GiB:.2f} GiB "
              f"(+{grow / GiB:.2f})")
        assert c["finite"]
        assert c["peak"] <= report["baseline_model"] + budget, c  # runtime + weights + KV + budget
        assert grow <= budget, c
    second, last = report["chunks"][1], report["chunks"][-1]  # both sparse (the first is dense, expanded)
    assert second["context"] == 3072 and last["context"] == 8192
    assert (last["peak"] - last["baseline"]) <= (second["peak"] - second["baseline"]) + 256 * (1 << 20)
    # tiled (1 MiB workspace: key tiles + online softmax) == untiled, at the same dims, on a short prompt
    assert report["tiled_vs_untiled_cos"] >= 0.99999 and report["tiled_vs_untiled_maxabs"] < 1e-3


@pytest.mark.parametrize(("arithmetic", "options"), [("native", "bf16"), ("fp32-copies", "bf16"),
                                                     ("native", "w8a8-c8")])
def test_real_dims_bf16_decode_of_a_token_alone_equals_it_batched(arithmetic, options):
    """At DeepSeek's dims oneDNN's one-row products round otherwise than its GEMMs (q_a_proj, q_b_proj, o_proj,
    experts picked by one row): single rows go in as two, so a token decoded alone gets the bits it gets beside
    three other requests (before: the logits differed by ~0.04). `fp32-copies` runs the same layer as a CPU
    without bf16 arithmetic does (fp32 weight copies): there the absorbed per-head matmuls of 128 heads went
    through torch's fp32 bmm, whose rows depend on the batch (logits 0.009-0.014 apart), and now take the
    head_matmul kernel, each row on its own. `w8a8-c8`: the same with W8A8 weights and a C8 KV cache."""
    script = Path(__file__).with_name("real_dims_child.py")
    out = subprocess.run([sys.executable, str(script), "decode-alone-vs-batched", arithmetic, options],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["equal"], report


def test_plan_tiles_fits_budget_at_real_dims():
    """Tile plans at 128 heads, 576-d rows and contexts up to 128k stay within the workspace."""
    budget = WORKSPACE_MB << 20
    for queries, context in ((1, 131072), (2048, 8192), (4096, 131072), (256, 2048)):
        per_pair, per_query, per_key = 128 * 8, 128 * 512 * 8, 576 * 4
        t = attention.plan_tiles(1, queries, context, 64, per_pair, per_query, per_key, budget)
        assert t.requests * (t.queries * t.keys * per_pair + t.queries * per_query + t.keys * per_key) <= budget
        assert t.keys == context or t.keys % 64 == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    paths = {}
    for name, model_type, extra in (("sparse", "deepseek_v32", {"index_topk": 8}),
                                    ("dense", "deepseek_v32", {"index_topk": 256}), ("v3", "deepseek_v3", {})):
        paths[name] = make_hf_checkpoint(tmp_path_factory.mktemp(name), model_type, num_hidden_layers=2, **extra)
    return paths


def _logits(model, prompts, workspace: int, bs: int = 4) -> torch.Tensor:
    kv = KVCache(KVLayout.from_model_config(model.config, bs, model.dtype), 128, torch.device("cpu"))
    chunks = [SeqChunk(p, 0, kv.allocator.allocate(kv.blocks_needed(len(p)))) for p in prompts]
    fb = ForwardBatch.build(chunks, bs, torch.device("cpu"), workspace)
    fb.logits_index = torch.arange(fb.num_tokens)
    return model(fb, kv)


@pytest.mark.parametrize("name", ["sparse", "dense", "v3"])
def test_tiled_equals_untiled(tiny, name, monkeypatch):
    """Workspaces from 'everything in one tile' down to 'one block of keys per tile' give the same
    logits (online softmax, query tiles, running top-k merge across key tiles), in the absorbed form and
    in the expanded form (which these prompts take where the model's dims make expansion pay). The sparse
    model's indexer scores through the CPU kernel (query tiles) and, on the portable path accelerators
    take, through key tiles merged into a running top-k."""
    model, _ = load_model(tiny[name], "float32")
    prompts = random_prompts(3, [40, 23, 31], model.config.vocab_size, seed=50)
    plans = []
    for planner in ("plan_tiles", "plan_expanded_tiles"):
        real = getattr(attention, planner)
        monkeypatch.setattr(attention, planner, lambda *a, _real=real, **k: plans.append(_real(*a, **k)) or plans[-1])
    whole = _logits(model, prompts, 1 << 34)
    assert all(p.keys >= 40 for p in plans)  # one tile
    for index_kernel in (True, False) if name == "sparse" else (True,):
        if not index_kernel:
            monkeypatch.setattr(cpu_kernels, "index_usable", lambda *a: False)
        for workspace in (60_000, 4_000):
            plans.clear()
            tiled = _logits(model, prompts, workspace)
            assert any(p.keys < 40 for p in plans) or name == "sparse"  # key tiles really used
            assert (tiled - whole).abs().max().item() < 2e-5, workspace
        if not index_kernel:
            assert any(p.keys < 40 for p in plans)  # the indexer merged top-k across key tiles


def test_sampler_real_vocab_256_rows_one_pass():
    """Greedy, temperature, top-k, top-p and seeded rows mixed in one batch of 256 at the real
    129,280-token vocabulary: seeded rows replay exactly and do not depend on their neighbours."""
    vocab, rows = 129280, 256
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=50),
             SamplingParams(temperature=0.9, top_p=0.9, seed=7), SamplingParams(temperature=1.1, top_k=200, top_p=0.5)]
    params = [kinds[i % len(kinds)] for i in range(rows)]

    def gens():
        return [torch.Generator().manual_seed(1000 + i) for i in range(rows)]

    first, again = sample(logits, params, gens()), sample(logits, params, gens())
    assert first == again
    assert all(first[i] == int(logits[i].argmax()) for i in range(0, rows, len(kinds)))  # greedy rows
    for i in range(2, rows, len(kinds)):  # top-k rows pick among their 50 best
        assert first[i] in set(logits[i].topk(50).indices.tolist())
    solo = sample(logits[3:4], params[3:4], [torch.Generator().manual_seed(1003)])
    assert solo[0] == first[3]  # a seeded row's draw is its own


def test_sampler_distribution_matches_top_k_top_p():
    """The empirical distribution of draws equals the top-k / top-p renormalized softmax (chi-square)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.3, 1.5]])
    for p in (SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.7, top_k=3),
              SamplingParams(temperature=1.3)):
        probs = (logits[0] / p.temperature).softmax(-1)
        keep = torch.ones(8, dtype=torch.bool)
        if p.top_k:
            keep &= probs >= probs.topk(p.top_k).values[-1]
        if p.top_p < 1:
            sp, order = (probs * keep).sort(descending=True)
            sp = sp / sp.sum()
            mask = (sp.cumsum(0) - sp) < p.top_p
            keep = torch.zeros(8, dtype=torch.bool).scatter(0, order[mask], True) & keep
        want = probs * keep / (probs * keep).sum()
        n, gen = 20000, torch.Generator().manual_seed(3)
        counts = torch.zeros(8)
        batch = sample(logits.expand(n, 8).contiguous(), [p] * n, [gen] * n)
        counts.index_add_(0, torch.tensor(batch), torch.ones(n))
        assert counts[~keep].sum() == 0
        expected = want[keep] * n
        chi2 = ((counts[keep] - expected) ** 2 / expected).sum().item()
        assert chi2 < 25, (p, counts, want)
