"""The demo model's recipe: where its corpus and checkpoint live, its architecture (DEMO), one run's knobs
(TrainConfig) and the schedule and optimizer every phase uses."""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.loader.tiny import TINY

ROOT = Path(__file__).resolve().parents[2]
CORPUS_DIR = ROOT / ".cache" / "corpus"
DEFAULT_CORPUS = CORPUS_DIR / "bible-kjv-text" / "usr" / "lib" / "bible.data"
DEFAULT_OUT = ROOT / "models" / "demo-v32"
MAKE_HINT = "run `make corpus` (apt-get download bible-kjv-text + dpkg -x into .cache/corpus/)"

# The architecture: make_config(**DEMO) is the config.json: the embedded tiny model's layout with the sizes
# a trained model wants (a 4k BPE vocabulary, a smaller latent, YaRN ×8 over 128 positions) and one MTP layer.
DEMO: dict[str, Any] = {
    **TINY,
    "vocab_size": 4096, "moe_intermediate_size": 96, "q_lora_rank": 128, "kv_lora_rank": 128,
    "qk_rope_head_dim": 32, "v_head_dim": 64, "index_head_dim": 64, "index_n_heads": 8,
    "max_position_embeddings": 1024, "initializer_range": 0.02,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                        "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_nextn_predict_layers": 1,
}
MTP_WEIGHT = 0.3  # DeepSeek-V3's λ for the first part of training

DEMO_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}  # generation_config.json


@dataclass
class TrainConfig:
    """One run's knobs; written to train_log.json so a run can be repeated exactly."""

    steps: int = 300  # dense phase
    align_steps: int = 30  # indexer alignment phase
    sparse_steps: int = 30  # sparse phase (all of it inside the `warmup` ramp: LR rises to sparse_lr, no decay)
    batch: int = 16
    align_batch: int = 4
    seq_len: int = 256  # tokens per sequence, BOS included
    lr: float = 3e-3
    sparse_lr: float = 3e-4
    align_lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update: float = 1e-3  # aux-loss-free balancing: router bias step per update (DeepSeek-V3's γ)
    val_fraction: float = 0.02
    seed: int = 0
    threads: int = 2
    model: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DEMO))


def lr_at(step: int, total: int, cfg: TrainConfig, peak: float) -> float:
    """Linear warmup over a fixed number of steps (so the first steps do not depend on `total`), then
    cosine down to min_lr_ratio·peak."""
    if step < cfg.warmup:
        return peak * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(params: list[nn.Parameter], cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
