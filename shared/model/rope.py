"""RoPE with YaRN, in the two layouts DeepSeek-V3.2 uses.

MLA rotates interleaved pairs (2i, 2i+1) and the cache keeps that interleaved layout (DeepSeek's own
format); the indexer rotates NeoX pairs (i, i + d/2) — the 2025-11-17 fix (spec P1). Both share one
frequency table. cos/sin carry HF's `attention_factor` (1.0 for DeepSeek's mscale == mscale_all_dim);
the magnitude correction goes into the MLA softmax scale instead (see ModelConfig.softmax_scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import shared.model.ops as ops
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

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype, end: int) -> RopeAngles:
        """The step's angles for `positions` [N] (all below `end`, known on the host from the batch:
        no read-back of the device tensor), in `dtype`."""
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0]))
        return RopeAngles.of(self.cos[positions].to(dtype), self.sin[positions].to(dtype))


@dataclass
class RopeAngles:
    """cos/sin of one step widened to the full rotary width [N, d] for both layouts, the sign of
    the rotation folded into sin, so a rotation is x·cos + swap(x)·sin (3 ops instead of 9; the
    same arithmetic, bit for bit). Built once per step, shared by every layer."""

    inter_cos: torch.Tensor  # [c0, c0, c1, c1, ...]
    inter_sin: torch.Tensor  # [-s0, s0, -s1, s1, ...]
    neox_cos: torch.Tensor  # [c0 .. c_{h-1}, c0 .. c_{h-1}]
    neox_sin: torch.Tensor  # [-s0 .. -s_{h-1}, s0 .. s_{h-1}]

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> RopeAngles:
        return cls(cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2),
                   torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))

    def cos_sin(self, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of one layout: interleaved pairs (MLA's) or NeoX halves (the indexer's)."""
        return (self.inter_cos, self.inter_sin) if interleaved else (self.neox_cos, self.neox_sin)


def rope_interleaved(x: torch.Tensor, rope: RopeAngles, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by angle i; output keeps the interleaved layout. x: [N, ..., d].
    `out` (optional, x's shape; x's dtype or fp32) receives the result."""
    return ops.rope(x, rope.inter_cos, rope.inter_sin, True, out)


def rope_neox(x: torch.Tensor, rope: RopeAngles, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) by angle i (NeoX rotate-half); x: [N, ..., d]; `out` as above."""
    return ops.rope(x, rope.neox_cos, rope.neox_sin, False, out)
