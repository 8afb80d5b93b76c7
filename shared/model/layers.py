"""Small building blocks: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.quant.int8 import Int8Linear


class RMSNorm(nn.Module):
    """y = w · (x / rms(x)), normalized in fp32 and cast back before the weight (as transformers)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's form: weight and normalized x both in fp32, result fp32."""
        xf = x.float()
        return self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


def matmul_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x in the weight's dtype: weights may be held in the compute dtype (see store_for_compute)."""
    return x if x.dtype == weight.dtype else x.to(weight.dtype)


class Linear(nn.Linear):
    """nn.Linear whose output keeps the input's dtype when the weight is held in another one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(matmul_input(x, self.weight), self.weight).to(x.dtype)


def linear(in_features: int, out_features: int, dtype: torch.dtype, int8: bool = False) -> nn.Module:
    """Bias-free linear with uninitialized storage (the loader fills it); `int8`: W8A8 (shared.quant.int8)."""
    if int8:
        return Int8Linear(in_features, out_features)
    layer = Linear(in_features, out_features, bias=False, dtype=dtype, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
    return layer


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Dense layers and the shared expert."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, int8: bool = False):
        super().__init__()
        self.gate_proj = linear(hidden, inter, dtype, int8)
        self.up_proj = linear(hidden, inter, dtype, int8)
        self.down_proj = linear(inter, hidden, dtype, int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
