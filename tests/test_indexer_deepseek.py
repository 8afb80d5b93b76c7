"""The default indexer numerics against DeepSeek's published indexer formula, implemented here from
the formula (spec §5, DeepSeek-V3.2 `inference/model.py` + `kernel.py`), not with the project's code:

    q = H(rope(wq_b(qr))), k = H(rope(LayerNorm(wk(x))))          # NeoX rope on the first 64 dims
    q8, qs = act_quant(q); k8, ks = act_quant(k)                     # e4m3, power-of-two (ue8m0) scales
    w = weights_proj(x.float()) · n_heads^-0.5 · qs · d^-0.5
    I[s, t] = ks[t] · Σ_h w[s, h] · ReLU(q8[s, h] · k8[t])           # fp32; causal t ≤ s; top-k
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shared.loader import load_model
from shared.model.indexer import Indexer, Selection
from tests.helpers import assert_close_logits, engine_logits, make_hf_checkpoint, random_prompts

TOPK, PROMPT = 16, 64  # the prompt is 4× index_topk: most queries choose 16 of up to 64 keys


def _sylvester(n: int) -> torch.Tensor:
    h = torch.tensor([[1.0]])
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's act_quant(x, 128, "ue8m0") on the last dim (one block of 128)."""
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None, :]  # [S, d/2]
    cos, sin = ang.cos(), ang.sin()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def deepseek_topk(ix: Indexer, x: torch.Tensor, qr: torch.Tensor, theta: float, k: int) -> list[set[int]]:
    s_len, nh, d, rope = x.shape[0], ix.n_heads, ix.head_dim, ix.rope_dim
    pos = torch.arange(s_len)
    had = _sylvester(d) * d**-0.5
    q = (qr @ ix.wq_b.weight.T).view(s_len, nh, d)
    q = torch.cat([_rope_neox(q[..., :rope], pos, theta), q[..., rope:]], -1) @ had.T
    key = F.layer_norm(x @ ix.wk.weight.T, (d,), ix.k_norm.weight, ix.k_norm.bias, 1e-6)
    key = torch.cat([_rope_neox(key[..., :rope], pos, theta), key[..., rope:]], -1) @ had.T
    q8, qs = _act_quant(q)  # qs [S, H, 1]
    k8, ks = _act_quant(key)  # ks [T, 1]
    w = (x.float() @ ix.weights_proj.weight.float().T) * nh**-0.5 * qs[..., 0] * d**-0.5  # [S, H]
    logits = torch.einsum("shd,td->sht", q8.float(), k8.float())
    index = ks[:, 0][None, :] * torch.einsum("sh,sht->st", w, logits.clamp(min=0))
    index = index.masked_fill(torch.ones(s_len, s_len, dtype=torch.bool).triu(1), -math.inf)
    top = index.topk(min(k, s_len), -1)
    return [set(i[v > -math.inf].tolist()) for i, v in zip(top.indices, top.values)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("dsidx"), "deepseek_v32", num_hidden_layers=2,
                              index_topk=TOPK, index_head_dim=128, index_n_heads=64)  # real indexer dims
    m, _ = load_model(path, "float32")  # the default numerics
    assert all(layer.self_attn.indexer.numerics == "deepseek" for layer in m.model.layers)
    return m


def _capture(model, ids):
    """Run the model; per layer the indexer's inputs (x, qr) and its selection (one attention part)."""
    seen, inputs = [], []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda mod, args, out: inputs.append(args[:2]))
             for layer in model.model.layers]
    real_select = Indexer.select

    def select(self, *args):
        sel = real_select(self, *args)
        seen.append((*inputs[len(seen)], sel))
        return sel

    Indexer.select = select
    try:
        logits = engine_logits(model, ids)
    finally:
        Indexer.select = real_select
        for h in hooks:
            h.remove()
    return logits, seen


def test_topk_sets_match_deepseek_formula(model):
    theta = model.config.rope.theta
    recalls = []
    for ids in random_prompts(2, [PROMPT, 3 * TOPK + 5], model.config.vocab_size, seed=40):
        _, seen = _capture(model, ids)
        assert len(seen) == model.config.num_hidden_layers
        for layer, (x, qr, sel) in zip(model.model.layers, seen):
            want = deepseek_topk(layer.self_attn.indexer, x, qr, theta, TOPK)
            got = [set(p[v].tolist()) for p, v in zip(sel.picks, sel.valid)]
            assert all(len(g) == min(TOPK, s + 1) for s, g in enumerate(got))  # causal, no future picks
            recalls += [len(g & w) / len(w) for g, w in zip(got, want)]
    sparse = recalls[TOPK:]  # (the first queries see fewer keys than k: every key either way)
    print(f"indexer top-k recall vs DeepSeek's formula: mean {sum(recalls) / len(recalls):.5f}, "
          f"min {min(recalls):.3f} over {len(recalls)} query rows")
    assert sum(recalls) / len(recalls) >= 0.995 and min(sparse) >= 0.8


def test_logits_with_deepseek_formula_selection(model, monkeypatch):
    """Logits with the model's own selection == logits with the selection computed from the formula."""
    theta = model.config.rope.theta
    ids = random_prompts(1, [PROMPT], model.config.vocab_size, seed=41)[0]
    ours = engine_logits(model, ids)
    original = Indexer.forward
    formula_picks = []

    def forward(self, x, qr, rope, fb, index_pool, codec=None):
        out = original(self, x, qr, rope, fb, index_pool, codec)  # writes the keys, as the model does
        picks = torch.zeros(x.shape[0], TOPK, dtype=torch.long)
        valid = torch.zeros(x.shape[0], TOPK, dtype=torch.bool)
        for s, chosen in enumerate(deepseek_topk(self, x, qr, theta, TOPK)):
            picks[s, : len(chosen)] = torch.tensor(sorted(chosen))
            valid[s, : len(chosen)] = True
        formula_picks.append(Selection(picks, valid))
        return out

    def formula(self, q, w, fb, index_pool, codec=None):  # one prompt: the step is one attention part
        return formula_picks.pop()

    monkeypatch.setattr(Indexer, "forward", forward)
    monkeypatch.setattr(Indexer, "select", formula)
    theirs = engine_logits(model, ids)
    assert_close_logits(ours, theirs, cos_min=0.9999, atol=1e-3)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_tied_fp8_scores_pick_the_same_keys_however_the_step_is_tiled(tmp_path):
    """DeepSeek's FP8 indexer scores tie exactly; ties go to the earliest positions, so the tokens do not
    depend on block size, chunking or batch composition (they did: this prompt's first token changed)."""
    from shared.engine import LLM, SamplingParams
    from shared.loader.tiny import write_checkpoint
    from tests.helpers import random_prompts

    path = write_checkpoint(tmp_path / "ties", "deepseek_v32", tokenizer=False, index_topk=8, vocab_size=512,
                            hidden_size=64, q_lora_rank=32, kv_lora_rank=64, qk_rope_head_dim=16,
                            qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, intermediate_size=128,
                            num_hidden_layers=3, index_head_dim=32, index_n_heads=4)
    prompt = random_prompts(4, [5, 23, 11, 40], 512, seed=2)[3]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = [LLM(str(path), dtype="float32", **kw).generate([prompt], params)[0].token_ids
            for kw in (dict(block_size=4), dict(block_size=16), dict(block_size=4, max_num_batched_tokens=16),
                       dict(block_size=4, attention_workspace_mb=1))]
    assert all(r == runs[0] for r in runs), runs
