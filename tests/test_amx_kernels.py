"""AMX tile products (shared.model.cpu_kernels.tile_products): a bf16 model's decode linears and attention on a CPU
with AMX-BF16. On other CPUs the paths are not built and these tests check only that nothing claims them."""

from __future__ import annotations

import pytest
import torch

from shared.device import compute_dtype
from shared.model import cpu_kernels, ops
from tests.test_cpu_kernels import BLOCK, _batch

TILES = cpu_kernels.library() is not None and cpu_kernels.tile_products()
needs_tiles = pytest.mark.skipif(not TILES, reason="this CPU (or its kernel) grants no AMX tiles")


def test_tiles_are_claimed_only_where_the_cpu_has_them():
    flags = open("/proc/cpuinfo").read() if not TILES else "amx_bf16"
    assert TILES <= ("amx_bf16" in flags)


@needs_tiles
def test_tile_linear_rows_are_batch_invariant_over_many_blocks():
    """Outputs in 32 x 32 tasks of four tile sums: a row's bits are the same alone, in a partial 16-row block and
    across several tasks; weight rows past a whole block come from a zero-padded copy; the fp32 dot to its bf16
    rounding. A K not a multiple of 32 keeps the vdpbf16ps rows (by K alone: never by the batch)."""
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(100, 96, generator=gen).bfloat16()
    x = torch.randn(70, 96, generator=gen).bfloat16()
    batched = cpu_kernels.linear(x, w)
    for n in (1, 15, 16, 17, 33, 64):
        assert torch.equal(cpu_kernels.linear(x[:n], w), batched[:n]), n
    assert torch.equal(cpu_kernels.linear(x[69:], w), batched[69:])
    want = (x.double() @ w.double().T).bfloat16()
    assert ((batched.double() - want.double()).abs() <= 2**-7 * want.double().abs()).all()
    odd = torch.randn(5, 48, generator=gen).bfloat16(), torch.randn(8, 48, generator=gen).bfloat16()
    assert torch.equal(cpu_kernels.linear(odd[0][:1], odd[1]), cpu_kernels.linear(*odd)[:1])


def test_a_bf16_models_many_heads_take_one_kernel_call_where_tiles_are():
    """64 heads of a bf16 model's generated rows over bf16 rows: one call where AMX tiles take 16 heads a product
    (oneDNN's bf16 batched matmuls, the path otherwise, round a row by its batch there: a token decoded alone
    and beside three others differed by 0.031 in the logits at DeepSeek's dims), MAX_HEADS a call where the CPU
    computes bf16 in fp32, and the batched matmuls where AVX512-BF16 rounds each row alike; the output is the
    portable path's to bf16 rounding."""
    calls = []
    real = cpu_kernels.paged_mqa
    gen = torch.Generator().manual_seed(22)
    fb, num_blocks = _batch([40, 60], 1, gen)
    pool = torch.randn(num_blocks, BLOCK, 576, generator=gen).bfloat16()
    query = torch.randn(2, 1, 2 * cpu_kernels.MAX_HEADS, 576, generator=gen).bfloat16()
    want = ops.attention.dense_attention(query, fb, pool, 0.1, 512)
    cpu_kernels.paged_mqa = lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k)
    try:
        got = ops.dense_attention(query, fb, pool, 0.1, 512)
    finally:
        cpu_kernels.paged_mqa = real
    fp32_cpu = compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert calls == ([2 * cpu_kernels.MAX_HEADS] if TILES else [cpu_kernels.MAX_HEADS] * 2 if fp32_cpu else [])
    assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max()


@needs_tiles
def test_tile_attention_reads_scattered_rows_as_it_reads_a_blocks():
    """Rows read in place where a 16-row set is evenly spaced (within a block) and through a copy where it is not
    (8-row blocks scattered over the pool): the same output either way, bit for bit."""
    gen = torch.Generator().manual_seed(23)
    pool = torch.randn(12, 8, 576, generator=gen).bfloat16()
    query = torch.randn(1, 20, 576, generator=gen).bfloat16().float()
    order = torch.tensor([[5, 2, 7, 0, 11, 3, 9, 1]])
    scattered = cpu_kernels.paged_mqa(query, pool, order, 8, torch.tensor([0]), torch.tensor([61]), 0.1, 512)
    in_order = pool[order[0]].reshape(1, 64, 576).contiguous()
    together = cpu_kernels.paged_mqa(query, in_order, torch.tensor([[0]]), 64, torch.tensor([0]), torch.tensor([61]),
                                     0.1, 512)
    assert torch.equal(scattered, together)
