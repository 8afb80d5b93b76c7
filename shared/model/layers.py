"""Small building blocks: RMSNorm, the linears in each weight format, and the SwiGLU MLP.

Every linear the model builds is called as `layer(x, generated)`: `generated` is how many leading rows of x
are the step's generated tokens (ForwardBatch.generated; 0 for any other rows), which take the CPU kernel
where it applies (shared.model.ops). Quantized and TP-sharded linears have no kernel and run all rows alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import shared.model.ops as ops
from shared.device import BUCKETED_GEMM_DTYPES, host_gemm_sizes
from shared.quant import fp8, int8


@dataclass(frozen=True)
class WeightFormat:
    """How a linear holds its weight: "int8" (W8A8, shared.quant.int8) or "fp8" (e4m3 + block scales, kept as
    DeepSeek stores it, dequantized per block on the fly in `compute`)."""

    kind: str
    block: tuple[int, int] = (128, 128)
    compute: torch.dtype = torch.float32


@dataclass(frozen=True)
class LinearFormats:
    """The formats of a layer's linears: `target` for the ones W8A8 quantizes (shared.quant.int8: MLA's
    projections but kv_b, the indexer's wq_b, dense MLPs, experts), `other` for the rest (the indexer's wk).
    None: the model dtype."""

    target: WeightFormat | None = None
    other: WeightFormat | None = None


class RMSNorm(nn.Module):
    """y = w · (x / rms(x)), normalized in fp32 and cast back before the weight (as transformers)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's form: weight and normalized x both in fp32, result fp32."""
        xf = x.float()
        return self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


class Linear(nn.Linear):
    """nn.Linear whose output keeps the input's dtype when the weight is held in another one."""

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        return ops.linear(x, self.weight, generated)

    def warm_host_gemms(self) -> None:
        """The portable matmul once at each of host_gemm_sizes() (see shared.device.host_gemm_rows): bf16 / fp16
        weights, the ones oneDNN builds a primitive per row count for."""
        if self.weight.dim() == 2 and self.weight.numel() and self.weight.dtype in BUCKETED_GEMM_DTYPES:
            for size in host_gemm_sizes():
                ops.matmul_rows(self.weight.new_zeros(size, self.weight.shape[1]), self.weight)


class W8A8Linear(int8.Int8Linear):
    """W8A8 (shared.quant.int8) in the model's call form, layer(x, generated): the int8 kernel on the host
    (ops.w8a8_linear), every row alike."""

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        return ops.w8a8_linear(x, self.weight, self.weight_scale)


class Fp8BlockLinear(fp8.Fp8Linear):
    """FP8 weights, block scales (shared.quant.fp8) in the model's call form: no kernel, all rows alike."""

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        return super().forward(x)


def linear(in_features: int, out_features: int, dtype: torch.dtype, fmt: WeightFormat | None = None) -> nn.Module:
    """Bias-free linear with uninitialized storage (the loader fills it), in `fmt` (None: `dtype`)."""
    if fmt is not None and fmt.kind == "int8":
        return W8A8Linear(in_features, out_features)
    if fmt is not None and fmt.kind == "fp8":
        return Fp8BlockLinear(in_features, out_features, fmt.block, fmt.compute)
    layer = Linear(in_features, out_features, bias=False, dtype=dtype, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
    return layer


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Dense layers and the shared expert."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, fmt: WeightFormat | None = None):
        super().__init__()
        self.gate_proj = linear(hidden, inter, dtype, fmt)
        self.up_proj = linear(hidden, inter, dtype, fmt)
        self.down_proj = linear(inter, hidden, dtype, fmt)

    def forward(self, x: torch.Tensor, generated: int = 0) -> torch.Tensor:
        gate, up = same_input(x, generated, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up, generated)


def same_input(x: torch.Tensor, generated: int, *layers: nn.Module) -> list[torch.Tensor]:
    """layer(x, generated) of each layer, where they are plain Linears in one call (ops.linear_many: the rows
    packed once for all, as vLLM's merged gate_up and DeepSeek's fused q_a / kv_a projections read them)."""
    if all(type(layer) is Linear for layer in layers):
        return ops.linear_many(x, [layer.weight for layer in layers], generated)
    return [layer(x, generated) for layer in layers]
