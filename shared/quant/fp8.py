"""FP8 e4m3 helpers: block-scaled weight dequantization and DeepSeek's activation fake-quant.

Real DeepSeek checkpoints store most linears as float8_e4m3fn with `weight_scale_inv` holding one
fp32 multiplier per 128×128 block (despite the name it multiplies; edges may be ragged, e.g. 576 rows).
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
BLOCK = 128


def decode_scales(scale_inv: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """Weight block scales as fp32 multipliers: fp32/bf16 as stored, e8m0 exponent bytes
    (float8_e8m0fnu, or uint8 under scale_fmt ue8m0) as 2^(byte - 127)."""
    if scale_inv.dtype == torch.float8_e8m0fnu:
        return scale_inv.float()
    if scale_inv.dtype == torch.uint8:
        if scale_fmt != "ue8m0":
            raise ValueError("uint8 weight scales need quantization_config.scale_fmt 'ue8m0'")
        return torch.exp2(scale_inv.float() - 127.0)
    return scale_inv.float()


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int] = BLOCK,
                      scale_fmt: str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[..., i, j] = float(W8[..., i, j]) * scale_inv[..., i // br, j // bc], ragged edges sliced off.
    Leading dims (stacked experts [E, rows, cols]) carry their own scales [E, ⌈rows/br⌉, ⌈cols/bc⌉].
    Converts in place on one output-sized buffer (no second weight-sized temporary)."""
    br, bc = (block, block) if isinstance(block, int) else block
    rows, cols = weight.shape[-2:]
    scale = decode_scales(scale_inv, scale_fmt)
    want = (*weight.shape[:-2], -(-rows // br), -(-cols // bc))
    if tuple(scale.shape) != want:
        raise ValueError(f"weight_scale_inv shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
                         f"with blocks {br}x{bc} (expected {want})")
    out = weight.to(torch.float32)
    scale = scale.repeat_interleave(br, dim=-2)[..., :rows, :]  # [..., rows, ⌈cols/bc⌉]
    full, rem = divmod(cols, bc)
    out[..., : full * bc].unflatten(-1, (full, bc)).mul_(scale[..., :full, None])
    if rem:
        out[..., full * bc :].mul_(scale[..., full:])
    return out.to(dtype)


def quant_block_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of dequant_block_fp8 (used to make FP8 test checkpoints): per-block amax / 448."""
    rows, cols = weight.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(br, block, bc, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(br * block, bc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def act_quant_ue8m0(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's act_quant with power-of-two scales: per `block` channels of the last dim.

    s = 2^ceil(log2(max(amax, 1e-4) / 448)); q = e4m3(clamp(x / s, ±448)). Returns (q, s) with s
    shaped [..., n_blocks].
    """
    shape = x.shape
    xb = x.float().view(*shape[:-1], shape[-1] // block, block)
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (xb / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(shape), scale


def fake_quant_ue8m0(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """act_quant then dequant, back in x's dtype (simulates an FP8 operand exactly)."""
    q, scale = act_quant_ue8m0(x, block)
    shape = x.shape
    deq = q.float().view(*shape[:-1], shape[-1] // block, block) * scale[..., None]
    return deq.view(shape).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    return (h * n**-0.5).to(device)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard on the last dim (DeepSeek's rotate_activation), bf16 in/out."""
    h = _hadamard(x.shape[-1], x.device)
    return (x.float() @ h.T).to(x.dtype)


_TILE_ELEMS = 1 << 24  # weight elements dequantized at once (64 MiB in fp32), whatever the layer's size


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               compute: torch.dtype) -> torch.Tensor:
    """y = x · Wᵀ for an FP8 weight kept as stored: whole row-blocks of W are dequantized to `compute`
    a bounded tile at a time (never the whole weight), each tile multiplied as soon as it exists."""
    rows, cols = weight.shape
    br = block[0]
    step = max(br, _TILE_ELEMS // max(cols, 1) // br * br)
    xc = x.to(compute)
    out = xc.new_empty(*x.shape[:-1], rows)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        tile = dequant_block_fp8(weight[r0:r1], scale_inv[r0 // br : -(-r1 // br)], block, dtype=compute)
        out[..., r0:r1] = xc @ tile.t()
    return out


class Fp8Linear(torch.nn.Module):
    """A bias-free linear whose weight stays FP8 e4m3 in memory (1 byte per parameter plus one fp32
    scale per block), dequantized per block on the fly (`fp8_linear`), as DeepSeek's release stores it."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], compute: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.block, self.compute = in_features, out_features, block, compute
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                         requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(
            torch.ones(-(-out_features // block[0]), -(-in_features // block[1])), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.compute).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


def grouped_fp8(rows: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, offsets: torch.Tensor,
                block: tuple[int, int], compute: torch.dtype) -> torch.Tensor:
    """Grouped matmul over FP8 expert weights [E, N, K] (scales [E, ⌈N/br⌉, ⌈K/bc⌉]): each non-empty
    group's expert is dequantized (tile-bounded) only when it has rows; the offsets are read back once.
    Returns fp32 [M, N]; rows past the last offset stay zero."""
    out = rows.new_zeros(rows.shape[0], weight.shape[1], dtype=torch.float32)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = fp8_linear(rows[start:end], weight[g], scale_inv[g], block, compute).float()
        start = end
    return out
