"""KVLayout: what one token leaves behind in each layer, defined once.

Per layer, two pools share one block table:
* MLA: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` — the normalized latent c_kv
  followed by the post-RoPE k_pe (interleaved rope layout, DeepSeek's own cache format);
* indexer keys: `[num_blocks, block_size, index_head_dim]` — post-LayerNorm, post-RoPE key
  (absent for deepseek_v3).
The transfer layer moves exactly these rows, so prefill and decode agree on the format by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int  # 0: no indexer cache (deepseek_v3)
    dtype: torch.dtype
    index_dtype: torch.dtype

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype,
                          index_dtype: torch.dtype | None = None) -> KVLayout:
        return cls(
            num_layers=cfg.num_hidden_layers,
            block_size=block_size,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            index_head_dim=cfg.index_head_dim if cfg.has_indexer else 0,
            dtype=dtype,
            index_dtype=index_dtype or dtype,
        )

    @property
    def mla_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def has_index(self) -> bool:
        return self.index_head_dim > 0

    @property
    def mla_bytes_per_token(self) -> int:
        return self.mla_dim * self.dtype.itemsize

    @property
    def index_bytes_per_token(self) -> int:
        return self.index_head_dim * self.index_dtype.itemsize

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
        }
