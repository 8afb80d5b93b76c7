"""The CPU kernels' matmuls (shared.model.cpu_kernels, shared.model.moe_kernels), as shared.model.ops chooses them,
against the portable torch path: a step's decode linears and MLA head matmuls, the router and the fused MoE. The
`portable` fixture (the library off or on) is in tests/conftest.py."""

from __future__ import annotations

import pytest
import torch

from shared.model import cpu_kernels, moe_kernels, ops


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_and_head_matmul_match_torch(portable, weight_dtype):
    """The generated rows of a step's linears, and MLA's per-head absorbed matmuls, in one call each:
    torch's result to a bf16 rounding step (fp32 sums in another order), strided views included; the
    step's prompt rows are the portable path's own. With bf16 weights (a bf16 model's, where the CPU has bf16
    dot products: vdpbf16ps) too."""
    from shared.model.layers import Linear

    gen = torch.Generator().manual_seed(12)
    lin = Linear(256, 96, bias=False, dtype=weight_dtype)
    lin.weight.data.copy_(torch.randn(96, 256, generator=gen) * 0.05)
    kernel_calls = []
    real = cpu_kernels.linear
    for rows, generated in ((1, 1), (40, 40), (12, 5)):
        x = torch.randn(rows, 256, generator=gen).bfloat16()
        portable(True)
        want = lin(x)
        portable(False)
        cpu_kernels.linear = lambda *a: kernel_calls.append(1) or real(*a)
        try:
            got = lin(x, generated)
        finally:
            cpu_kernels.linear = real
        assert kernel_calls, "the generated rows did not take the kernel"
        assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max() <= 2 ** -7 * want.abs().max()
        assert torch.equal(got[generated:], want[generated:])
        assert torch.equal(lin(x[:1], 1), got[:1])  # a generated row alone: the bits it has in its batch
    assert torch.equal(lin(x), want)  # outside a step: no generated rows, the portable path

    q = torch.randn(5, 4, 96, generator=gen).bfloat16()[..., :32]  # q_nope: a strided split of q
    w_uk = torch.randn(4, 32, 512, generator=gen).to(weight_dtype)
    query = torch.zeros(5, 4, 576)
    assert cpu_kernels.head_matmul(q, w_uk, query[..., :512])
    want = torch.bmm(q.float().transpose(0, 1), w_uk.float()).transpose(0, 1)
    assert (query[..., :512] - want).abs().max() < 1e-4 and not query[..., 512:].any()
    o_lat, w_uv = torch.randn(5, 4, 512, generator=gen), torch.randn(4, 512, 32, generator=gen).to(weight_dtype)
    if weight_dtype == torch.bfloat16:
        o_lat = o_lat.bfloat16()  # a bf16 model's latent: bf16 times bf16 by vdpbf16ps
    o = torch.empty(5, 4 * 32, dtype=torch.bfloat16)
    assert cpu_kernels.head_matmul(o_lat, w_uv, o.view(5, 4, 32))
    want = torch.bmm(o_lat.float().transpose(0, 1), w_uv.float()).transpose(0, 1).reshape(5, 128).bfloat16()
    assert (o.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_linear_many_is_each_linear_in_one_call(x_dtype):
    """Layers fed the same rows (q_a and kv_a, gate and up) in one call (the rows packed once, the weights' rows
    shared out as one range): each output the bits linear() gives it alone, at row counts odd and even and
    output widths that are not multiples of four (a weight's rows cut between tasks); the model's MLP takes it
    (layers.same_input) with the bits of its separate calls. Weights of another width or dtype: None, nothing run.
    Without the wide tiles (neither AVX-512 nor AVX2 + FMA) it declines every call (None) and the MLP takes its
    separate calls."""
    from shared.model.layers import MLP

    wide = cpu_kernels.wide_tiles()
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(m, 256, generator=gen) * 0.05 for m in (64, 578, 7)]
    for rows in (2, 13, 64, 300):
        x = torch.randn(rows, 256, generator=gen).to(x_dtype)
        got = cpu_kernels.linear_many(x, weights)
        if not wide:
            assert got is None
            continue
        assert got is not None and len(got) == 3
        for w, y in zip(weights, got, strict=True):
            assert y.dtype == x_dtype and torch.equal(y, cpu_kernels.linear(x, w))
    assert cpu_kernels.linear_many(x, [weights[0], torch.randn(8, 128)]) is None  # another k: hostile, refused
    assert cpu_kernels.linear_many(x, [weights[0], weights[1].bfloat16()]) is None
    mlp = MLP(256, 96, torch.float32)
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.05)
    x = torch.randn(40, 256, generator=gen).to(x_dtype)
    separate = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x, 40)) * mlp.up_proj(x, 40), 40)
    assert torch.equal(mlp(x, 40), separate)


def test_head_matmul_rows_are_batch_invariant_at_many_heads():
    """MLA's absorbed matmuls for generated rows take the kernel at any head count (DeepSeek's 128 included):
    a row gets the same bits alone as in any group of rows (row groups of 8 and their remainders), over k and
    m that are not multiples of the kernel's steps. fp32 rows (the attention's latent outputs) and fp32 outputs (the
    absorbed queries) as strided views, which the wide tiles read and write where they lie: the gaps untouched."""
    gen = torch.Generator().manual_seed(13)
    f32, bf16 = torch.float32, torch.bfloat16
    for heads, k, m, dtype, x_dtype in ((40, 30, 37, f32, bf16), (128, 64, 48, f32, bf16), (128, 64, 48, bf16, bf16),
                                        (6, 512, 32, bf16, bf16), (4, 512, 64, f32, f32), (4, 32, 512, f32, f32)):
        x = torch.randn(11, heads, k + 3, generator=gen).to(x_dtype)[..., 2 : 2 + k]
        w = torch.randn(heads, k, m, generator=gen).to(dtype)
        padded = torch.zeros(11, heads, m + 64)
        batched = padded[..., :m]
        assert cpu_kernels.head_matmul(x, w, batched)
        assert not padded[..., m:].any()
        for i in (0, 7, 8, 10):
            alone = torch.empty(1, heads, m)
            assert cpu_kernels.head_matmul(x[i : i + 1], w, alone)
            assert torch.equal(alone[0], batched[i]), (heads, i)
        want = torch.bmm(x.double().transpose(0, 1), w.double()).transpose(0, 1)
        assert (batched.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_bf16_linear_rows_are_batch_invariant():
    """A bf16 model's decode linears (bf16 rows times a bf16 weight by vdpbf16ps, where the CPU has it): a row
    gets the same bits alone as in any batch (register blocks of 6, 4 and 2 rows and their remainders; outputs
    past a whole block of 4), and each output is the fp32 dot to its bf16 rounding; a K the kernel does not
    take (not a multiple of 16) leaves the portable path, as every bf16 weight does on a CPU without bf16 dots."""
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(38, 64, generator=gen).bfloat16()
    x = torch.randn(13, 64, generator=gen).bfloat16()
    if not cpu_kernels.library().dots_bf16():  # no bf16 dot products: bf16 weights keep the portable path
        assert cpu_kernels.linear(x, w) is None
        return
    batched = cpu_kernels.linear(x, w)
    for i in range(13):
        assert torch.equal(cpu_kernels.linear(x[i : i + 1], w)[0], batched[i]), i
    for n in (2, 3, 5, 7, 12):
        assert torch.equal(cpu_kernels.linear(x[:n], w), batched[:n]), n
    want = (x.double() @ w.double().T).bfloat16()
    assert ((batched.double() - want.double()).abs() <= 2**-7 * want.double().abs()).all()
    assert cpu_kernels.linear(torch.randn(3, 40).bfloat16(), torch.randn(8, 40).bfloat16()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups", [(2, 1, 2, 8), (1, 1, 2, 8), (4, 2, 4, 16)])  # n_group, topk_group, top_k, E
def test_fused_moe_matches_router_and_grouped_experts(portable, dtype, groups, monkeypatch):
    """The fused router + routed + shared experts picks moe.Gate's experts and gives moe.MoE's portable
    output (bf16: within a rounding step; fp32: to rounding) for the generated rows of a step, any
    number of them (chunked past chunk_rows: its scratch budget set to 64 rows here), while the step's prompt
    rows keep the portable path (where ops.every_row holds, an AVX-512 or AVX2 + FMA build's fp32 weights,
    every row is fused); outside a step (no generated rows) nothing is fused."""
    from shared.config import ModelConfig
    from shared.loader.tiny import make_config
    from shared.model.moe import MoE

    n_group, topk_group, top_k, experts = groups
    cfg = ModelConfig.from_dict(make_config("deepseek_v3", n_group=n_group, topk_group=topk_group,
                                            num_experts_per_tok=top_k, n_routed_experts=experts))
    moe = MoE(cfg, torch.float32)
    chunk = 64
    per_row = moe_kernels.MOE_SCRATCH_BYTES // moe_kernels.chunk_rows(cfg.hidden_size, cfg.moe_intermediate_size, top_k)
    monkeypatch.setattr(moe_kernels, "MOE_SCRATCH_BYTES", chunk * per_row)
    assert moe_kernels.chunk_rows(cfg.hidden_size, cfg.moe_intermediate_size, top_k) == chunk
    gen = torch.Generator().manual_seed(experts + top_k)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    real = moe_kernels.moe_routed
    fused_rows: list[int] = []

    def counting(x: torch.Tensor, *args, **kwargs):
        fused_rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    every_row = ops.every_row(moe.experts.gate_up_proj)
    with torch.inference_mode():
        for rows, generated in ((1, 1), (8, 8), (chunk + 5, chunk + 5),
                                (10, 4), (6, 0)):
            x = torch.randn(rows, cfg.hidden_size, generator=gen).to(dtype)
            portable(True)
            want, prompt_rows = moe(x), moe(x[generated:])
            want_ids, _ = moe.gate(x)
            portable(False)
            fused_rows.clear()
            moe_kernels.moe_routed = counting
            try:
                got = moe(x, generated)
            finally:
                moe_kernels.moe_routed = real
            if every_row:  # fp32 weights where the kernels have wide tiles: the prompt rows are the kernel's too
                assert fused_rows == [rows]
                assert torch.equal(got[generated:], moe(x[generated:], rows - generated))
                generated = rows
            else:
                assert fused_rows == ([generated] if generated else [])
                assert torch.equal(got[generated:], prompt_rows)  # prompt rows: the portable path itself
            if generated:
                _, ids = real(x[:generated], moe.gate.weight, moe.gate.e_score_correction_bias, n_group, topk_group,
                              top_k, True, moe.gate.scaling, moe.experts.gate_up_proj, moe.experts.down_proj)
                assert torch.equal(ids.sort(-1).values, want_ids[:generated].sort(-1).values)
            err = (got.float() - want.float()).abs().max().item()
            assert err <= (1e-5 if dtype == torch.float32 else 2 ** -7) * want.float().abs().max().item(), err


def test_a_bf16_models_generated_rows_take_the_experts_kernel_alike_on_one_rank_and_over_ep(portable):
    """A bf16 model's MoE (weights bf16, as it keeps them on CPUs with bf16 arithmetic): the shared expert stays
    portable, a step's generated rows are routed by the router kernel (route); the routed experts of a step's
    generated rows run in moe_experts, on one rank and on
    each EP rank alike (EP ranks pass each received row's generated flag), so a decode does not depend on the
    instance shape that serves it (tests/test_selective.py and tests/test_mtp_served.py compare a DP2/EP2
    decode with a one-rank engine). Prompt rows keep the portable grouped matmuls bit for bit (on a CPU without
    bf16 arithmetic the kernel takes them too: moe_kernels.widened_experts); a generated
    row's bits do not depend on the rows beside it; bf16 weights give their fp32 copies' result (their bits where
    the CPU has no bf16 dot products)."""
    from shared.config import ModelConfig
    from shared.loader.tiny import make_config
    from shared.model.moe import Experts, MoE

    cfg = ModelConfig.from_dict(make_config("deepseek_v3", n_group=2, topk_group=1, num_experts_per_tok=2,
                                            n_routed_experts=8))
    moe = MoE(cfg, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    weights = moe.fused_weights()
    assert weights is not None and not moe_kernels.moe_usable(torch.zeros(1, cfg.hidden_size).bfloat16(),
                                                              weights.gate_up, weights.down)
    with torch.inference_mode():
        x = torch.randn(13, cfg.hidden_size, generator=gen).bfloat16()
        portable(True)
        want = moe(x, 9)
        portable(False)
        got = moe(x, 9)
        ids, w = moe.gate(x, 9)
        if moe_kernels.widened_experts(moe.experts.gate_up_proj):  # no bf16 arithmetic: every row the kernel's
            routed = moe_kernels.moe_experts(x[9:], ids[9:], w[9:], moe.experts.gate_up_proj, moe.experts.down_proj)
            assert torch.equal(got[9:], (routed + moe.shared_experts(x[9:]).float()).to(torch.bfloat16))
        else:
            assert torch.equal(got[9:], want[9:])  # prompt rows: the portable path itself
        assert not torch.equal(got[:9], want[:9])  # generated rows: the kernel's sums (rounded otherwise)
        err = (got[:9].float() - want[:9].float()).abs().max().item()
        assert err <= 2 ** -6 * want.float().abs().max().item(), err
        routed = moe_kernels.moe_experts(x[:9], ids[:9], w[:9], moe.experts.gate_up_proj, moe.experts.down_proj)
        assert torch.equal(got[:9], (routed + moe.shared_experts(x[:9], 9).float()).to(torch.bfloat16))
        assert torch.equal(moe(x[3:4], 1), got[3:4])  # alone or beside others
        # fp32 weight copies (a CPU without bf16 arithmetic keeps them): fused multiply-adds; bf16 rows and weights
        # take vdpbf16ps where the CPU has it: the same sums to rounding, each expert's output then rounded to bf16
        copies = moe_kernels.moe_experts(x[:9], ids[:9], w[:9], moe.experts.gate_up_proj.float(),
                                         moe.experts.down_proj.float())
        assert (routed - copies).abs().max().item() <= 2**-7 * routed.abs().max().item()
        if not cpu_kernels.bf16_dots():
            assert torch.equal(routed, copies)  # widened in registers: the copies' bits
        # two EP ranks of four experts each: partial sums of the picks each holds (foreign ones masked to -1,
        # as _forward_ep sends them), added as the combine does
        generated = torch.arange(13) < 9
        one_rank = moe.experts(x, ids, w, generated=generated)
        total = torch.zeros_like(one_rank)
        for rank in range(2):
            held = Experts(8, cfg.hidden_size, cfg.moe_intermediate_size, torch.bfloat16, first_expert=4 * rank,
                           num_local=4)
            held.gate_up_proj.data.copy_(moe.experts.gate_up_proj[4 * rank:4 * rank + 4])
            held.down_proj.data.copy_(moe.experts.down_proj[4 * rank:4 * rank + 4])
            mine = ids // 4 == rank
            total += held(x, torch.where(mine, ids, -1), torch.where(mine, w, 0.0), padded=True, generated=generated)
        one_side = (ids // 4 == ids[:, :1] // 4).all(1)  # rows whose picks one rank holds: nothing to reorder
        assert one_side[:9].any() and torch.equal(total[one_side], one_rank[one_side])
        err = (total - one_rank).abs().max().item()
        assert err <= 1e-6 * one_rank.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_kernel_routes_generated_rows_as_the_gate_alone_or_batched(portable, dtype):
    """moe.Gate's generated rows through moe_kernels.route: the portable router's experts and weights (to fp32
    rounding), the fused MoE's picks bit for bit (the same row function), a row's picks and weights the same
    alone as beside others; the step's prompt rows keep the portable router (where ops.every_row holds for the
    gate's weight, the kernel's too); a gate the kernel does not take
    (a bias of the wrong length) is refused by name."""
    from shared.config import ModelConfig
    from shared.loader.tiny import make_config
    from shared.model.moe import Gate

    cfg = ModelConfig.from_dict(make_config("deepseek_v3", n_group=4, topk_group=2, num_experts_per_tok=4,
                                            n_routed_experts=16))
    gate = Gate(cfg, dtype)
    gen = torch.Generator().manual_seed(11)
    gate.weight.data.copy_(torch.randn(gate.weight.shape, generator=gen) * 0.05)
    gate.e_score_correction_bias.data.copy_(torch.randn(16, generator=gen) * 0.01)
    x = torch.randn(40, cfg.hidden_size, generator=gen).to(dtype)
    with torch.inference_mode():
        portable(True)
        want_ids, want_w = gate(x, 40)
        portable(False)
        ids, w = gate(x, 40)
        order, want_order = ids.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
        err = (w.gather(1, order) - want_w.gather(1, want_order)).abs().max().item()
        assert err <= 1e-6, err
        for r in (0, 17, 39):
            alone = gate(x[r:r + 1], 1)
            assert torch.equal(alone[0], ids[r:r + 1]) and torch.equal(alone[1], w[r:r + 1])
        mixed_ids, mixed_w = gate(x, 10)
        assert torch.equal(mixed_ids[:10], ids[:10]) and torch.equal(mixed_w[:10], w[:10])
        prompt_ids, prompt_w = (ids, w) if ops.every_row(gate.weight) else (want_ids, want_w)  # fp32, wide: kernel
        assert torch.equal(mixed_ids[10:], prompt_ids[10:]) and torch.equal(mixed_w[10:], prompt_w[10:])
        inter = cfg.moe_intermediate_size
        _, fused_ids = moe_kernels.moe_routed(x, gate.weight.float(), gate.e_score_correction_bias, 4, 2, 4, True,
                                              gate.scaling, torch.zeros(16, 2 * inter, cfg.hidden_size),
                                              torch.zeros(16, cfg.hidden_size, inter))
        assert torch.equal(fused_ids, ids)
        with pytest.raises(ValueError, match="route"):
            moe_kernels.route(x, gate.weight, torch.zeros(15), 4, 2, 4, True, 1.0)


def test_large_bf16_experts_keep_onednn_and_every_rank_chooses_alike(portable):
    """moe_experts multiplies in fp32: past BF16_EXPERT_MAX (hidden × moe_intermediate) a bf16 model's experts
    keep the portable grouped GEMMs (oneDNN's bf16 arithmetic, 2-4x faster there at 16-256 rows) for every row;
    the choice depends on the expert's shape only, so it is the same at every batch size and on an EP rank
    holding a slice of the experts. fp32 weights take the kernel at any size, and so do bf16 ones on a CPU without
    bf16 arithmetic (widened in registers; every row: oneDNN would emulate bf16 there)."""
    from shared.model.moe import Experts

    gen = torch.Generator().manual_seed(8)
    small_d, small_i = 256, moe_kernels.BF16_EXPERT_MAX // 256
    big_d, big_i = 512, 2 * moe_kernels.BF16_EXPERT_MAX // 512
    for d, i, takes in ((small_d, small_i, True), (big_d, big_i, False)):
        for local in (8, 4):  # one rank, an EP rank
            ex = Experts(8, d, i, torch.bfloat16, num_local=local)
            x = torch.zeros(1, d).bfloat16()
            widened = moe_kernels.widened_experts(ex.gate_up_proj)
            assert moe_kernels.experts_usable(x, ex.gate_up_proj, ex.down_proj) is (takes or widened)
            assert moe_kernels.experts_usable(x, ex.gate_up_proj.float(), ex.down_proj.float())
    ex = Experts(8, big_d, big_i, torch.bfloat16)
    for p in ex.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    x = torch.randn(6, big_d, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=gen)
    with torch.inference_mode():
        want = (moe_kernels.moe_experts(x, ids, w, ex.gate_up_proj, ex.down_proj) if widened
                else ex._weighted(x, ids, w, False))
        assert torch.equal(ex(x, ids, w, generated=torch.ones(6, dtype=torch.bool)), want)
        assert torch.equal(ex(x, ids, w), want)  # prompt rows alike


def _many_picks(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """fp32 experts (6 × 2·40 × 128) and 37 rows' top-2 picks: expert 5 picked by many, 0-4 by a few, one foreign
    pick (an EP rank's: skipped): (gate_up, down, x, ids, weights)."""
    gate_up, down = torch.randn(6, 2 * 40, 128, generator=gen) * 0.1, torch.randn(6, 128, 40, generator=gen) * 0.1
    x = torch.randn(37, 128, generator=gen).bfloat16()
    ids = torch.randint(0, 6, (37, 2), generator=gen)
    ids[:, 1] = torch.where(ids[:, 0] == 5, 4, 5)
    ids[3, 0] = 7
    return gate_up, down, x, ids, torch.rand(37, 2, generator=gen)


def _experts_alone_and_batched(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                               down: torch.Tensor) -> list[torch.Tensor]:
    """moe_experts over all rows, and over each row alone (concatenated)."""
    return [moe_kernels.moe_experts(x, ids, weights, gate_up, down),
            torch.cat([moe_kernels.moe_experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], gate_up, down)
                       for i in range(len(x))])]


def test_bf16_experts_keep_their_fp32_copies_bits_alone_and_batched():
    """bf16 experts on a CPU without bf16 dot products run widened (exact), as read or, for an expert many rows
    pick, its weight block widened once for all its rows' passes: every row gets its fp32 copies' bits, alone or
    beside the others. With bf16 dot products the kernel sums in pairs: alone == batched still holds."""
    gate_up, down, x, ids, weights = _many_picks(torch.Generator().manual_seed(23))
    batched, alone = _experts_alone_and_batched(x, ids, weights, gate_up.bfloat16(), down.bfloat16())
    assert torch.equal(batched, alone)
    if not cpu_kernels.bf16_dots():
        copies = _experts_alone_and_batched(x, ids, weights, gate_up.bfloat16().float(), down.bfloat16().float())
        assert torch.equal(batched, copies[0]) and torch.equal(alone, copies[1])


def _fp32_decode_matmuls(gen: torch.Generator) -> list[torch.Tensor]:
    """linear_rows, moe_experts and head_matmul on fp32 weights (a bf16 model's copies on a CPU without bf16
    arithmetic) over row counts that leave every remainder of the kernels' register blocks (pairs, groups of four
    pairs, four weight rows), each row also alone, and the picks of experts holding one, two and many rows."""
    out = []
    for n, k, m in ((2, 64, 48), (3, 256, 130), (9, 520, 33), (17, 2048, 517), (70, 64, 7), (5, 60, 9)):
        x, w = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen)
        out += [cpu_kernels.linear(x, w), torch.cat([cpu_kernels.linear(x[i : i + 1], w) for i in range(n)])]
    gate_up, down, x, ids, weights = _many_picks(gen)
    out += _experts_alone_and_batched(x, ids, weights, gate_up, down)
    for heads, k, m in ((3, 40, 64), (2, 512, 128), (5, 9, 33)):  # MLA's absorbed matmuls, 8 rows a group
        x, w = torch.randn(11, heads, k, generator=gen).bfloat16(), torch.randn(heads, k, m, generator=gen)
        batched, alone = torch.empty(11, heads, m), torch.empty(11, heads, m)
        assert cpu_kernels.head_matmul(x, w, batched)
        for i in range(11):
            assert cpu_kernels.head_matmul(x[i : i + 1], w, alone[i : i + 1])
        out += [batched, alone]
    return out


def _decode_attention(gen: torch.Generator) -> list[torch.Tensor]:
    """paged_mqa of fp32 queries (not bf16 values: the FMA path on every CPU) over fp32 and bf16 rows, 1 to 9
    heads (HB blocks and a partial one), contexts that leave every remainder of the kernel's four-row and 32-row
    tiles, a mask, and an output of 48 dims (a 32-dim block and a 16-dim one): all queries in one call, and each
    query alone (concatenated)."""
    out = []
    for rows_dtype, heads in ((torch.float32, 4), (torch.bfloat16, 1), (torch.bfloat16, 9)):
        pool = torch.randn(40, 8, 64, generator=gen).to(rows_dtype)
        tables = torch.randperm(40, generator=gen)[:35].view(5, 7)
        q, counts = torch.randn(5, heads, 64, generator=gen), torch.tensor([56, 1, 33, 30, 45])
        mask = torch.rand(5, 56, generator=gen) > 0.25
        for m in (None, mask):
            calls = [cpu_kernels.paged_mqa(q[i], pool, tables, 8, torch.arange(5)[i], counts[i], 0.125, 48, mask=m)
                     for i in [slice(0, 5)] + [slice(i, i + 1) for i in range(5)]]
            out += [calls[0], torch.cat(calls[1:])]
    return out


def _prompt_attention(gen: torch.Generator) -> list[torch.Tensor]:
    """prompt_attention_tile over two key tiles (the second folded online): 2 requests x 3 heads, 7 queries (a
    short last pass of four), 40 query dims, 45 keys a tile (a ragged last block of 32), 64 output dims, causal
    counts from none to past the tile: all queries in one call, and each alone (concatenated)."""
    g, s, qk, k, v = 6, 7, 40, 45, 64
    q = torch.randn(g, s, qk, generator=gen)
    tiles = [(torch.randn(g, qk, k, generator=gen), torch.randn(g, k, v, generator=gen)) for _ in range(2)]
    visible = torch.tensor([[0, 1, 9, 30, 44, 45, 60], [3, 3, 17, 45, 2, 0, 50]])
    out = []
    for queries in [slice(0, s)] + [slice(i, i + 1) for i in range(s)]:
        n = queries.stop - queries.start
        state = (torch.empty(g, n), torch.empty(g, n), torch.empty(g, n, v))
        for t, (keys_t, values) in enumerate(tiles):
            assert cpu_kernels.prompt_attention_tile(q[:, queries].contiguous(), keys_t, values, k - 3 * t,
                                                     visible[:, queries] - 20 * t, state, t == 0)
        out.append(torch.cat([state[0][..., None], state[1][..., None], state[2]], -1))
    return [out[0], torch.cat(out[1:], 1)]


def test_fp32_decode_matmuls_and_attention_keep_a_rows_bits_on_every_isa(monkeypatch, arch_builds):
    """The fp32 decode linears, experts and MLA head matmuls, and attention over fp32 or bf16 rows, give a row the
    same bits alone as in any batch, and the same on every ISA the kernels build for: AVX-512 (two rows' lanes a
    register, four weight rows by eight input rows a pass; a head's 32 outputs of 8 rows in registers;
    attention's scores of two rows and p.V of 16 dims a register: where this CPU has it), AVX2 + FMA (two weight
    rows by six input rows a register block, in the same passes) and SSE (no FMA unit: fmaf in software); prompt
    attention's key tiles too. Each output is the fp32 dot product to a rounding."""
    flags = next((line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")), "").split()
    arches = ["native"] + [arch for arch, need in (("haswell", {"avx2", "fma", "bmi2"}),
                                                   ("x86-64-v2", {"sse4_2", "popcnt"})) if need <= set(flags)]
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(arch_builds))
    results = {}
    for arch in arches:
        monkeypatch.setenv("PDSERVE_KERNEL_ARCH", arch)
        monkeypatch.setattr(cpu_kernels, "_tried", False)
        monkeypatch.setattr(cpu_kernels, "_library", None)
        gen = torch.Generator().manual_seed(21)
        results[arch] = _fp32_decode_matmuls(gen) + _decode_attention(gen) + _prompt_attention(gen)
        for batched, alone in zip(results[arch][::2], results[arch][1::2], strict=True):
            assert torch.equal(batched, alone), arch
    for arch in arches[1:]:
        for got, want in zip(results[arch], results["native"], strict=True):
            assert torch.equal(got, want), arch
    gen = torch.Generator().manual_seed(21)
    x, w = torch.randn(2, 64, generator=gen).bfloat16(), torch.randn(48, 64, generator=gen)
    want = (x.double() @ w.double().T).bfloat16()
    assert ((results["native"][0].double() - want.double()).abs() <= 2**-7 * want.double().abs() + 1e-6).all()


def test_expert_activation_holds_over_the_whole_range():
    """The experts' silu (gate · sigmoid(gate), eight lanes at a time from one exp of -|gate|) is torch's silu to
    two fp32 ulps at every gate value, including past ±88 where e^|gate| overflows fp32 (the output there: the
    gate; below -87, where the exp flushes to zero, -0 for values under 1e-35), and NaN stays NaN. One expert
    whose gate row reads x[:, 0], up row x[:, 1] (= 1), and whose down projection copies the activation out."""
    dim, inter = 16, 8
    gate = torch.cat([torch.linspace(-300, 300, 6001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5,
                                                                     88.8, -88.8, float("nan")])])
    x = torch.zeros(len(gate), dim)
    x[:, 0], x[:, 1] = gate, 1.0
    gate_up = torch.zeros(1, 2 * inter, dim)
    gate_up[0, :inter, 0] = 1.0
    gate_up[0, inter:, 1] = 1.0
    down = torch.zeros(1, dim, inter)
    down[0, :inter, :inter] = torch.eye(inter)
    ids, weights = torch.zeros(len(gate), 1, dtype=torch.long), torch.ones(len(gate), 1)
    got = moe_kernels.moe_experts(x, ids, weights, gate_up, down)[:, :inter]
    want = torch.nn.functional.silu(gate.double())[:, None].expand(-1, inter)
    finite = ~gate.isnan()
    err = (got[finite].double() - want[finite]).abs()
    assert (err <= 2 * 2.0**-23 * want[finite].abs() + 1e-35).all()
    assert got[~finite].isnan().all()


def test_a_steps_scratch_stays_in_the_heap_for_the_next_step():
    """Loading the kernels keeps freed heap memory in the process (kernel_build._keep_freed_memory): the routed
    experts of a 4,096-row prefill chunk (~40 MB of scratch a call, allocated and freed in the call) fault in no
    fresh pages on later calls, where glibc's defaults unmap or trim it and fault in ~10,000 zeroed pages a call."""
    import subprocess
    import sys

    code = """
import resource, torch
from shared.model import moe_kernels
g = torch.Generator().manual_seed(0)
gate_up, down = torch.randn(8, 256, 256, generator=g).bfloat16(), torch.randn(8, 256, 128, generator=g).bfloat16()
x = torch.randn(4096, 256, generator=g).bfloat16()
ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4096)])
weights = torch.rand(4096, 2, generator=g)
for _ in range(2):
    moe_kernels.moe_experts(x, ids, weights, gate_up, down)
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    moe_kernels.moe_experts(x, ids, weights, gate_up, down)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    faults = [int(f) for f in out.stdout.split()]
    assert len(faults) == 3 and max(faults) < 2500, faults  # a heap the threads still grow: ~1,000 the first times
