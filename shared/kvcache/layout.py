"""KVLayout: what one token leaves behind in each layer, defined once.

Per layer, two pools share one block table:
* MLA: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` — the normalized latent c_kv
  followed by the post-RoPE k_pe (interleaved rope layout, DeepSeek's own cache format);
* indexer keys: `[num_blocks, block_size, index_head_dim]` — post-LayerNorm, post-RoPE key
  (absent for deepseek_v3).
The transfer layer moves exactly these rows, so prefill and decode agree on the format by construction.

With `kv_cache_dtype="int8"` (C8) both pools hold bytes, one row per token, packed by a RowCodec:
* MLA: the 512-d latent as int8 with one fp32 scale per 128 dims (amax / 127), then the 64-d rope key
  in bf16 (rotary phases need the precision): 512 + 4·4 + 64·2 = 656 bytes instead of 1152 in bf16;
* indexer key: FP8 e4m3 with one power-of-two fp32 scale per token (DeepSeek's ue8m0 rule, so keys
  the indexer already quantized that way are stored exactly): 128 + 4 bytes instead of 256.
The portable attention decodes the rows it gathers (tile by tile) back to the compute dtype; on CPUs the
attention kernel (shared.model.cpu_kernels) reads C8 MLA rows and indexer keys in place instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import EngineConfig, ModelConfig, knob_choices, knob_default
from shared.quant.fp8 import act_quant_ue8m0

KV_CACHE_DTYPES = knob_choices(EngineConfig, "kv_cache_dtype")  # declared on EngineConfig
DEFAULT_KV_CACHE_DTYPE = knob_default(EngineConfig, "kv_cache_dtype")
_GROUP = 128  # latent dims per C8 scale


class PlainRows:
    """Rows stored as they are, in the pool dtype."""

    def __init__(self, dim: int, dtype: torch.dtype):
        self.dim, self.width, self.dtype = dim, dim, dtype

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.dtype)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return stored.to(dtype)


class Int8LatentRows:
    """C8 MLA row: int8 latent | fp32 scale per 128 latent dims | bf16 rope key, as bytes."""

    dtype = torch.uint8
    group = _GROUP  # latent dims per scale (the CPU attention kernel reads rows by these facts)

    def __init__(self, latent: int, rope: int):
        self.latent, self.rope = latent, rope
        self.groups = -(-latent // _GROUP)
        self.dim = latent + rope
        self.width = latent + 4 * self.groups + 2 * rope

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        latent = rows[:, : self.latent].float()
        pad = self.groups * _GROUP - self.latent
        groups = torch.nn.functional.pad(latent, (0, pad)).view(n, self.groups, _GROUP)
        scale = (groups.abs().amax(-1) / 127.0).clamp(min=1e-12)  # [n, G]
        q = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(n, -1)[:, : self.latent]
        rope = rows[:, self.latent :].to(torch.bfloat16).contiguous()
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8), rope.view(torch.uint8)], 1)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lead = stored.shape[:-1]
        a, b = self.latent, self.latent + 4 * self.groups
        q = stored[..., :a].view(torch.int8).to(dtype)
        scale = stored[..., a:b].contiguous().view(torch.float32).to(dtype)  # [..., G]
        pad = self.groups * _GROUP - self.latent
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        latent = (q.view(*lead, self.groups, _GROUP) * scale[..., None]).view(*lead, -1)[..., : self.latent]
        rope = stored[..., b:].contiguous().view(torch.bfloat16).to(dtype)
        return torch.cat([latent, rope], -1)


class Fp8KeyRows:
    """C8 indexer key: FP8 e4m3 values | one fp32 power-of-two scale per token, as bytes."""

    dtype = torch.uint8

    def __init__(self, dim: int):
        self.dim, self.width = dim, dim + 4

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        q, scale = act_quant_ue8m0(rows, self.dim)  # DeepSeek's rule, one block per row; scale [N, 1]
        return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], -1)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = stored[..., : self.dim].view(torch.float8_e4m3fn).to(torch.float32)
        scale = stored[..., self.dim :].contiguous().view(torch.float32)
        return (q * scale).to(dtype)


RowCodec = PlainRows | Int8LatentRows | Fp8KeyRows


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int  # 0: no indexer cache (deepseek_v3)
    dtype: torch.dtype  # the rows' dtype (attention decodes C8 rows to it)
    index_dtype: torch.dtype
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE  # "int8": C8 rows (see the module docstring)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                          index_dtype: torch.dtype | None = None,
                          kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE,
                          extra_layers: int = 0) -> KVLayout:
        """`extra_layers`: pools past the model's layers (the MTP drafter's, at index num_hidden_layers)."""
        return cls(
            num_layers=cfg.num_hidden_layers + extra_layers,
            block_size=block_size,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            index_head_dim=cfg.index_head_dim if cfg.has_indexer else 0,
            dtype=dtype,
            index_dtype=index_dtype or dtype,
            kv_cache_dtype=kv_cache_dtype,
        )

    @property
    def c8(self) -> bool:
        return self.kv_cache_dtype == "int8"

    @property
    def mla_dim(self) -> int:
        """Width of an MLA row as attention sees it (latent | rope key)."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def has_index(self) -> bool:
        return self.index_head_dim > 0

    def mla_codec(self) -> RowCodec:
        return Int8LatentRows(self.kv_lora_rank, self.rope_dim) if self.c8 else PlainRows(self.mla_dim, self.dtype)

    def index_codec(self) -> RowCodec:
        return Fp8KeyRows(self.index_head_dim) if self.c8 else PlainRows(self.index_head_dim, self.index_dtype)

    @property
    def mla_bytes_per_token(self) -> int:
        codec = self.mla_codec()
        return codec.width * codec.dtype.itemsize

    @property
    def index_bytes_per_token(self) -> int:
        if not self.has_index:
            return 0
        codec = self.index_codec()
        return codec.width * codec.dtype.itemsize

    def bytes_per_token_per_layer(self) -> int:
        """MLA latent + rope key, plus the indexer key, for one token in one layer."""
        return self.mla_bytes_per_token + self.index_bytes_per_token

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer() * self.num_layers

    def describe(self) -> dict[str, object]:
        """JSON-friendly description, exchanged by peers to check they speak the same layout."""
        return {
            "num_layers": self.num_layers, "block_size": self.block_size,
            "kv_lora_rank": self.kv_lora_rank, "rope_dim": self.rope_dim,
            "index_head_dim": self.index_head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "index_dtype": str(self.index_dtype).removeprefix("torch."),
            "kv_cache_dtype": self.kv_cache_dtype,
        }
