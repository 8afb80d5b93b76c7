"""W8A8 INT8: int8 weights per output channel, int8 activations per token, int32-exact products.

Ascend has no FP8 arithmetic; its natural precision is W8A8 (the CANN DeepSeek-V3.2 practice).
Weights are quantized once (symmetric, one fp32 scale per output channel, |q| ≤ 127); activations
are quantized dynamically before each matmul (one scale per token: amax / 127). The integer
product is rescaled by s_x · s_w and returned in the activation dtype. Which linears are quantized
follows Ascend's DeepSeek practice (MindIE / msModelSlim: MLA W8A8, the dense layers' MLPs and the shared
experts W8A8, routed experts W8A8 dynamic): MLA's q_a_proj (q_proj without a q LoRA), kv_a_proj_with_mqa,
q_b_proj and o_proj, the indexer's wq_b, the dense layers' MLPs, the routed and the shared experts.
Everything else stays bf16: embeddings, norms, the router, kv_b_proj (absorbed into per-head matrices at
load), the indexer's wk and weights_proj, lm_head. A W8A8 checkpoint that holds one of these linears in
bf16 (converted by a release with a narrower set) loads: the loader quantizes it as it reads it.

Checkpoint layout (what `pdserve convert --format w8a8` writes and the loader reads): `X.weight`
int8 [out, in] plus `X.weight_scale` fp32 [out], and `quantization_config` =
`{"quant_method": "w8a8_int8", ...}` in config.json.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from shared.config import W8A8_METHOD as QUANT_METHOD  # noqa: F401 - re-exported
from shared.device import int8_matmul

INT8_MAX = 127.0
SCALE_SUFFIX = "_scale"  # X.weight → X.weight_scale

# Checkpoint names (Hugging Face layout) of the weights W8A8 quantizes.
_TARGET = re.compile(
    r"^model\.layers\.\d+\.("
    r"self_attn\.(q_a_proj|q_proj|kv_a_proj_with_mqa|q_b_proj|o_proj|indexer\.wq_b)"
    r"|mlp\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.(\d+\.(gate_proj|up_proj|down_proj)|gate_up_proj|down_proj)"
    r")(\.weight)?$"
)


def is_w8a8_target(name: str) -> bool:
    """Whether a checkpoint tensor (e.g. `model.layers.3.self_attn.o_proj.weight`) is int8 under W8A8.
    Also true for the fused 3-D expert tensors (`mlp.experts.gate_up_proj`)."""
    return _TARGET.match(name) is not None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: weight [..., out, in] → (q int8 same shape, scale fp32
    [..., out]) with weight ≈ q · scale[..., None]. Leading dims (stacked experts) keep their own scales."""
    w = weight.float()
    scale = (w.abs().amax(-1) / INT8_MAX).clamp(min=1e-12)
    q = torch.round(w / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[..., None].float()).to(dtype)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8: x [..., K] → (q int8 [..., K], scale fp32 [..., 1])."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=1e-12)
    return torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x · Wᵀ under W8A8 for int8 `weight` [out, in] with per-channel `scale` [out]; output in
    x's dtype: `quantize_activation` and `shared.device.int8_matmul` (the portable path; the model's
    layers take the fused CPU kernel where it applies, shared.model.ops.w8a8_linear)."""
    shape = x.shape
    xq, sx = quantize_activation(x.reshape(-1, shape[-1]))
    y = int8_matmul(xq, sx, weight, scale)
    return y.to(x.dtype).view(*shape[:-1], weight.shape[0])


class Int8Linear(nn.Module):
    """A bias-free linear holding int8 weights [out, in] and fp32 per-channel scales [out]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        layer = cls(weight.shape[1], weight.shape[0])
        q, scale = quantize_weight(weight)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"


def grouped_w8a8(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped W8A8 matmul: rows [M, K] sorted by group (group g ends at offsets[g]) times int8
    weight[g] [N, K] with scale[g] [N] → fp32 [M, N]. Activations are quantized per token once;
    one int8 matmul per non-empty group (the offsets are read back to the host once: no device
    kernel takes int8 groups here). Rows past the last offset are left zero. The portable path: on the
    host, moe.Experts runs all experts in one kernel call (shared.model.int8_kernels.moe)."""
    xq, sx = quantize_activation(rows)
    out = rows.new_zeros(rows.shape[0], weight.shape[1], dtype=torch.float32)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = int8_matmul(xq[start:end], sx[start:end], weight[g], scale[g])
        start = end
    return out
