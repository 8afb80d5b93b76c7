"""W8A8 CPU kernels (shared.model.int8_kernels): exact int32 products on every ISA build, the fused
quantizer's bits, the one-call MoE against the portable experts, row independence, hostile inputs, and a
W8A8 model's logits against the fp32 reference."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

import shared.model.int8_kernels as int8_kernels
from shared.device import accelerator, int8_matmul
from shared.quant.int8 import grouped_w8a8, quantize_activation, quantize_weight

# W8A8 logits vs the fp32 model on the tiny random model (near-flat logits, so the bound is on the cosine and
# on the error relative to the logits' spread): measured 0.9983 / 0.25 with exact int32 sums
LOGIT_COSINE = 0.995
LOGIT_REL_MAX = 0.35  # max |Δ| / max |logit|


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(shape: tuple[int, ...], g: torch.Generator, low: int = -127) -> torch.Tensor:
    return torch.randint(low, 128, shape, generator=g, dtype=torch.int8)


@pytest.fixture
def rebuild(monkeypatch):
    """Build the library for another -march (PDSERVE_KERNEL_ARCH), restored afterwards."""

    def build(arch: str | None) -> None:
        if arch is not None:
            monkeypatch.setenv("PDSERVE_KERNEL_ARCH", arch)
        monkeypatch.setattr(int8_kernels, "_tried", False)
        monkeypatch.setattr(int8_kernels, "_library", None)
        assert int8_kernels.library() is not None

    yield build
    monkeypatch.undo()
    int8_kernels._tried, int8_kernels._library = False, None


# odd shapes: K off every vector width (17, 100, 129, 1000), one row, odd N, a long K (7168: DeepSeek's hidden)
SHAPES = [(1, 17, 5), (3, 100, 33), (5, 64, 4), (130, 129, 67), (17, 1000, 7), (1, 7168, 9), (64, 256, 48)]


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_int8_gemm_is_exact_in_int32(m, k, n):
    g = _gen(m * 1000 + k)
    x, w = _int8((m, k), g, low=-128), _int8((n, k), g)
    x[0, : min(k, 7)] = -128  # activations may hold -128 (the quantizer never makes it, the kernel takes it)
    x[-1], w[0] = 127, 127  # the largest sums
    w[-1] = -127
    got = int8_kernels.int_matmul(x, w)
    want = x.long() @ w.long().t()
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert torch.equal(got, torch._int_mm(x, w.t()))  # the portable CPU path (shared.device.int8_matmul)


def _hard_rows(k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(12, k, generator=g) * torch.logspace(-6, 4, 12)[:, None]
    x[0] = 0  # all zero: the 1e-12 scale floor
    x[1, 3] = 1e4  # an outlier channel
    x[2] = 127 * torch.randint(-3, 4, (k,), generator=g) / 2  # exact halves: round half to even
    x[3] = torch.tensor(1e-40).expand(k)  # subnormals
    x[4, : k // 2] = -x[4, : k // 2].abs() * 1e3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [17, 64, 333])
def test_fused_quantization_is_bit_equal_to_quantize_activation(dtype, k):
    g = _gen(k)
    x = _hard_rows(k, dtype, g)
    q, s = int8_kernels.quantize(x)
    want_q, want_s = quantize_activation(x)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    # and inside the matmul (fused path for K >= SMALL_K, quantize + _int_mm + rescale below): the torch path's bits
    w, sw = quantize_weight(torch.randn(40, k, generator=g))
    for out in (torch.float32, torch.bfloat16):
        want = (torch._int_mm(want_q, w.t()).float() * want_s * sw).to(out)
        assert torch.equal(int8_kernels.linear(x, w, sw, out), want)


def _moe_weights(e: int, d: int, inter: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    gu, gus = quantize_weight(torch.randn(e, 2 * inter, d, generator=g) * 0.05)
    dn, dns = quantize_weight(torch.randn(e, d, inter, generator=g) * 0.05)
    return {"gate_up": gu, "gate_up_scale": gus, "down": dn, "down_scale": dns}


def _portable_moe(x, ids, wts, w, shared=None) -> torch.Tensor:
    """moe.Experts' portable W8A8 path (+ layers.MLP of W8A8 linears for the shared expert), in torch."""
    n, k = ids.shape
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    offsets = torch.bincount(flat, minlength=w["gate_up"].shape[0]).cumsum(0).to(torch.int32)
    gate_up = grouped_w8a8(x.repeat_interleave(k, 0)[order], w["gate_up"], w["gate_up_scale"], offsets)
    gate, up = gate_up.chunk(2, -1)
    out = grouped_w8a8(F.silu(gate) * up, w["down"], w["down_scale"], offsets)
    res = torch.empty_like(out, dtype=x.dtype)
    res[order] = out.to(x.dtype)
    y = (res.view(n, k, -1).float() * wts[..., None]).sum(1)
    if shared is not None:
        sg, sgs, su, sus, sd, sds = shared

        def lin(a, wq, sc):
            q, s = quantize_activation(a)
            return (torch._int_mm(q, wq.t()).float() * s * sc).to(a.dtype)

        y = y + lin(F.silu(lin(x, sg, sgs)) * lin(x, su, sus), sd, sds).float()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_kernel_matches_the_portable_experts(dtype):
    g = _gen(3)
    e, d, inter, n, k = 8, 200, 72, 37, 3  # D and I off the vector widths
    w = _moe_weights(e, d, inter, g)
    shared = (*quantize_weight(torch.randn(48, d, generator=g) * 0.05), *quantize_weight(torch.randn(48, d, generator=g)
              * 0.05), *quantize_weight(torch.randn(d, 48, generator=g) * 0.05))
    x = torch.randn(n, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    ids[5] = torch.tensor([2, 2, 2])[:k]  # repeated picks of one expert
    wts = torch.rand(n, k, generator=g)
    for sh in (None, shared):
        got = int8_kernels.moe(x, ids, wts, w["gate_up"], w["gate_up_scale"], w["down"], w["down_scale"], dtype,
                               shared=sh)
        want = _portable_moe(x, ids, wts, w, sh)
        # the same integer sums; silu's exp and the k-sum order may round differently (then a quantized value
        # can move by one step): a few bf16 ulps at most
        err = ((got - want).abs() / (want.abs() + 1e-3)).max().item()
        print(f"moe kernel vs portable ({dtype}, shared={sh is not None}): max relative error {err:.2e}")
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-3)


def test_moe_padding_picks_add_nothing_and_foreign_ids_raise():
    g = _gen(4)
    e, d, inter, n = 4, 64, 32, 6
    w = _moe_weights(e, d, inter, g)
    x = torch.randn(n, d, generator=g)
    ids = torch.tensor([[0, 5], [1, -1], [3, 2], [9, 9], [0, 1], [2, 3]])
    wts = torch.rand(n, 2, generator=g)
    args = (w["gate_up"], w["gate_up_scale"], w["down"], w["down_scale"], torch.float32)
    padded = int8_kernels.moe(x, ids, wts, *args, padded=True)
    masked = torch.where((ids >= 0) & (ids < e), ids, 0)
    keep = torch.where((ids >= 0) & (ids < e), wts, 0.0)
    assert torch.equal(padded, int8_kernels.moe(x, masked, keep, *args))
    assert torch.equal(padded[3], torch.zeros(d))
    with pytest.raises(ValueError, match="outside"):
        int8_kernels.moe(x, ids, wts, *args)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Exact int32 sums and per-row quantization: a row alone, in a batch of 70, at another position, or in a
    prompt split into chunks gives the same bits (linear and MoE)."""
    g = _gen(5)
    x = torch.randn(70, 512, generator=g).bfloat16()
    w, sw = quantize_weight(torch.randn(96, 512, generator=g))
    whole = int8_kernels.linear(x, w, sw)
    assert torch.equal(torch.cat([int8_kernels.linear(x[i : i + 1], w, sw) for i in range(70)]), whole)
    assert torch.equal(torch.cat([int8_kernels.linear(c, w, sw) for c in x.split(13)]), whole)
    # a prompt-sized step (>= MANY_ROWS rows) takes oneDNN's int8 GEMM in row tiles (256 rows at K 512, N 4096),
    # here two and a part: the kernel's bits, row by row
    wide, swide = quantize_weight(torch.randn(4096, 512, generator=g))
    tile = int8_kernels.row_tile(512, 4096)
    assert int8_kernels.MANY_ROWS <= tile
    # at DeepSeek's o_proj (K 16,384, N 7,168) a tile's int32 products stay bounded (64 MiB)
    o_proj = int8_kernels.row_tile(16384, 7168)
    assert o_proj >= 1024 and o_proj * 7168 * 4 <= int8_kernels.INT32_TILE_MAX_BYTES
    prompt = torch.randn(2 * tile + 100, 512, generator=g).bfloat16()
    assert torch.equal(int8_kernels.linear(prompt, wide, swide),
                       torch.cat([int8_kernels.linear(c, wide, swide) for c in prompt.split(50)]))
    mw = _moe_weights(8, 512, 128, g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(70)])
    wts = torch.rand(70, 2, generator=g)
    args = (mw["gate_up"], mw["gate_up_scale"], mw["down"], mw["down_scale"], torch.bfloat16)
    whole = int8_kernels.moe(x, ids, wts, *args)
    alone = torch.cat([int8_kernels.moe(x[i : i + 1], ids[i : i + 1], wts[i : i + 1], *args) for i in (0, 41, 69)])
    assert torch.equal(alone, whole[[0, 41, 69]])
    perm = torch.randperm(70, generator=g)
    assert torch.equal(int8_kernels.moe(x[perm], ids[perm], wts[perm], *args), whole[perm])


def test_hostile_shapes_and_dtypes_fall_back_or_raise():
    g = _gen(6)
    x = torch.randn(4, 64, generator=g)
    w, sw = quantize_weight(torch.randn(8, 64, generator=g))
    assert int8_kernels.linear(x.half(), w, sw) is None  # fp16 rows: the portable path
    assert int8_kernels.linear(x, w.float(), sw) is None  # not int8
    assert int8_kernels.linear(x, w.t().contiguous().t(), sw) is None  # non-contiguous weight
    assert int8_kernels.linear(x, w, sw[:4]) is None  # scale of another width
    assert int8_kernels.linear(torch.randn(4, 63), w, sw) is None  # K mismatch
    assert int8_kernels.int_matmul(x.to(torch.int8), w[:, :32]) is None
    mw = _moe_weights(4, 64, 32, g)
    ids = torch.zeros(4, 2, dtype=torch.long)
    assert int8_kernels.moe(x, ids, torch.ones(4, 3), mw["gate_up"], mw["gate_up_scale"], mw["down"],
                            mw["down_scale"], torch.float32) is None  # weights of another shape than ids
    assert int8_kernels.moe(x, ids, torch.ones(4, 2), mw["gate_up"], mw["gate_up_scale"], mw["down"][:, :, :16],
                            mw["down_scale"], torch.float32) is None
    with pytest.raises(ValueError):
        int8_kernels.moe(x, ids - 3, torch.ones(4, 2), mw["gate_up"], mw["gate_up_scale"], mw["down"],
                         mw["down_scale"], torch.float32)
    strided = torch.randn(4, 128, generator=g)[:, ::2]  # rows with a stride: copied, same result
    assert torch.equal(int8_kernels.linear(strided, w, sw), int8_kernels.linear(strided.contiguous(), w, sw))


def _cpu_runs(arch: str) -> bool:
    if platform.machine() != "x86_64":
        return arch == "native"
    flags = next(line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")).split()
    return arch != "x86-64-v3" or {"avx2", "fma", "bmi2"} <= set(flags)


def _outputs() -> list[torch.Tensor]:
    """Every kernel entry point on fixed inputs (K both sides of SMALL_K, odd tails)."""
    g = _gen(7)
    outs: list[torch.Tensor] = []
    for m, k, n in [(1, 17, 5), (9, 129, 33), (66, 300, 50), (5, 1000, 7)]:
        x, w = _int8((m, k), g, low=-128), _int8((n, k), g)
        outs.append(int8_kernels.int_matmul(x, w))
        xf = torch.randn(m, k, generator=g)
        wq, sw = quantize_weight(torch.randn(n, k, generator=g))
        outs += [*int8_kernels.quantize(xf), int8_kernels.linear(xf, wq, sw),
                 int8_kernels.linear(xf.bfloat16(), wq, sw)]
    mw = _moe_weights(6, 200, 72, g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(19)])
    for dtype in (torch.float32, torch.bfloat16):
        outs.append(int8_kernels.moe(torch.randn(19, 200, generator=g).to(dtype), ids, torch.rand(19, 2, generator=g),
                                     mw["gate_up"], mw["gate_up_scale"], mw["down"], mw["down_scale"], dtype))
    return outs


# x86-64-v3: AVX2 without VNNI (vpmaddubsw / vpmaddwd); x86-64: the portable C loops
@pytest.mark.parametrize(("arch", "isa"), [("x86-64-v3", "avx2"), ("x86-64", "portable C")])
def test_fallback_builds_give_identical_results(rebuild, arch, isa):
    if not _cpu_runs(arch):
        pytest.fail(f"this CPU cannot run -march={arch} code")
    rebuild(None)
    native = _outputs()
    print(f"native build: {int8_kernels.isa()}")
    rebuild(arch)
    assert int8_kernels.isa() == isa
    for got, want in zip(_outputs(), native, strict=True):
        assert torch.equal(got, want)


def test_w8a8_model_logits_against_fp32_and_the_portable_path(tmp_path, monkeypatch):
    """A W8A8 model's logits vs the fp32 model within the stated tolerance; with the kernels off (the torch
    path) the bf16 model gives the same bits."""
    from shared.loader.checkpoint import load_model
    from shared.loader.tiny import write_checkpoint
    from tests.helpers import engine_logits, random_prompts

    path = write_checkpoint(tmp_path / "m", "deepseek_v32", tokenizer=False, num_hidden_layers=3)
    ids = random_prompts(1, [80], 1024, seed=11)[0]
    ref = engine_logits(load_model(path, "float32", "cpu")[0], ids)
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(path, dtype, "cpu", quantization="w8a8")
        assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.int8
        got = engine_logits(model, ids).float()
        cos = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        print(f"W8A8 {dtype} vs fp32 logits: cosine {cos:.5f}, max |diff| / max |logit| {rel:.3f}")
        assert cos >= LOGIT_COSINE and rel <= LOGIT_REL_MAX
        monkeypatch.setattr(int8_kernels, "_tried", True)
        monkeypatch.setattr(int8_kernels, "_library", None)
        portable = engine_logits(model, ids).float()
        monkeypatch.setattr(int8_kernels, "_tried", False)
        if dtype == "bfloat16":
            assert torch.equal(got, portable)
        else:  # fp32: the experts' silu and k-sum may round apart by an ulp, and an ulp before the next W8A8
            # layer's per-token quantization can round a value to the neighbouring int8 step: measured apart
            # by 0 to 0.0054 (0.4% of the largest logit) as the near-ties of that rounding come and go
            cos = F.cosine_similarity(got.flatten(), portable.flatten(), dim=0).item()
            assert cos >= 0.9999 and (got - portable).abs().max() <= 0.02 * portable.abs().max()


@pytest.mark.skipif(accelerator() is None, reason="needs an accelerator")
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64])
def test_accelerator_w8a8_matmul_is_exact_at_every_row_count(m):
    """A decode step's few rows on the accelerator get the host's exact int32 sums: the same bits, so a row's
    result does not depend on its batch (a lent H100 once rounded few-row sums to bf16)."""
    dev = accelerator()
    g = _gen(m)
    x, w = _int8((m, 256), g, low=-128), _int8((48, 256), g)
    x[-1], w[0] = 127, 127  # the largest sums: beyond bf16's 8-bit mantissa
    sx, sw = torch.rand(m, 1, generator=g) + 1e-3, torch.rand(48, generator=g) + 1e-3
    want = int8_matmul(x, sx, w, sw)
    got = int8_matmul(x.to(dev), sx.to(dev), w.to(dev), sw.to(dev)).cpu()
    assert torch.equal(got, want)
