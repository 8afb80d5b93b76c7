"""RoPE with YaRN, in the two layouts DeepSeek-V3.2 uses.

MLA rotates interleaved pairs (2i, 2i+1) and the cache keeps that interleaved layout (DeepSeek's own
format); the indexer rotates NeoX pairs (i, i + d/2) — the 2025-11-17 fix (spec P1). Both share one
frequency table. cos/sin carry HF's `attention_factor` (1.0 for DeepSeek's mscale == mscale_all_dim);
the magnitude correction goes into the MLA softmax scale instead (see ModelConfig.softmax_scale).
"""

from __future__ import annotations

import math

import torch

from shared.config import RopeConfig, yarn_get_mscale


def inv_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (fp32) and the cos/sin scale, as transformers computes them."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention_factor


class RotaryTable:
    """cos/sin per absolute position, [max_pos, dim/2] each, built once and grown on demand."""

    def __init__(self, rope: RopeConfig, dim: int, device: torch.device, initial_positions: int = 4096):
        self.inv_freq, self.scale = inv_frequencies(rope, dim)
        self.inv_freq = self.inv_freq.to(device)
        self.device = device
        self.cos = self.sin = torch.empty(0, dim // 2, device=device)
        self._grow(initial_positions)

    def _grow(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = t[:, None] * self.inv_freq[None, :]
        self.cos, self.sin = freqs.cos() * self.scale, freqs.sin() * self.scale

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [N] → [N, dim/2] each, in `dtype`."""
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            self._grow(max(int(positions.max()) + 1, 2 * self.cos.shape[0]))
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle i; output keeps the interleaved layout.

    x: [N, ..., d]; cos/sin: [N, d/2], broadcast over the middle dims.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) by angle i (NeoX rotate-half); x: [N, ..., d]."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
