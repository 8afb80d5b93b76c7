"""FP8 e4m3 helpers: block-scaled weight dequantization and DeepSeek's activation fake-quant.

Real DeepSeek checkpoints store most linears as float8_e4m3fn with `weight_scale_inv` holding one
fp32 multiplier per 128×128 block (despite the name it multiplies; edges may be ragged, e.g. 576 rows).
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
BLOCK = 128


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """W[i, j] = float(W8[i, j]) * scale_inv[i // block, j // block], ragged edges sliced off."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return weight.float() * scale


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
