"""C8 rows read in place by the CPU kernels (shared.model.cpu_kernels: paged_mqa over int8 MLA rows, index_scores
over FP8 indexer keys, and over plain bf16 / fp32 ones), as shared.model.ops chooses them, against the portable
dequantize-then-attend path."""

from __future__ import annotations

import pytest
import torch

from shared.device import compute_dtype
from shared.engine import LLM, SamplingParams
from shared.kvcache.layout import Fp8KeyRows, Int8LatentRows
from shared.loader.tiny import write_checkpoint
from shared.model import attention, cpu_kernels, ops
from shared.model.batch import ForwardBatch, SeqChunk, gather_rows

BLOCK = 16


@pytest.fixture
def kernels(portable):
    """kernels(False) forces the portable path (the library off), kernels(True) the built kernels (conftest's
    `portable`, the other way round)."""
    return lambda on: portable(not on)


@pytest.fixture
def build_for(monkeypatch, arch_builds):
    """build_for(arch) loads the kernels built for another -march (PDSERVE_KERNEL_ARCH; None: this CPU), from
    the session's cache of such builds; the module's state is restored afterwards."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(arch_builds))

    def build(arch: str | None) -> None:
        if arch:
            monkeypatch.setenv("PDSERVE_KERNEL_ARCH", arch)
        monkeypatch.setattr(cpu_kernels, "_tried", False)
        monkeypatch.setattr(cpu_kernels, "_library", None)

    return build


def _batch(contexts: list[int], queries: int, gen: torch.Generator, generated: bool = True) -> tuple[ForwardBatch, int]:
    """Requests with the given contexts (after this step), `queries` new tokens each, blocks scattered."""
    need = [-(-c // BLOCK) for c in contexts]
    num_blocks = sum(need) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    chunks, used = [], 0
    for c, n in zip(contexts, need):
        chunks.append(SeqChunk([1] * queries, c - queries, order[used : used + n], generated=generated))
        used += n
    return ForwardBatch.build(chunks, BLOCK, torch.device("cpu")), num_blocks


def _c8_pool(codec: Int8LatentRows | Fp8KeyRows, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """A pool of encoded rows (latents with a spread of magnitudes per group, so scales differ)."""
    rows = torch.randn(num_blocks * BLOCK, codec.dim, generator=gen)
    rows *= torch.rand(num_blocks * BLOCK, 1, generator=gen) * 4 + 0.1
    return codec.encode(rows).view(num_blocks, BLOCK, -1)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to fp32 rounding: sums in another order, relative to the outputs' magnitude."""
    return (got.float() - want.float()).abs().max().item() <= 1e-5 * want.abs().max().item() + 1e-6


def _counting(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(cpu_kernels, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, name, counted)
    return calls


# (latent, rope): DeepSeek's 512 + 64 (query 576, output 512), and a latent whose last scale group is partial
LAYOUTS = [(512, 64), (208, 16)]


@pytest.mark.parametrize(("latent", "rope"), LAYOUTS)
@pytest.mark.parametrize(("heads", "queries"), [(1, 1), (4, 1), (6, 3), (cpu_kernels.MAX_HEADS, 2)])
def test_dense_c8_kernel_matches_dequantize_then_attend(kernels, monkeypatch, latent, rope, heads, queries):
    """Decode and verification steps (few queries per request) over scattered blocks,
    odd contexts, heads up to MAX_HEADS: the kernel reading int8 rows gives the portable path's output
    (rows decoded to fp32, then attended) to fp32 rounding, causal masking within a step included."""
    gen = torch.Generator().manual_seed(heads * 10 + queries + latent)
    codec = Int8LatentRows(latent, rope)
    fb, num_blocks = _batch([max(c, queries) for c in (1, 37, 130, 16, 64, 301)], queries, gen)
    pool = _c8_pool(codec, num_blocks, gen)
    query = torch.randn(fb.query_index.shape[0], queries, heads, codec.dim, generator=gen)
    kernels(False)
    want = ops.dense_attention(query, fb, pool, 0.07, latent, codec)
    kernels(True)
    calls = _counting(monkeypatch, "paged_mqa")
    got = ops.dense_attention(query, fb, pool, 0.07, latent, codec)
    assert calls, "the decode step did not take the C8 kernel"
    assert got.shape == want.shape == (fb.query_index.shape[0], queries, heads, latent)
    assert _close(got, want)
    # bf16 queries (the model's compute dtype on bf16 CPUs) take it too, and come back in bf16
    got16 = ops.dense_attention(query.bfloat16(), fb, pool, 0.07, latent, codec)
    assert got16.dtype == torch.bfloat16 and len(calls) == 2
    # bf16-valued queries: the tile's int8 latents widened to bf16 once, scored by vdpbf16ps
    q16 = query.bfloat16().float()
    kernels(False)
    want16 = ops.dense_attention(q16, fb, pool, 0.07, latent, codec)
    kernels(True)
    assert _close(ops.dense_attention(q16, fb, pool, 0.07, latent, codec), want16) and len(calls) == 3


@pytest.mark.parametrize(("latent", "rope"), LAYOUTS)
@pytest.mark.parametrize("heads", [4, cpu_kernels.MAX_HEADS])
def test_sparse_c8_kernel_matches_dequantize_then_attend(kernels, monkeypatch, latent, rope, heads):
    """Indexer picks (a slot list per query, invalid picks masked anywhere in the list) over C8 rows."""
    gen = torch.Generator().manual_seed(3 + heads)
    codec = Int8LatentRows(latent, rope)
    fb, num_blocks = _batch([40, 90, 75, 133], 1, gen)
    pool = _c8_pool(codec, num_blocks, gen)
    n, k = fb.num_tokens, 24
    picks = torch.stack([torch.randperm(int(c), generator=gen)[:k] for c in fb.context_lens])
    valid = torch.rand(n, k, generator=gen) > 0.3
    valid[:, 0] = True
    query = torch.randn(n, heads, codec.dim, generator=gen)
    kernels(False)
    want = ops.sparse_attention(query, fb, pool, picks, valid, 0.1, latent, codec)
    kernels(True)
    calls = _counting(monkeypatch, "paged_mqa")
    got = ops.sparse_attention(query, fb, pool, picks, valid, 0.1, latent, codec)
    assert calls
    assert _close(got, want)
    q16 = query.bfloat16().float()  # bf16-valued (see the dense case)
    kernels(False)
    want16 = ops.sparse_attention(q16, fb, pool, picks, valid, 0.1, latent, codec)
    kernels(True)
    assert _close(ops.sparse_attention(q16, fb, pool, picks, valid, 0.1, latent, codec), want16) and len(calls) == 2


def test_c8_rows_and_layout_are_checked():
    """Hostile table entries (a context past the table, a missing table row, a slot outside the pool) and a
    layout that does not fit the rows are refused before anything is read."""
    codec = Int8LatentRows(512, 64)
    gen = torch.Generator().manual_seed(5)
    pool = _c8_pool(codec, 4, gen)
    tables = torch.tensor([[1, 2]])
    q = torch.randn(1, 4, 576)

    def run(tables: torch.Tensor, row: int, count: int, c=codec) -> torch.Tensor:
        return cpu_kernels.paged_mqa(q, pool, tables, BLOCK, torch.tensor([row]), torch.tensor([count]), 0.1, 512,
                                     codec=c)

    ok = run(tables, 0, 20)
    assert ok.shape == (1, 4, 512) and torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="context runs past"):
        run(tables, 0, 33)
    with pytest.raises(ValueError, match="missing table row"):
        run(tables, 1, 3)
    with pytest.raises(ValueError, match="outside the pool"):
        run(torch.tensor([[1, 4]]), 0, 20)
    with pytest.raises(ValueError, match="outside the pool"):
        run(torch.tensor([[-1, 2]]), 0, 3)
    lying = Int8LatentRows(512, 64)
    lying.groups = 2  # a width that matches the pool, groups that do not match the latent: the kernel refuses
    with pytest.raises(ValueError, match="C8 layout"):
        run(tables, 0, 20, lying)
    with pytest.raises(ValueError):  # rows of another width
        run(tables, 0, 20, Int8LatentRows(256, 64))
    assert not cpu_kernels.attention_usable(q, pool, 512, Int8LatentRows(256, 64))
    assert not cpu_kernels.attention_usable(q, pool, 512, Fp8KeyRows(576))


def _index_case(heads: int, queries: int, generated: bool, gen: torch.Generator, keys: str = "fp8"):
    """Indexer queries, head weights and a key pool stored as `keys` says (C8's FP8 rows, or plain bf16 / fp32
    rows: codec None, as the model passes them)."""
    fb, num_blocks = _batch([max(c, queries) for c in (5, 77, 160, 33, 250)], queries, gen, generated)
    if keys == "fp8":
        codec = Fp8KeyRows(128)
        pool = _c8_pool(codec, num_blocks, gen)
    else:
        codec = None
        pool = torch.randn(num_blocks, BLOCK, 128, generator=gen).to(getattr(torch, keys))
    q = torch.randn(fb.num_tokens, heads, 128, generator=gen)
    w = torch.randn(fb.num_tokens, heads, generator=gen)
    return codec, fb, pool, q, w


@pytest.mark.parametrize("keys", ["fp8", "bfloat16", "float32"])
@pytest.mark.parametrize(("heads", "queries", "generated"), [(16, 1, True), (2, 3, True), (5, 40, False)])
def test_indexer_scores_match_the_portable_path(kernels, monkeypatch, heads, queries, generated, keys):
    """The indexer's scores over keys read in place (C8's FP8 rows, plain bf16 or fp32 rows) equal the portable
    (decode keys, q·k, ReLU, head weights) scores to fp32 rounding, and the top-k picks are the same positions
    in the same order, ties (two heads: many scores are exactly 0 after the ReLU) to the earliest position;
    decodes, verification and prompt chunks (runs of queries that share decoded keys)."""
    gen = torch.Generator().manual_seed(heads + queries)
    codec, fb, pool, q, w = _index_case(heads, queries, generated, gen, keys)
    assert cpu_kernels.index_usable(q, pool, codec)
    counts = fb.positions + 1
    columns = int(counts.max())
    got = cpu_kernels.index_scores(q, w, pool, codec, fb.block_tables, BLOCK, fb.token_request, counts, columns, 0.09)
    flat = pool.view(-1, pool.shape[-1])
    keys = flat.float() if codec is None else codec.decode(flat, torch.float32)
    slots = fb.slots_of(fb.token_request, torch.arange(columns).expand(fb.num_tokens, -1))
    dots = torch.einsum("nhd,ntd->nht", q, keys[slots])
    want = torch.einsum("nh,nht->nt", w, torch.relu(dots * 0.09))
    want.masked_fill_(torch.arange(columns) >= counts[:, None], float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert _close(got[finite], want[finite])

    k = min(64, fb.max_context)
    kernels(False)
    want_picks, want_valid = ops.indexer_topk(q, w, fb, pool, k, 0.09, torch.float32, codec)
    kernels(True)
    calls = _counting(monkeypatch, "index_scores")
    got_picks, got_valid = ops.indexer_topk(q, w, fb, pool, k, 0.09, torch.float32, codec)
    assert calls
    assert torch.equal(got_valid, want_valid)
    assert torch.equal(got_picks[got_valid], want_picks[want_valid])
    if heads == 2:
        assert (want == 0).sum() > 10  # the ties the ordering is about


def _lane_order_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """The kernel's scores in torch for values whose products are exact in fp32 (so a fused multiply-add is an
    add): each dot one chain over the dims in pairs, dim 2p + 1 then dim 2p; times key scale · scale; ReLU; head
    weights summed over heads in order. q [N, H, D], keys [N, T, D] -> [N, T]."""
    n, heads, dim = q.shape
    prod = q[:, :, None] * keys[:, None]  # [N, H, T, D]
    dots = torch.zeros(prod.shape[:3])
    for p in range(0, dim, 2):
        dots = dots + prod[..., p + 1]
        dots = dots + prod[..., p]
    scores = dots * (key_scale * scale)[:, None]
    total = torch.zeros(n, keys.shape[1])
    for h in range(heads):
        total = total + w[:, h, None] * torch.relu(scores[:, h])
    return total


@pytest.mark.parametrize(("keys", "dim"), [("fp8", 128), ("fp8", 72), ("bfloat16", 128), ("bfloat16", 72)])
def test_indexer_dots_take_lane_order_bit_for_bit_on_every_build(build_for, keys, dim):
    """bf16 queries and keys (DeepSeek's indexer values, on the FP8 grid times a power of two, are such) have
    exact products, so the kernel's lane-order dots (AVX512-BF16's vdpbf16ps where the build has it, fused
    multiply-adds elsewhere) are the torch lane-order scores bit for bit (queries spread over 2^-8 .. 2^8 so
    that the sums round: another order gives other bits), on builds for this CPU, for AVX2 + FMA and SSE2 alike,
    over C8's FP8 keys and bf16 ones, prompt runs, a 72-dim key (a half block of padding) included. A query that is
    not bf16 (one value off the grid) takes the FMA path alone, with the same bits on every build, and leaves
    the others' bits as they were; a key tile with a subnormal value takes it for every query."""
    gen = torch.Generator().manual_seed(31)
    heads = 5
    fb, num_blocks = _batch([40, 95, 3, 150], 3, gen, generated=False)
    if keys == "fp8":
        codec = Fp8KeyRows(dim)
        pool = _c8_pool(codec, num_blocks, gen)
        flat = pool.view(-1, codec.width)
        values = flat[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
        key_scale = flat[:, dim:].contiguous().view(torch.float32)[:, 0]
    else:
        codec = None
        rows = torch.randn(num_blocks * BLOCK, dim, generator=gen) * 2.0**-4
        tiny = int(fb.block_tables[0, 0]) * BLOCK + 5  # a key of the first request's first tile: one subnormal
        rows[tiny] = 0.0  # value, which vdpbf16ps would read as 0; that tile takes the FMA path, which keeps it
        rows[tiny, 3] = 2.0**-130
        pool = rows.to(torch.bfloat16).view(num_blocks, BLOCK, dim)
        values, key_scale = pool.view(-1, dim).float(), torch.ones(num_blocks * BLOCK)
    # bf16 queries with magnitudes spread over 2^-8 .. 2^8: exact products whose sums round (the order shows)
    spread = torch.exp2(torch.randint(-8, 9, (fb.num_tokens, heads, dim), generator=gen).float())
    q = (torch.randn(fb.num_tokens, heads, dim, generator=gen) * spread).bfloat16().float()
    off_grid = fb.num_tokens - 2  # the last request's second query
    q[off_grid, 1, 9] = 1.1
    w = torch.randn(fb.num_tokens, heads, generator=gen)
    counts = fb.positions + 1
    columns = int(counts.max())
    slots = fb.slots_of(fb.token_request, torch.arange(columns).expand(fb.num_tokens, -1)).clamp(min=0)
    want = _lane_order_scores(q, w, values[slots], key_scale[slots], 0.09)
    real = torch.arange(columns) < counts[:, None]
    results = {}
    for arch in (None, "haswell", "x86-64"):
        build_for(arch)
        if arch is None and "avx512_bf16" in open("/proc/cpuinfo").read():
            assert cpu_kernels.bf16_dots()  # this CPU: the vdpbf16ps path is built and runs
        got = cpu_kernels.index_scores(q, w, pool, codec, fb.block_tables, BLOCK, fb.token_request, counts,
                                       columns, 0.09)
        results[arch] = got
        exact = torch.ones(fb.num_tokens, dtype=torch.bool)
        exact[off_grid] = False
        assert torch.equal(got[exact][real[exact]], want[exact][real[exact]]), arch
        assert _close(got[off_grid][real[off_grid]], want[off_grid][real[off_grid]])
        assert torch.isinf(got[~real]).all()
    assert torch.equal(results[None], results["haswell"]) and torch.equal(results[None], results["x86-64"])


@pytest.mark.parametrize("keys", ["fp8", "bfloat16"])
def test_indexer_scores_are_checked(keys):
    gen = torch.Generator().manual_seed(7)
    if keys == "fp8":
        codec = Fp8KeyRows(128)
        pool = _c8_pool(codec, 4, gen)
    else:
        codec, pool = None, torch.randn(4, BLOCK, 128, generator=gen).to(torch.bfloat16)
    q, w = torch.randn(1, 4, 128), torch.randn(1, 4)
    assert not cpu_kernels.index_usable(torch.randn(1, 4, 64), pool, codec)  # keys of another width
    assert not cpu_kernels.index_usable(q, pool.to(torch.float16) if codec is None else pool[..., :-4], codec)

    def run(tables: list[list[int]], row: int, count: int, columns: int = 32) -> torch.Tensor:
        return cpu_kernels.index_scores(q, w, pool, codec, torch.tensor(tables), BLOCK, torch.tensor([row]),
                                        torch.tensor([count]), columns, 0.1)

    assert torch.isfinite(run([[1, 2]], 0, 32)).all()
    for tables, row, count, columns in (([[1, 2]], 0, 33, 40), ([[1, 2]], 0, 20, 19), ([[1, 2]], 1, 3, 32),
                                        ([[1, 4]], 0, 20, 32), ([[-1, 2]], 0, 3, 32)):
        with pytest.raises(ValueError, match="index_scores"):
            run(tables, row, count, columns)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c8_index_keys_are_written_as_the_codec_encodes_them(kernels, dtype):
    """The indexer's new keys stored as C8 rows in one call: the bytes of Fp8KeyRows.encode (FP8 e4m3 values,
    ties to even, subnormals, the power-of-two scale; rows the indexer makes, already FP8-rounded, rows spread
    over decades, rows under the 1e-4 floor, zeros and negative zeros) at exactly the given slots."""
    from shared.quant.fp8 import fake_quant_ue8m0

    codec = Fp8KeyRows(128)
    gen = torch.Generator().manual_seed(3)
    spread = torch.randn(6, 128, generator=gen) * 10 ** (torch.rand(6, 128, generator=gen) * 8 - 5)
    tiny = torch.randn(2, 128, generator=gen) * 1e-6
    zeros = torch.zeros(2, 128)
    zeros[1, ::3] = -0.0
    keys = torch.cat([fake_quant_ue8m0(torch.randn(6, 128, generator=gen) * 3, 128), spread, tiny, zeros]).to(dtype)
    pool = torch.full((4, BLOCK, codec.width), 7, dtype=torch.uint8)
    slots = torch.randperm(4 * BLOCK, generator=gen)[: keys.shape[0]]
    assert cpu_kernels.index_key_write(keys, pool, slots, codec)
    flat = pool.view(-1, codec.width)
    assert torch.equal(flat[slots], codec.encode(keys))
    untouched = torch.ones(4 * BLOCK, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[untouched] == 7).all()
    with pytest.raises(ValueError, match="index_key_write"):
        cpu_kernels.index_key_write(keys[:1], pool, torch.tensor([4 * BLOCK]), codec)
    assert not cpu_kernels.index_key_write(keys, pool, slots, None)  # plain keys: write_rows
    assert not cpu_kernels.index_key_write(keys[:, :64], pool, slots, codec)  # another width


@pytest.mark.parametrize(("latent", "rope"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c8_rows_decode_in_one_pass_as_the_codec(kernels, latent, rope, dtype):
    """The portable sparse attention's C8 rows gathered and decoded in one kernel call: the bits of
    codec.decode(gather_rows(...)) (bf16: the scale rounded to bf16, the product once), including a zero row
    (the 1e-12 scale floor) and a last partial scale group; prompt rows' sparse attention is unchanged by it;
    a slot outside the pool raises."""
    gen = torch.Generator().manual_seed(latent + rope)
    codec = Int8LatentRows(latent, rope)
    pool = _c8_pool(codec, 9, gen)
    pool[0, 0] = codec.encode(torch.zeros(1, codec.dim))[0]
    slots = torch.randint(0, 9 * BLOCK, (5, 37), generator=gen)
    slots[0, 0] = 0
    got = cpu_kernels.c8_rows(pool, slots, codec, dtype)
    assert got is not None and torch.equal(got, codec.decode(gather_rows(pool, slots), dtype))
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_kernels.c8_rows(pool, torch.tensor([9 * BLOCK]), codec, dtype)
    assert cpu_kernels.c8_rows(pool, slots, None, dtype) is None

    fb, num_blocks = _batch([40, 90], 6, gen, generated=False)
    pool = _c8_pool(codec, num_blocks, gen)
    query = torch.randn(fb.num_tokens, 4, codec.dim, generator=gen).to(dtype)
    picks = torch.randint(0, 34, (fb.num_tokens, 16), generator=gen)
    valid = torch.rand(fb.num_tokens, 16, generator=gen) > 0.2
    fused = attention.sparse_attention(query, fb, pool, picks, valid, 0.05, latent, codec)
    kernels(False)
    assert torch.equal(fused, attention.sparse_attention(query, fb, pool, picks, valid, 0.05, latent, codec))


@pytest.mark.parametrize("rows", ["bf16", "c8"])
def test_sparse_attention_tiles_reuse_their_rows_buffer(rows, monkeypatch):
    """Prompt rows' sparse attention in many tiles (a small workspace) reads each tile's rows into the first
    tile's buffer (bf16 pool: index_select into it; C8: the decode kernel writes it), with the bits of one tile
    over the whole batch; c8_rows refuses an `out` of the wrong shape."""
    gen = torch.Generator().manual_seed(11)
    codec = Int8LatentRows(512, 64) if rows == "c8" else None
    fb, num_blocks = _batch([40, 90, 70], 9, gen, generated=False)
    if codec is None:  # a bf16 model's pool, in the dtype its engine keeps it (fp32 on a CPU without bf16 arithmetic)
        pool = torch.randn(num_blocks, BLOCK, 576, generator=gen).to(compute_dtype(torch.bfloat16, torch.device("cpu")))
    else:
        pool = _c8_pool(codec, num_blocks, gen)
    query = torch.randn(fb.num_tokens, 4, 576, generator=gen).bfloat16()
    picks = torch.randint(0, 31, (fb.num_tokens, 16), generator=gen)
    valid = torch.rand(fb.num_tokens, 16, generator=gen) > 0.2
    whole = attention.sparse_attention(query, fb, pool, picks, valid, 0.05, 512, codec)
    buffers: list[int] = []
    real = attention._rows_at

    def rows_at(*args, **kwargs):
        got = real(*args, **kwargs)
        buffers.append(got.untyped_storage().data_ptr())
        return got

    monkeypatch.setattr(attention, "_rows_at", rows_at)
    fb.workspace_bytes = 3 * 16 * 576 * 4  # a few queries per tile
    tiled = attention.sparse_attention(query, fb, pool, picks, valid, 0.05, 512, codec)
    assert len(buffers) >= 5 and len(set(buffers)) == 1  # every tile in the first one's rows
    assert torch.equal(tiled, whole)
    if codec is not None:
        with pytest.raises(ValueError, match="out"):
            cpu_kernels.c8_rows(pool, picks[:2], codec, torch.bfloat16, torch.empty(3, 16, 576).bfloat16())


def test_every_fp8_key_byte_is_read_exactly(build_for):
    """Each of the 254 e4m3 bytes a C8 key can hold (all but NaN: subnormals, ±0, ±448) is read as its exact value
    by the native build (on a CPU with AVX512-BF16 and BW: straight to bf16 bits in 16-bit lanes), the AVX2 build
    (F16C's converter) and the SSE2-only build (integer arithmetic): one-hot queries of either sign (ReLU keeps
    one sign each) against keys holding the byte in every dimension."""
    dim = 128
    codec = Fp8KeyRows(dim)
    values = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    pool = torch.zeros(1, len(values), codec.width, dtype=torch.uint8)
    pool[0, :, :dim] = values[:, None]
    pool[0, :, dim:] = torch.ones(len(values), 1).view(torch.uint8)  # scale 1.0
    want = values.view(torch.float8_e4m3fn).float()
    q = torch.zeros(2, 1, dim)
    q[0, 0, 5], q[1, 0, 77] = 1.0, -1.0
    one_row = torch.zeros(2, dtype=torch.long)
    for arch in (None, "haswell", "x86-64"):
        build_for(arch)
        got = cpu_kernels.index_scores(q, torch.ones(2, 1), pool, codec, torch.zeros(1, 1, dtype=torch.long),
                                       len(values), one_row, torch.full((2,), len(values)), len(values), 1.0)
        assert torch.equal(got[0], want.clamp(min=0)) and torch.equal(got[1], (-want).clamp(min=0)), arch


def test_portable_c_build_and_disabled_kernels(monkeypatch, arch_builds):
    """PDSERVE_KERNEL_ARCH=x86-64 (SSE2 only: no AVX, no FMA unit) builds the same kernels, with the same
    results (both from the session's builds per -march); PDSERVE_CPU_KERNELS=0 takes the torch path."""
    gen = torch.Generator().manual_seed(11)
    codec = Int8LatentRows(512, 64)
    fb, num_blocks = _batch([3, 70, 129], 2, gen)
    pool = _c8_pool(codec, num_blocks, gen)
    query = torch.randn(3, 2, 6, 576, generator=gen)
    icodec, ifb, ipool, iq, iw = _index_case(16, 1, True, gen)

    def results() -> tuple[torch.Tensor, ...]:
        dense = ops.dense_attention(query, fb, pool, 0.05, 512, codec)
        picks, valid = ops.indexer_topk(iq, iw, ifb, ipool, 64, 0.09, torch.float32, icodec)
        return dense, picks, valid

    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(arch_builds))
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    native_build = cpu_kernels.library()._name
    native = results()
    monkeypatch.setenv("PDSERVE_KERNEL_ARCH", "x86-64")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    assert cpu_kernels.library() is not None
    generic_build = cpu_kernels.library()._name  # a second build, for the portable ISA, beside the native one
    assert generic_build != native_build and all(b.startswith(f"{arch_builds}/") for b in (generic_build, native_build))
    generic = results()
    assert _close(generic[0], native[0])
    assert torch.equal(generic[1][generic[2]], native[1][native[2]]) and torch.equal(generic[2], native[2])
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    assert not cpu_kernels.attention_usable(query[0], pool, 512, codec)
    assert not cpu_kernels.index_usable(iq, ipool, icodec)
    monkeypatch.setattr(cpu_kernels, "paged_mqa", lambda *a, **k: pytest.fail("kernel used"))
    monkeypatch.setattr(cpu_kernels, "index_scores", lambda *a, **k: pytest.fail("kernel used"))
    torch_path = results()
    assert _close(torch_path[0], native[0])
    assert torch.equal(torch_path[2], native[2])


def test_c8_engine_tokens_match_the_portable_c8_path(tmp_path, monkeypatch):
    """A C8 engine (fp32 model: the portable path decodes rows to fp32, as the kernels do) gives the same
    greedy tokens with the C8 kernels as with the portable C8 path: prompts past index_topk (indexer scoring
    over FP8 keys, sparse attention over int8 rows) and under it (dense decode)."""
    path = write_checkpoint(tmp_path / "m", "deepseek_v32", tokenizer=False, index_topk=24, num_hidden_layers=2)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 1000, (n,), generator=gen).tolist() for n in (5, 17, 40, 90, 23)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    calls = {name: _counting(monkeypatch, name) for name in ("paged_mqa", "index_scores", "index_key_write")}
    llm = LLM(str(path), dtype="float32", kv_cache_dtype="int8", block_size=BLOCK, enable_prefix_caching=False)
    with_kernels = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(calls.values()), "the C8 kernels did not run"
    real = cpu_kernels.attention_usable
    monkeypatch.setattr(cpu_kernels, "attention_usable",
                        lambda q, pool, out_dim, codec=None: codec is None and real(q, pool, out_dim))
    monkeypatch.setattr(cpu_kernels, "index_usable", lambda *a: False)
    monkeypatch.setattr(cpu_kernels, "index_key_write", lambda *a: False)  # keys through codec.encode
    for c in calls.values():
        c.clear()
    portable = [o.token_ids for o in llm.generate(prompts, params)]
    assert not any(calls.values())
    assert with_kernels == portable



def test_topk_rows_is_a_stable_descending_sort_prefix():
    """The indexer's top-k in C: the first k of a stable descending sort (ties, many exact zeros, to the earliest
    position), -inf ranked last and not valid, rows narrower than k padded with invalid picks; in rows under
    1,024 keys (a quickselect) and wider ones (a radix select, thousands of equal scores among them)."""
    gen = torch.Generator().manual_seed(17)
    scores = torch.relu(torch.randn(6, 300, generator=gen)).round(decimals=1)  # many ties, zeros among them
    scores[1, 50:] = float("-inf")
    scores[2] = 0.0
    scores[3, ::7] = -0.0
    wide = torch.relu(torch.randn(4, 5000, generator=gen)).round(decimals=1)
    wide[1, ::3] = float("-inf")
    wide[2, 100:] = 0.5
    wide[3, ::2] = -0.0
    # scores that agree in their top 22 bits: the radix select's last digit (bits 0..9) decides (it once stopped a
    # digit early and took such keys by position: the indexer picked the wrong rows at 1,024+ keys)
    close = 5 + torch.rand(3, 2500, generator=gen) * 0.01
    for rows, ks in ((scores, (1, 64, 299, 300)), (wide, (1, 2048, 4000, 4999)), (close, (1, 64, 2048))):
        for k in ks:
            picks, valid = cpu_kernels.topk_rows(rows, k)
            best, order = rows.sort(dim=-1, descending=True, stable=True)
            assert torch.equal(picks, order[:, :k]) and torch.equal(valid, torch.isfinite(best[:, :k]))
    picks, valid = cpu_kernels.topk_rows(scores[:, :40], 64)
    best, order = scores[:, :40].sort(dim=-1, descending=True, stable=True)
    assert torch.equal(picks[:, :40], order) and torch.equal(valid[:, :40], torch.isfinite(best))
    assert not valid[:, 40:].any() and not picks[:, 40:].any()
