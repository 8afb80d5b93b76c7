"""MoE routing against transformers' router, and grouped experts against a per-token loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shared.loader import load_model
from tests.helpers import load_reference


def test_routing_picks_reference_experts(ckpt):
    path = ckpt("v32_sparse")
    model, _ = load_model(path, "float32")
    ref = load_reference(path)
    x = torch.randn(200, model.config.hidden_size)
    for layer in (1, 2):
        ids, weights = model.model.layers[layer].mlp.gate(x)
        _, ref_w, ref_ids = ref.model.layers[layer].mlp.gate(x)
        ours = {tuple(sorted(zip(r.tolist(), w.tolist()))) for r, w in zip(ids, weights)}
        theirs = {tuple(sorted(zip(r.tolist(), w.tolist()))) for r, w in zip(ref_ids, ref_w)}
        assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in ref_ids.tolist()]
        assert len(ours) == len(theirs)
        assert torch.allclose(weights.sort(-1).values, ref_w.sort(-1).values, atol=1e-6)
        # group limit: all picked experts of a token lie in topk_group groups
        per_group = model.config.n_routed_experts // model.config.n_group
        assert all(len({e // per_group for e in row}) <= model.config.topk_group for row in ids.tolist())


def _naive_moe(moe, x):
    ids, w = moe.gate(x)
    out = torch.zeros_like(x)
    inter = moe.experts.inter
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t], moe.experts.gate_up_proj[e]).split(inter)
            out[t] += w[t, slot] * F.linear(F.silu(gate) * up, moe.experts.down_proj[e])
    return out + moe.shared_experts(x)


def test_grouped_experts_with_zero_token_experts(ckpt):
    model, _ = load_model(ckpt("v32_sparse"), "float32")
    moe = model.model.layers[1].mlp
    for n in (1, 3, 64):  # one token: most experts get zero tokens
        x = torch.randn(n, model.config.hidden_size)
        ids, _ = moe.gate(x)
        if n == 1:
            assert len(set(ids.flatten().tolist())) < moe.experts.num_experts
        assert torch.allclose(moe(x), _naive_moe(moe, x), atol=1e-5)


# Ops that read device data back to the host: an accelerator stalls on each (`.tolist()` is counted
# separately: it reads memory without dispatching an op).
_HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.bincount.default",
               "aten.masked_select.default", "aten._unique2.default", "aten.unique_consecutive.default",
               "aten.repeat_interleave.Tensor", "aten.item.default"}


class _CountHostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in _HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("part", ["moe", "model"])
def test_decode_step_makes_no_host_read(ckpt, monkeypatch, part):
    """The decode forward never reads device data back — the MoE (router, grouped experts), and the
    whole model (RoPE included: its table size comes from the batch's host-side context length):
    counted with a dispatch hook and a wrapped Tensor.tolist while a real engine step runs."""
    from shared.engine import LLM, SamplingParams
    from shared.model.model import DeepseekForCausalLM
    from shared.model.moe import MoE

    llm = LLM(str(ckpt("v32_sparse")), dtype="float32")
    engine = llm.engine
    for i in range(6):
        engine.add_request([3 + i, 5, 7, 11 + i], SamplingParams(max_tokens=8, ignore_eos=True))
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()

    counter, calls = _CountHostReads(), []
    real_tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if calls and calls[-1] == "in":
            counter.reads.append("Tensor.tolist")
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def enter(module, args):
        calls.append("in")
        counter.__enter__()

    def leave(module, args, out):
        counter.__exit__(None, None, None)
        calls.append("out")

    kind = MoE if part == "moe" else DeepseekForCausalLM
    moes = [m for m in engine.model.modules() if isinstance(m, kind)]
    assert moes
    hooks = [h for m in moes for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        events = engine.step()  # one decode step of 6 requests
    finally:
        for h in hooks:
            h.remove()
    assert len(events) == 6 and calls.count("in") == len(moes)
    assert counter.reads == [], counter.reads


def test_grouped_mm_fallback_loop_matches_the_kernel_and_shapes_are_checked():
    """The per-expert loop devices without F.grouped_mm get equals the kernel (empty groups, padding
    rows past the last offset); a shape bug raises instead of silently taking the fall-back."""
    import pytest

    from shared.device import grouped_mm, grouped_mm_loop

    torch.manual_seed(0)
    counts = torch.tensor([0, 5, 0, 3, 7])
    x, w = torch.randn(int(counts.sum()) + 4, 16), torch.randn(5, 16, 8)  # 4 padding rows at the end
    offsets = counts.cumsum(0).to(torch.int32)
    n = int(counts.sum())
    assert torch.allclose(grouped_mm(x, w, offsets)[:n], grouped_mm_loop(x, w, offsets)[:n], atol=1e-5)
    with pytest.raises(ValueError, match="grouped_mm"):
        grouped_mm(x, w.transpose(1, 2), offsets)


def test_padded_expert_slots_contribute_nothing(ckpt):
    """EP receivers mask picks held by other ranks (id -1, weight 0): same sum as without them."""
    model, _ = load_model(ckpt("v32_sparse"), "float32")
    experts = model.model.layers[1].mlp.experts
    x = torch.randn(6, model.config.hidden_size)
    ids = torch.randint(0, experts.num_experts, (6, 2))
    w = torch.rand(6, 2)
    padded_ids = torch.cat([ids, torch.full((6, 1), -1)], 1)
    padded_w = torch.cat([w, torch.zeros(6, 1)], 1)
    assert torch.allclose(experts(x, padded_ids, padded_w, padded=True), experts(x, ids, w), atol=1e-5)


def test_a_decode_steps_large_bf16_experts_read_nothing_back_and_keep_their_bits():
    """bf16 experts past moe_kernels.BF16_EXPERT_MAX (DeepSeek's) take oneDNN's grouped GEMMs, whose group sizes
    the host buckets (a count read back). A decode step's rows (`static`) give every group one zero row more
    instead: the same bits as the bucketed groups (a group of one never runs as oneDNN's GEMV), no read back, so a
    recorded step takes it and replays it on other picks. (On a CPU without bf16 arithmetic such experts are widened
    by the MoE kernel instead, every row: moe_kernels.widened_experts; oneDNN's emulated bf16 rows there depend on
    the row count, so the bucketing's premise is a bf16 CPU's. The recording holds either way.)"""
    from shared.model import moe_kernels
    from shared.model.moe import Experts
    from shared.model.tape import record

    torch.manual_seed(0)
    experts = Experts(16, 512, 256, torch.bfloat16, first_expert=0, num_local=16, fmt=None)
    assert 512 * 256 > moe_kernels.BF16_EXPERT_MAX
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    for m in (1, 2, 5, 17, 64) if not moe_kernels.widened_experts(experts.gate_up_proj) else ():
        rows, ids = torch.randn(m, 512).bfloat16(), torch.randint(0, 16, (m,))
        for padded in (False, True):
            picks = torch.where(torch.rand(m) < 0.3, 19, ids) if padded else ids  # EP: foreign picks
            assert torch.equal(experts.run(rows, picks, padded, static=True), experts.run(rows, picks, padded))
    x, ids, weights = torch.randn(6, 512).bfloat16(), torch.randint(0, 16, (6, 4)), torch.rand(6, 4)
    with torch.inference_mode():
        out, recording = record(lambda: experts(x, ids, weights, generated=6))
        assert recording.tape is not None, recording.refused
        ids.copy_(torch.randint(0, 16, (6, 4)))  # other picks, other group sizes
        recording.tape.replay()
        assert torch.equal(out, experts(x, ids, weights, generated=6))
