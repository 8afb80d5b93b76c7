"""The CPU kernels (shared.model.cpu_kernels), as shared.model.ops chooses them, against the portable torch path:
attention, norms, RoPE, the indexer's rows, the cache-row writes, the build (the matmuls and the fused MoE:
tests/test_cpu_matmul_kernels.py). The `portable` fixture is in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.device import compute_dtype
from shared.model import attention, cpu_kernels, kernel_build, ops
from shared.model.batch import ForwardBatch, SeqChunk

BLOCK = 16


def _batch(contexts: list[int], queries: int, gen: torch.Generator) -> tuple[ForwardBatch, int]:
    """Requests with the given contexts (after this step), `queries` new tokens each, blocks scattered."""
    need = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(need) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    chunks, used = [], 0
    for c, n in zip(contexts, need):
        chunks.append(SeqChunk([1] * queries, c - queries, order[used : used + n], generated=True))
        used += n
    return ForwardBatch.build(chunks, BLOCK, torch.device("cpu")), num_blocks


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, "bfloat16 + bf16 queries"])
@pytest.mark.parametrize(("heads", "queries"), [(4, 1), (6, 1), (16, 3)])
def test_dense_decode_matches_the_portable_path(portable, pool_dtype, heads, queries):
    """Decode (and few-query verification) steps over scattered blocks: the fused kernel gives the
    portable path's output to fp32 rounding, for heads that are not a whole register block too, and
    causal masking within a multi-query step holds; with bf16-valued queries over bf16 rows (a bf16 model's:
    scores and p.V by vdpbf16ps where the CPU has it, the probabilities rounded to bf16 as DeepSeek's attention
    and the portable bf16 path round them) within that rounding's bound, 2^-9 of the largest value, and closer to
    the fp32 result than the portable path computing in bf16 comes."""
    bf16_queries = pool_dtype == "bfloat16 + bf16 queries"
    pool_dtype = torch.bfloat16 if bf16_queries else pool_dtype
    gen = torch.Generator().manual_seed(heads * 10 + queries)
    fb, num_blocks = _batch([max(c, queries) for c in (1, 37, 130, 16, 64)], queries, gen)
    pool = torch.randn(num_blocks, BLOCK, 576, generator=gen).to(pool_dtype)
    query = torch.randn(fb.query_index.shape[0], queries, heads, 576, generator=gen)
    if bf16_queries:
        query = query.bfloat16().float()
    calls = []
    real = cpu_kernels.paged_mqa

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    portable(True)
    want = ops.dense_attention(query, fb, pool, 0.07, 512)
    portable(False)
    cpu_kernels.paged_mqa = counting
    try:
        got = ops.dense_attention(query, fb, pool, 0.07, 512)
    finally:
        cpu_kernels.paged_mqa = real
    assert calls, "the decode step did not take the fused kernel"
    assert got.shape == want.shape
    error = (got - want).abs().max().item()
    if not (bf16_queries and cpu_kernels.library().dots_bf16()):
        assert error < 1e-5
        return
    assert 0 < error <= 2**-9 * pool[..., :512].float().abs().max().item()
    portable(True)
    in_bf16 = ops.dense_attention(query.bfloat16(), fb, pool, 0.07, 512).float()
    assert error < (in_bf16 - want).abs().max().item() / 2


def test_sparse_picks_with_a_mask_match_the_portable_path(portable):
    """Indexer picks (a slot list per query, invalid picks masked anywhere in the list)."""
    gen = torch.Generator().manual_seed(3)
    fb, num_blocks = _batch([40, 90, 75], 1, gen)
    pool = torch.randn(num_blocks, BLOCK, 576, generator=gen)
    n, k = fb.num_tokens, 24
    picks = torch.stack([torch.randperm(int(c), generator=gen)[:k] for c in fb.context_lens])
    valid = torch.rand(n, k, generator=gen) > 0.3
    valid[:, 0] = True
    query = torch.randn(n, 4, 576, generator=gen)
    portable(True)
    want = ops.sparse_attention(query, fb, pool, picks, valid, 0.1, 512)
    portable(False)
    got = ops.sparse_attention(query, fb, pool, picks, valid, 0.1, 512)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("spread", [1e-3, 60.0])
def test_softmax_at_extreme_score_spreads_matches_the_portable_path(portable, monkeypatch, spread):
    """The kernel's softmax exponentials (eight lanes at a time) against torch's: scores all but equal, and
    scores spread over hundreds, where most probabilities underflow to 0 (exp below -87) and one row takes
    nearly all the weight."""
    gen = torch.Generator().manual_seed(12)
    fb, num_blocks = _batch([45, 130], 1, gen)
    pool = torch.randn(num_blocks, BLOCK, 576, generator=gen)
    query = torch.randn(2, 1, 4, 576, generator=gen) * spread
    portable(True)
    want = ops.dense_attention(query, fb, pool, 0.07, 512)
    portable(False)
    calls = []
    kernel = cpu_kernels.paged_mqa
    monkeypatch.setattr(cpu_kernels, "paged_mqa", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got = ops.dense_attention(query, fb, pool, 0.07, 512)
    assert calls, "the decode step did not take the fused kernel"
    # scores of size ~100 carry fp32 rounding of ~1e-4 (summation order): the tolerance grows with the spread
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, spread) * max(1.0, want.abs().max().item())


def test_prefill_chunks_and_many_heads_keep_the_matmul_path(monkeypatch):
    """Prompt chunks (a gathered row reused by many queries) computed in bf16 and a head count past MAX_HEADS that
    is not a whole multiple of it take the batched matmul path; prompt chunks computed in fp32 (fp32 queries, or
    bf16 ones on a CPU without bf16 arithmetic) take the kernel, whose rows round alike however they are batched
    (torch's fp32 matmuls over the step's padded context do not), as do 64 heads there, 32 a call."""
    calls = []
    real = cpu_kernels.paged_mqa
    monkeypatch.setattr(cpu_kernels, "paged_mqa", lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))
    fp32_cpu = compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    gen = torch.Generator().manual_seed(4)
    fb, num_blocks = _batch([40, 60], 9, gen)
    fb.generated = 0  # prompt chunks
    for dtype, takes in ((torch.bfloat16, fp32_cpu), (torch.float32, True)):
        calls.clear()
        pool = torch.randn(num_blocks, BLOCK, 576, generator=gen).to(compute_dtype(dtype, torch.device("cpu")))
        query = torch.randn(2, fb.query_index.shape[1], 4, 576, generator=gen).to(dtype)
        got = ops.dense_attention(query, fb, pool, 0.1, 512)
        assert bool(calls) is takes, dtype
        if takes:  # the portable path's result, to fp32 rounding
            want = attention.dense_attention(query, fb, pool, 0.1, 512)
            assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    fb, num_blocks = _batch([40, 60], 1, gen)
    pool = torch.randn(num_blocks, BLOCK, 576, generator=gen)
    calls.clear()
    ops.dense_attention(torch.randn(2, 1, cpu_kernels.MAX_HEADS + 1, 576), fb, pool, 0.1, 512)
    assert not calls
    ops.dense_attention(torch.randn(2, 1, 2 * cpu_kernels.MAX_HEADS, 576), fb, pool, 0.1, 512)
    assert calls == [cpu_kernels.MAX_HEADS] * 2


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, "bfloat16 + mixed queries"])
def test_generated_queries_attend_alike_however_they_are_batched(monkeypatch, pool_dtype):
    """A step of many generated queries per request (a request recomputing its outputs after a migration or a
    preemption) takes the kernel, and each query's output is bit for bit the one it gets alone (its decode):
    the kernel computes every query on its own, also where some queries are bf16-valued (their scores by
    vdpbf16ps over bf16 rows, where the CPU has it) and others are not."""
    mixed = pool_dtype == "bfloat16 + mixed queries"
    pool_dtype = torch.bfloat16 if mixed else pool_dtype
    gen = torch.Generator().manual_seed(6)
    fb, num_blocks = _batch([40, 60], 12, gen)
    pool = torch.randn(num_blocks, BLOCK, 576, generator=gen).to(pool_dtype)
    query = torch.randn(2, 12, 4, 576, generator=gen).to(pool_dtype)
    if mixed:  # fp32 queries, every other one off the bf16 grid in one value
        query = query.float()
        query[:, ::2, 1, 7] += 2.0**-12
    calls = []
    kernel = cpu_kernels.paged_mqa
    monkeypatch.setattr(cpu_kernels, "paged_mqa", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    together = ops.dense_attention(query, fb, pool, 0.1, 512)
    assert calls
    flat = query.reshape(24, 4, 576).float()
    requests, counts = fb.query_rows
    for i in range(24):
        alone = kernel(flat[i : i + 1], pool, fb.block_tables, BLOCK, requests[i : i + 1], counts[i : i + 1], 0.1, 512)
        assert torch.equal(together.reshape(24, 4, 512)[i], alone[0].to(query.dtype))


def test_positions_and_slots_are_checked():
    """A context past the table, a missing table row or a slot outside the pool is refused (the
    kernel checks each index before it reads)."""
    pool = torch.randn(4, BLOCK, 576)
    tables = torch.tensor([[1, 2]])
    q = torch.randn(1, 4, 576)
    ok = cpu_kernels.paged_mqa(q, pool, tables, BLOCK, torch.tensor([0]), torch.tensor([20]), 0.1, 512)
    assert ok.shape == (1, 4, 512) and torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="context runs past"):
        cpu_kernels.paged_mqa(q, pool, tables, BLOCK, torch.tensor([0]), torch.tensor([33]), 0.1, 512)
    with pytest.raises(ValueError, match="missing table row"):
        cpu_kernels.paged_mqa(q, pool, tables, BLOCK, torch.tensor([1]), torch.tensor([3]), 0.1, 512)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.paged_mqa(q, pool, torch.tensor([[1, 4]]), BLOCK, torch.tensor([0]), torch.tensor([20]), 0.1, 512)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.paged_mqa(q, pool, torch.tensor([[-1, 2]]), BLOCK, torch.tensor([0]), torch.tensor([3]), 0.1, 512)


def test_disabled_kernel_falls_back(monkeypatch):
    """PDSERVE_CPU_KERNELS=0 (or no compiler) leaves the portable path: library() is None."""
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    assert cpu_kernels.library() is None
    assert not cpu_kernels.attention_usable(torch.zeros(1, 4, 576), torch.zeros(2, BLOCK, 576), 512)


def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    """A fresh cache dir gets one shared object; a second build reuses it (no compiler run)."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    lib = cpu_kernels._build()
    assert lib is not None
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(kernel_build.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt"))
    assert cpu_kernels._build() is not None


def test_an_unwritable_cache_falls_back_with_a_warning(monkeypatch, tmp_path):
    """A service user without a home (the image runs as nobody) must still start: no kernel, a warning."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.warns(RuntimeWarning, match="PDSERVE_KERNEL_CACHE"):
        assert cpu_kernels._build() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_matches_torch(portable, dtype):
    """RMSNorm in one call: the portable ops' result (bf16: bit for bit on nearly every element, a
    rounding step at most; fp32: to rounding), for one row and for many."""
    from shared.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(9)
    for rows, dim in ((1, 256), (40, 7168)):
        norm = RMSNorm(dim, 1e-6, dtype)
        norm.weight.data.copy_(torch.randn(dim, generator=gen))
        x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
        portable(True)
        want = norm(x)
        portable(False)
        got = norm(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        diff = (got.float() - want.float()).abs()
        if dtype == torch.bfloat16:
            assert (diff == 0).float().mean() > 0.999
            assert (diff <= want.float().abs() * 2 ** -7).all()
        else:
            assert diff.max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["interleaved", "neox"])
@pytest.mark.parametrize("width", [64, 20])
def test_fused_rope_is_bitwise_torch(portable, dtype, layout, width):
    """RoPE in one call gives torch's bits (bf16: each product and the sum rounded), for a strided
    [N, H, d] slice (MLA's q_pe, the indexer's rope part), a flat [N, d] and into an fp32 buffer; at
    DeepSeek's width (64: whole 8-value steps) and at one whose halves end in a partial step (20)."""
    from shared.model.rope import RopeAngles, rope_interleaved, rope_neox

    rotate = rope_interleaved if layout == "interleaved" else rope_neox
    gen = torch.Generator().manual_seed(11)
    angles = torch.rand(7, width // 2, generator=gen) * 6
    rope = RopeAngles.of(angles.cos().to(dtype), angles.sin().to(dtype))
    q = torch.randn(7, 4, width + 32, generator=gen).to(dtype)[..., 32:]  # strided, last dim contiguous
    k = torch.randn(7, width, generator=gen).to(dtype)
    portable(True)
    want_q, want_k = rotate(q, rope), rotate(k, rope)
    portable(False)
    assert torch.equal(rotate(q, rope), want_q) and torch.equal(rotate(k, rope), want_k)
    buf = torch.zeros(7, 4, 2 * width)
    rotate(q, rope, out=buf[..., width:])
    assert torch.equal(buf[..., width:], want_q.float()) and not buf[..., :width].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_indexer_rows_match_rope_hadamard_fp8(portable, dtype):
    """The indexer's query / key rows in one call (ops.index_rows): the NeoX rope alone is torch's bits; with
    DeepSeek's rotation and FP8 round trip, every block is FP8 values times one power-of-two scale, a row
    whose rotation is exact either way (one nonzero value) is the portable path's bit for bit at every
    magnitude, and random rows (their rotated values spread over six decades: FP8 subnormals included) are
    the portable path's but where the rotation's other summation order moves a value across an FP8
    rounding boundary (one FP8 step). Strided [N, H, D] views, as the model's."""
    from shared.model.rope import RopeAngles
    from shared.quant.fp8 import _hadamard

    def rows(x: torch.Tensor, rope: RopeAngles, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(portable, kernel)"""
        portable(True)
        want = ops.index_rows(x, rope.neox_cos, rope.neox_sin, block)
        portable(False)
        return want, ops.index_rows(x, rope.neox_cos, rope.neox_sin, block)

    def strided(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.zeros(*x.shape[:-1], 16)], -1).to(dtype)[..., :128]

    gen = torch.Generator().manual_seed(21)
    angles = torch.rand(40, 32, generator=gen) * 6
    turned = RopeAngles.of(angles.cos().to(dtype), angles.sin().to(dtype))
    still = RopeAngles.of(torch.ones(40, 32, dtype=dtype), torch.zeros(40, 32, dtype=dtype))
    want, got = rows(strided(torch.randn(40, 4, 128, generator=gen)), turned, None)
    assert torch.equal(got, want)
    spread = torch.randn(40, 4, 128, generator=gen) * 10 ** (torch.rand(40, 4, 128, generator=gen) * 6 - 4)
    want, got = rows(strided(spread @ _hadamard(128, torch.device("cpu"))), still, 128)  # rotated back: ≈ spread
    assert got.dtype == dtype and got.shape == (40, 4, 128) and got.is_contiguous()
    scale = torch.exp2(torch.ceil(torch.log2(got.float().abs().amax(-1, keepdim=True) / 448)))
    on_grid = got.float() / scale
    assert torch.equal(on_grid.to(torch.float8_e4m3fn).float(), on_grid)
    assert ((on_grid != 0) & (on_grid.abs() < 2**-6)).any()  # FP8 subnormals among them
    same = got == want
    assert same.float().mean() >= 0.999
    assert ((got.float() - want.float()).abs() <= scale * 32).all()  # at most one FP8 step (32·s near 448·s)
    one_hot = torch.zeros(13, 1, 128)
    one_hot[:, 0, 64] = 10.0 ** torch.arange(-8, 5, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(7)[:13]
    want, got = rows(one_hot.to(dtype), RopeAngles.of(still.neox_cos[:13, :32], still.neox_sin[:13, :32]), 128)
    assert torch.equal(got, want)
    # shapes below the kernel's 8-value steps are refused (None) and take the portable path
    x = strided(torch.randn(5, 2, 128, generator=gen))
    assert cpu_kernels.index_rows(x, turned.neox_cos[:5], turned.neox_sin[:5], 64, 4) is None  # 4-value blocks
    small, ones = torch.randn(5, 2, 4, generator=gen).to(dtype), torch.ones(5, 2, dtype=dtype)
    assert cpu_kernels.index_rows(small, ones, ones - 1, 2, 4) is None  # 4-value rows
    want, got = rows(small, RopeAngles.of(ones[:, :1], ones[:, :1] - 1), 4)
    assert torch.equal(got, want)


def _mla_row_inputs(gen: torch.Generator, c: int, r: int, dtype: torch.dtype):
    """kv_a outputs [6, c + r], the kv norm (random weight), RoPE angles and the step's slots (a fake step)."""
    from shared.model.layers import RMSNorm
    from shared.model.rope import RopeAngles

    n = 6
    kv = torch.randn(n, c + r, generator=gen).to(dtype)
    norm = RMSNorm(c, 1e-6, dtype)
    norm.weight.data.copy_(torch.rand(c, generator=gen) + 0.5)
    angles = torch.rand(n, r // 2, generator=gen) * 6
    rope = RopeAngles.of(angles.cos().to(dtype), angles.sin().to(dtype))
    slots = torch.tensor([3, 17, 0, 40, 41, 9])
    return kv, norm, rope, slots, type("Step", (), {"slot_mapping": slots, "cp": None})()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_fused_mla_cache_row_write(portable, dtype, pool_dtype):
    """[RMSNorm(c_kv) | RoPE(k_pe)] written straight at each token's slot: the same bits as the norm
    and rope kernels followed by the cat + scatter, and the portable torch ops' result to a rounding step;
    a slot outside the pool is refused."""
    from shared.model.batch import write_rows
    from shared.model.rope import rope_interleaved

    c, r = 512, 64
    kv, norm, rope, slots, fb = _mla_row_inputs(torch.Generator().manual_seed(13), c, r, dtype)

    def unfused() -> torch.Tensor:
        pool = torch.zeros(4, 16, c + r, dtype=pool_dtype)
        row = torch.cat([norm(kv[:, :c]), rope_interleaved(kv[:, c:], rope)], -1)
        write_rows(pool, fb, row)
        return pool

    portable(True)
    torch_ops = unfused()
    portable(False)
    kernels = unfused()
    fused = torch.zeros(4, 16, c + r, dtype=pool_dtype)
    assert cpu_kernels.mla_kv_write(kv, norm.weight, 1e-6, rope.inter_cos, rope.inter_sin, True, fused, slots)
    assert torch.equal(fused, kernels)
    step = 2 ** -7 if torch.bfloat16 in (dtype, pool_dtype) else 1e-5
    assert ((fused.float() - torch_ops.float()).abs() <= step * torch_ops.float().abs() + 1e-6).all()
    with pytest.raises(ValueError, match="outside the KV pool"):
        cpu_kernels.mla_kv_write(kv, norm.weight, 1e-6, rope.inter_cos, rope.inter_sin, True, fused,
                                 torch.tensor([3, 17, 0, 64, 41, 9]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_mla_cache_row_write_as_c8(portable, dtype):
    """The same rows stored as C8 (Int8LatentRows: int8 latent, fp32 scale per 128, bf16 rope key), encoded in
    the call: the same bytes as the norm and rope kernels followed by codec.encode and the scatter, for a latent
    that is not a whole number of groups too, an all-zero row (the scale's floor) and values that round half
    way; a slot outside the pool is refused."""
    from shared.kvcache.layout import Int8LatentRows
    from shared.model.batch import write_rows
    from shared.model.rope import rope_interleaved

    gen = torch.Generator().manual_seed(14)
    r = 64
    for c in (512, 200):
        codec = Int8LatentRows(c, r)
        kv, norm, rope, slots, fb = _mla_row_inputs(gen, c, r, dtype)
        kv[2, :c] = 0.0
        kv[4, :c] = torch.arange(c) % 7 - 3.0  # few distinct values: x / s lands half way between integers
        portable(False)
        unfused = torch.zeros(4, 16, codec.width, dtype=torch.uint8)
        row = torch.cat([norm(kv[:, :c]), rope_interleaved(kv[:, c:], rope)], -1)
        write_rows(unfused, fb, codec.encode(row))
        fused = torch.zeros_like(unfused)
        assert cpu_kernels.mla_kv_write(kv, norm.weight, 1e-6, rope.inter_cos, rope.inter_sin, True, fused, slots,
                                        codec)
        assert torch.equal(fused, unfused)
        with pytest.raises(ValueError, match="outside the KV pool"):
            cpu_kernels.mla_kv_write(kv, norm.weight, 1e-6, rope.inter_cos, rope.inter_sin, True, fused,
                                     torch.tensor([3, 17, 0, 64, 41, 9]), codec)


def _cpu_runs(arch: str) -> bool:
    """This machine can run code built with -march=arch (x86 only: the ISA levels below)."""
    import platform

    if arch == "native":
        return True
    if platform.machine() != "x86_64":
        return False
    flags = next(line for line in open("/proc/cpuinfo").read().splitlines() if line.startswith("flags")).split()
    return {"haswell": {"avx2", "fma", "bmi2"}, "x86-64-v2": {"sse4_2", "popcnt"}}[arch] <= set(flags)


# native: this CPU (AVX-512 on a Zen 4 CI machine); haswell: AVX2 + FMA, the fleet's common x86 kind (where
# the GCC-contracted build once rounded a row differently in a four-row pass); x86-64-v2: SSE only, no FMA
# unit (fmaf in software): the spelled-out FMAs make a row's bits the same on each.
@pytest.mark.parametrize("arch", ["native", "haswell", "x86-64-v2"])
def test_decode_rows_are_batch_invariant(tmp_path, arch, monkeypatch, arch_builds):
    """A generated token's logits are the same bits whether it is decoded alone or beside 69 other
    requests (linears past a GEMM library's small sizes, MoE past one kernel chunk): every kernel on
    generated rows computes each row on its own, with the same operations whatever rows sit beside it,
    for every ISA the kernels build for. (Prompt rows keep the portable path, whose grouped expert
    matmuls may round differently with the step's composition, as before.)"""
    if not _cpu_runs(arch):
        pytest.skip(f"this CPU cannot run -march={arch} code")
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(arch_builds))
    monkeypatch.setenv("PDSERVE_KERNEL_ARCH", arch)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    assert cpu_kernels.library() is not None
    from shared.kvcache import KVCache, KVLayout
    from shared.loader.checkpoint import load_model
    from shared.loader.tiny import write_checkpoint

    path = write_checkpoint(tmp_path / "m", "deepseek_v3", tokenizer=False, num_hidden_layers=3)
    model, _ = load_model(path, "bfloat16", "cpu")
    bs = 4
    kv = KVCache(KVLayout.from_model_config(model.config, bs, torch.float32), 1024, torch.device("cpu"))
    prompts = [[(7 * i + j) % 1000 + 2 for j in range(9 + i % 5)] for i in range(70)]
    tables = [kv.allocator.allocate(kv.blocks_needed(len(p) + 1)) for p in prompts]

    def prefill(ids: list[int]) -> None:
        model(ForwardBatch.build([SeqChunk(prompts[i], 0, tables[i]) for i in ids], bs, torch.device("cpu")), kv)

    def decode(ids: list[int]) -> torch.Tensor:
        chunks = [SeqChunk([5], len(prompts[i]), tables[i], generated=True) for i in ids]
        return model(ForwardBatch.build(chunks, bs, torch.device("cpu")), kv)

    prefill(list(range(70)))
    alone = decode([0])[0]
    batched = decode(list(range(70)))[0]  # rewrites request 0's new row with the same bits
    assert torch.equal(alone, batched)
    assert torch.equal(decode([0, 69])[0], alone)


def test_bf16_rows_through_onednn_are_batch_invariant_alone_too():
    """bf16 linears (and large bf16 experts) run in oneDNN, whose one-row product (a GEMV) rounds otherwise than
    its GEMM at some shapes (on this Zen 4: 6 of 8 rows at K 4096, N 1024; at DeepSeek's q_a_proj, q_b_proj,
    o_proj and experts): a single row is computed as two, and an expert picked by one row gets it twice, so a
    row's bits are the same alone, beside others, and in an expert group of any size."""
    from shared.model import ops
    from shared.model.moe import Experts
    from shared.model.tensor_parallel import AllToShardedLinear

    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(1024, 4096, generator=gen) * 0.02).bfloat16()
    x = torch.randn(8, 4096, generator=gen).bfloat16()
    batched = ops.linear(x, w)
    assert all(torch.equal(ops.linear(x[i : i + 1], w), batched[i : i + 1]) for i in range(8))
    assert torch.equal(ops.linear(x[3], w), batched[3])  # one row without a batch dimension
    tp_shard = AllToShardedLinear(w, 1, 0, None)  # a TP rank's column slice (here all of it)
    assert all(torch.equal(tp_shard(x[i : i + 1]), batched[i : i + 1]) for i in range(8))
    ex = Experts(2, 4096, 512, torch.bfloat16)
    for p in ex.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    with torch.inference_mode():
        many = ex.run(x, torch.zeros(8, dtype=torch.long))  # one group of 8
        for i in range(8):
            assert torch.equal(ex.run(x[i : i + 1], torch.zeros(1, dtype=torch.long)), many[i : i + 1])
        ids = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1])  # row 0 alone in expert 0, beside others in expert 1
        mixed = ex.run(x, ids)
        assert torch.equal(mixed[:1], many[:1]) and torch.equal(mixed[1:], ex.run(x[1:], ids[1:]))
        assert mixed.shape == x.shape


@pytest.fixture(scope="module")
def engine_kernel_cache(tmp_path_factory) -> Path:
    """One kernel cache for both engines below, empty before the first (an attention build costs ~8 s here)."""
    return tmp_path_factory.mktemp("engine-kernels")


@pytest.mark.parametrize("quantization", ["none", "w8a8"])
def test_an_engine_builds_the_kernels_before_its_first_request(monkeypatch, engine_kernel_cache, ckpt, quantization):
    """No cold start: constructing an engine (what a service does before it reports SERVING) builds the
    kernels it will call into a cache that lacks them, the int8 ones for W8A8 weights, so no request waits for
    the compiler."""
    from shared.engine import LLM
    from shared.model import int8_kernels

    cache = engine_kernel_cache
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(cache))
    for module in (cpu_kernels, int8_kernels):
        monkeypatch.setattr(module, "_tried", False)
        monkeypatch.setattr(module, "_library", None)
    had_int8 = bool(list(cache.glob("int8_kernels-*.so")))
    llm = LLM(str(ckpt("v32_sparse")), block_size=4, quantization=quantization)
    assert list(cache.glob("cpu_kernels-*.so")), "the engine started without building its kernels"
    assert bool(list(cache.glob("int8_kernels-*.so"))) == (had_int8 or quantization == "w8a8")
    assert llm.engine.kernel_build_seconds > 0  # it built (W8A8 after the plain engine: the int8 kernels)
