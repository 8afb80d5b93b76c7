"""Train the demo model: a small DeepSeek-V3.2 on the King James Bible, so `make demo` streams English.

    python -m shared.demo.train [--out models/demo-v32] [--steps N] [--corpus PATH]

The random tiny model streams noise; this one has exactly the V3.2 architecture the engine serves (MLA,
lightning indexer with `index_topk` below the demo's context, MoE with a shared expert and aux-loss-free
router bias, YaRN RoPE, one MTP layer) at toy size, trained deterministically on 2 CPU cores in minutes.
transformers' `DeepseekV32ForCausalLM` is the trainable model (it is the reference the engine is tested
against). Its indexer runs under `no_grad` (top-k is not differentiable), so training follows DeepSeek's
recipe in three phases:

1. dense: main model + MTP layer (loss = main + 0.3·mtp) with every key selected (top-k ≥ context);
2. indexer alignment: everything else frozen, each indexer (main layers and MTP block) learns to match
   the dense attention (softmax of its scores vs the attention probabilities summed over heads, KL);
3. sparse: main model + MTP layer again, now with the shipped `index_topk` (the indexers frozen).

Corpus: Debian's `bible-kjv-text` (`make corpus` downloads and extracts it). Its `usr/lib/bible.data`
is the text in 64 KiB blocks of Unix-compress (LZW) data behind a block table; we decode it with gzip.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.loader.tiny import TINY, make_config
from shared.loader.tokenizer_train import train_tokenizer as train_bpe

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
DEVICE = torch.device("cpu")  # the recipe is CPU; --device only for quick experiments

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


# ---------------------------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    verses: list[str]
    info: dict[str, Any]


def decode_bible_data(raw: bytes) -> str:
    """`bible.data` of bible-kjv: 'EC02Compressed Data File', then at 0x50 big-endian u32s (0, block
    size, block count, block offsets + end); the first block keeps compress's 3-byte magic, the others
    are bare LZW streams, so each gets the magic prepended and goes through `gzip -dc`."""
    if not raw.startswith(b"EC02"):
        raise ValueError("not a bible-kjv compressed data file (no EC02 magic)")
    _, _, count = struct.unpack(">3I", raw[0x50:0x5C])
    offsets = struct.unpack(f">{count + 1}I", raw[0x5C : 0x5C + 4 * (count + 1)])
    magic = raw[offsets[0] - 3 : offsets[0]]
    parts = []
    for i in range(count):
        done = subprocess.run(["gzip", "-dc"], input=magic + raw[offsets[i] : offsets[i + 1]],
                              capture_output=True, check=True)
        parts.append(done.stdout)
    return b"".join(parts).decode("latin-1")


def read_corpus(path: str | Path) -> Corpus:
    """The verses, one a line, without their references ('Ge1:1 In the beginning' → 'In the
    beginning'), and what identifies the corpus (package, version, sha256 of the file read)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} not found: {MAKE_HINT}")
    raw = path.read_bytes()
    text = decode_bible_data(raw) if raw.startswith(b"EC02") else raw.decode("utf-8")
    lines = [ln.strip() for ln in text.splitlines()]
    ref = re.compile(r"^[0-9]?[A-Za-z]+[0-9]+:[0-9]+\s+")
    verses = [ref.sub("", ln) for ln in lines if ref.match(ln)]
    if not verses:
        verses = [ln for ln in lines if ln]
    info: dict[str, Any] = {"file": path.name, "sha256": hashlib.sha256(raw).hexdigest(),
                            "verses": len(verses), "characters": sum(len(v) + 1 for v in verses)}
    control = next((p / "DEBIAN" / "control" for p in path.parents if (p / "DEBIAN" / "control").exists()), None)
    if control is not None:
        fields = dict(ln.split(": ", 1) for ln in control.read_text().splitlines() if ": " in ln)
        info.update(package=fields.get("Package"), version=fields.get("Version"))
    else:
        info.update(package=None, version=None)
    return Corpus(verses, info)


def train_tokenizer(verses: list[str], vocab_size: int, out_file: Path) -> Any:  # tokenizers.Tokenizer
    """Byte-level BPE on the training verses, with the special tokens of shared.loader.tokenizer_train
    (BOS id 0, EOS id 1, then DeepSeek's chat tokens). Deterministic."""
    return train_bpe(vocab_size, out_file, verses)


@dataclass
class TokenSplit:
    ids: torch.Tensor  # all tokens of the split, verse after verse ('\n' ends each)
    starts: torch.Tensor  # token offset of each verse

    def windows(self, seq_len: int) -> list[int]:
        """Verse-aligned starts of consecutive, non-overlapping evaluation windows."""
        out, nxt = [], 0
        for s in self.starts.tolist():
            if s >= nxt and s + seq_len - 1 <= len(self.ids):
                out.append(s)
                nxt = s + seq_len - 1
        return out


def tokenize(tok: Any, verses: list[str]) -> TokenSplit:
    enc = tok.encode_batch([v + "\n" for v in verses], add_special_tokens=False)
    lengths = torch.tensor([len(e.ids) for e in enc])
    starts = torch.cumsum(lengths, 0) - lengths
    return TokenSplit(torch.tensor([i for e in enc for i in e.ids], dtype=torch.long), starts)


def make_batch(split: TokenSplit, starts: list[int], seq_len: int, bos: int) -> torch.Tensor:
    """[B, seq_len + 1]: BOS then the seq_len tokens from each start (inputs [:, :-1], targets [:, 1:])."""
    rows = [torch.cat([torch.tensor([bos]), split.ids[s : s + seq_len]]) for s in starts]
    return torch.stack(rows).to(DEVICE)


# ----------------------------------------------------------------------------------------------- model


def hf_config(model: dict[str, Any]) -> Any:  # DeepseekV32Config
    from transformers import DeepseekV32Config

    cfg = DeepseekV32Config(**{k: v for k, v in make_config(**model).items() if k != "architectures"})
    cfg._attn_implementation = "sdpa"
    return cfg


class DemoMTPLayer(nn.Module):
    """DeepSeek's MTP module at layer index N = num_hidden_layers (vLLM deepseek_mtp, spec §8): for
    position i, x_i = eh_proj(cat([enorm(embed(t_{i+1})), hnorm(h_i)])) with h_i the main model's
    post-final-norm hidden state; a full decoder block (MLA + its own indexer + MoE) over x at rotary
    positions i, causal over the MTP states ≤ i; logits_i = head(shared_head.norm(block_i)) predict
    t_{i+2}. embed and head are the main model's (the checkpoint stores copies)."""

    def __init__(self, config: Any):  # DeepseekV32Config
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer, DeepseekV32RMSNorm

        super().__init__()
        n, hidden, eps = config.num_hidden_layers, config.hidden_size, config.rms_norm_eps
        self.config = copy.deepcopy(config)  # one layer deeper, so the block at index n is an MoE layer
        self.config.num_hidden_layers = n + 1
        self.config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        self.config._attn_implementation = config._attn_implementation
        self.enorm = DeepseekV32RMSNorm(hidden, eps)
        self.hnorm = DeepseekV32RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekV32DecoderLayer(self.config, n)
        self.shared_head_norm = DeepseekV32RMSNorm(hidden, eps)

    def forward(self, embed_next: torch.Tensor, h_prev: torch.Tensor, position_embeddings: tuple,
                mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """embed_next = embed(t_{i+1}), h_prev = h_i: [B, S, H] each → normed block output [B, S, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embed_next), self.hnorm(h_prev)], dim=-1))
        x = self.block(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        return self.shared_head_norm(x)


def _select_all(hidden_states: torch.Tensor, _q_resid: torch.Tensor, _rope: tuple, attention_mask: torch.Tensor,
                *_args: Any, **_kwargs: Any) -> torch.Tensor:
    """The indexer's answer when top-k covers the whole context: every key (the causal mask does the rest)."""
    b, s, t = hidden_states.shape[0], hidden_states.shape[1], attention_mask.shape[-1]
    return torch.arange(t, dtype=torch.int32, device=hidden_states.device).expand(b, s, t)


class DemoModel(nn.Module):
    """transformers' DeepseekV32ForCausalLM plus the MTP layer, trained together."""

    def __init__(self, model_cfg: dict[str, Any], seed: int):
        from transformers import DeepseekV32ForCausalLM

        super().__init__()
        torch.manual_seed(seed)
        self.lm = DeepseekV32ForCausalLM(hf_config(model_cfg))
        self.mtp = DemoMTPLayer(self.lm.config)
        for module in self.mtp.modules():  # the HF init (normal(0, 0.02), norms 1, router bias 0)
            self.lm._init_weights(module)

    def attention_modules(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.lm.model.layers] + [self.mtp.block.self_attn]

    def set_index_topk(self, topk: int | None) -> None:
        """None: dense, every key selected without running the indexers (their scores are unused)."""
        for attn in self.attention_modules():
            if topk is None:
                attn.indexer.forward = _select_all
            else:
                attn.indexer.__dict__.pop("forward", None)
                attn.indexer.index_topk = topk

    def set_attn_implementation(self, impl: str) -> None:
        self.lm.config._attn_implementation = impl
        self.mtp.config._attn_implementation = impl

    def forward(self, seq: torch.Tensor) -> dict[str, torch.Tensor]:
        """seq [B, L+1] → main logits at positions 0..L-1 (predict seq[:, 1:]) and MTP logits at
        positions 0..L-2 (predict seq[:, 2:])."""
        inputs = seq[:, :-1]
        b, length = inputs.shape
        h = self.lm.model(input_ids=inputs).last_hidden_state  # post-final-norm
        logits = self.lm.lm_head(h)
        s = length - 1
        pos = torch.arange(s, device=seq.device).unsqueeze(0).expand(b, s)
        embed_next = self.lm.model.embed_tokens(seq[:, 1:length])
        rope = self.lm.model.rotary_emb(embed_next, position_ids=pos)
        # additive float mask: eager attention (used to align the indexers) adds the mask as is
        mask = torch.full((s, s), torch.finfo(h.dtype).min, device=seq.device).triu(1).expand(b, 1, s, s)
        g = self.mtp(embed_next, h[:, :s], rope, mask, pos)
        return {"logits": logits, "mtp_logits": self.lm.lm_head(g)}


def losses(model: DemoModel, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    out = model(seq)
    vocab = out["logits"].shape[-1]
    main = F.cross_entropy(out["logits"].reshape(-1, vocab).float(), seq[:, 1:].reshape(-1))
    mtp = F.cross_entropy(out["mtp_logits"].reshape(-1, vocab).float(), seq[:, 2:].reshape(-1))
    return main, mtp, out


class RouterBalance:
    """DeepSeek-V3's aux-loss-free balancing: after each step every router's e_score_correction_bias
    moves by γ towards equal expert load (+γ for underloaded experts, -γ for overloaded)."""

    def __init__(self, model: DemoModel, gamma: float):
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

        self.gamma = gamma
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV32TopkRouter)]
        self.load = {id(r): torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers}
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, router: nn.Module, _args: tuple, out: tuple) -> None:
        if router.training:
            self.load[id(router)] += torch.bincount(out[2].flatten(), minlength=router.num_experts).float()

    @torch.no_grad()
    def update(self) -> float:
        """Apply the step; returns the worst max/mean load ratio over routers (1 = balanced)."""
        worst = 0.0
        for r in self.routers:
            load = self.load[id(r)]
            if load.sum() > 0:
                worst = max(worst, float(load.max() / load.mean()))
                r.e_score_correction_bias += self.gamma * torch.sign(load.mean() - load)
            load.zero_()
        return worst

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------------------- training


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


def train_lm(model: DemoModel, split: TokenSplit, cfg: TrainConfig, steps: int, peak_lr: float, order: torch.Tensor,
             phase: str, params: list[nn.Parameter]) -> list[dict[str, float]]:
    """Main + MTP loss for `steps` steps of cfg.batch sequences, starting at the verses `order` lists
    in that order; returns the per-step losses."""
    model.train()
    opt = make_optimizer(params, cfg, peak_lr)
    balance = RouterBalance(model, cfg.bias_update)
    history, t0, tokens = [], time.monotonic(), 0
    bos = model.lm.config.bos_token_id
    for step in range(steps):
        idx = order[step * cfg.batch : (step + 1) * cfg.batch]
        seq = make_batch(split, split.starts[idx].tolist(), cfg.seq_len - 1, bos)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, cfg, peak_lr)
        main, mtp, _ = losses(model, seq)
        loss = main + MTP_WEIGHT * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        imbalance = balance.update()
        tokens += seq[:, :-1].numel()
        history.append({"loss": loss.item(), "main": main.item(), "mtp": mtp.item()})
        if step < 3 or (step + 1) % 10 == 0 or step + 1 == steps:
            dt = time.monotonic() - t0
            log(f"[{phase}] step {step + 1}/{steps} loss {loss.item():.4f} (main {main.item():.4f} "
                f"mtp {mtp.item():.4f}) lr {opt.param_groups[0]['lr']:.2e} max/mean expert load {imbalance:.2f} "
                f"{tokens / dt:.0f} tok/s {dt:.0f}s")
    balance.close()
    return history


def indexer_scores(indexer: nn.Module, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """The score transformers' DeepseekV32Indexer ranks keys by, with gradients: Σ_h w_h·ReLU(q_h·k)·D^-0.5
    (non-interleaved RoPE on the first qk_rope_head_dim dims of q and k). [B, S, T], unmasked."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    b, s, _ = x.shape
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(x)).unsqueeze(2)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(x.float()).float() * indexer.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


class AttentionCapture:
    """Per attention module: the indexer's inputs and the (eager) attention probabilities of one forward."""

    def __init__(self, model: DemoModel):
        self.inputs: dict[int, tuple] = {}
        self.probs: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, attn in enumerate(model.attention_modules()):
            self.handles.append(attn.indexer.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self.handles.append(attn.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self.inputs[i] = (args[0].detach(), args[1].detach(), args[2])

        return hook

    def _post(self, i: int):
        def hook(_m: nn.Module, _args: tuple, out: tuple) -> None:
            self.probs[i] = out[1].detach()

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def alignment_loss(model: DemoModel, cap: AttentionCapture, topk: int) -> tuple[torch.Tensor, float]:
    """Σ over attention modules of KL(p_attn ‖ softmax(indexer scores)), p_attn = dense attention
    probabilities summed over heads and renormalized (DeepSeek-V3.2's dense warm-up); also the share of
    attention mass the indexer's top-k keys cover (1 = sparse attention sees all it needs)."""
    total, recall = torch.zeros((), device=cap.probs[0].device), []
    for i, attn in enumerate(model.attention_modules()):
        x, q_resid, (cos, sin) = cap.inputs[i]
        p = cap.probs[i].float().sum(1)
        p = p / p.sum(-1, keepdim=True)
        s = p.shape[-1]
        causal = torch.ones(s, s, dtype=torch.bool, device=p.device).tril()
        scores = indexer_scores(attn.indexer, x, q_resid, cos, sin).masked_fill(~causal, float("-inf"))
        logq = torch.log_softmax(scores, -1)
        kl = (p * (torch.log(p.clamp_min(1e-12)) - logq.masked_fill(~causal, 0))).sum(-1)
        total = total + kl.mean()
        with torch.no_grad():
            top = scores.topk(min(topk, s), dim=-1).indices
            recall.append(p.gather(-1, top).sum(-1)[:, topk:].mean().item())
    return total, sum(recall) / len(recall)


def align_indexers(model: DemoModel, split: TokenSplit, cfg: TrainConfig, order: torch.Tensor,
                   ) -> list[dict[str, float]]:
    """Phase 2: the model frozen (dense attention, eager so the probabilities come out), only the
    indexers' wq_b, wk, k_norm and weights_proj learn."""
    params = [p for attn in model.attention_modules() for p in attn.indexer.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    model.eval()
    model.set_attn_implementation("eager")
    opt = make_optimizer(params, cfg, cfg.align_lr)
    cap = AttentionCapture(model)
    topk = model.lm.config.index_topk
    history, t0 = [], time.monotonic()
    bos = model.lm.config.bos_token_id
    for step in range(cfg.align_steps):
        idx = order[step * cfg.align_batch : (step + 1) * cfg.align_batch]
        seq = make_batch(split, split.starts[idx].tolist(), cfg.seq_len - 1, bos)
        with torch.no_grad():
            model(seq)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.align_steps, cfg, cfg.align_lr)
        loss, recall = alignment_loss(model, cap, topk)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        history.append({"kl": loss.item(), "topk_mass": recall})
        if step < 3 or (step + 1) % 10 == 0 or step + 1 == cfg.align_steps:
            log(f"[align] step {step + 1}/{cfg.align_steps} KL {loss.item():.4f} attention mass in the "
                f"indexer's top-{topk} (rows past {topk}) {recall:.3f} {time.monotonic() - t0:.0f}s")
    cap.close()
    model.set_attn_implementation("sdpa")
    for p in model.parameters():
        p.requires_grad_(True)
    return history


@torch.no_grad()
def evaluate(model: DemoModel, split: TokenSplit, cfg: TrainConfig, topk: int | None) -> dict[str, float]:
    """Validation perplexity, and the MTP layer's next-next-token top-1 accuracy: against the corpus,
    and against the main model's own greedy token there (what greedy speculative decoding accepts)."""
    model.eval()
    model.set_index_topk(topk)
    starts = split.windows(cfg.seq_len - 1)
    nll, n_tok, hit, agree, n_mtp = 0.0, 0, 0, 0, 0
    bos = model.lm.config.bos_token_id
    for i in range(0, len(starts), cfg.batch):
        seq = make_batch(split, starts[i : i + cfg.batch], cfg.seq_len - 1, bos)
        main, _, out = losses(model, seq)
        nll += main.item() * seq[:, 1:].numel()
        n_tok += seq[:, 1:].numel()
        draft = out["mtp_logits"].argmax(-1)
        hit += int((draft == seq[:, 2:]).sum())
        agree += int((draft == out["logits"][:, 1:].argmax(-1)).sum())
        n_mtp += draft.numel()
    return {"perplexity": math.exp(nll / n_tok), "tokens": n_tok, "mtp_top1": hit / n_mtp,
            "mtp_agrees_with_main_greedy": agree / n_mtp}


# --------------------------------------------------------------------------------------------- export


def _keep_fp32(name: str) -> bool:
    return bool(re.search(r"(norm\.(weight|bias)|layernorm\.weight|e_score_correction_bias)$", name))


def _split_experts(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF module state (fused experts) → checkpoint names (per-expert gate/up/down_proj, DeepSeek's)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        full = prefix + name
        if name.endswith("experts.gate_up_proj"):
            base, inter = full.removesuffix(".gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{base}.{e}.up_proj.weight"] = value[e, inter:]
        elif name.endswith("experts.down_proj"):
            base = full.removesuffix(".down_proj")
            for e in range(value.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = value[e]
        else:
            out[full] = value
    return out


def export_tensors(model: DemoModel) -> dict[str, torch.Tensor]:
    """The checkpoint: HF names, per-expert layout, MTP layer at index N with copies of embed and head;
    bf16, norms and router bias fp32."""
    n = model.lm.config.num_hidden_layers
    tensors = _split_experts("", model.lm.state_dict())
    mtp = f"model.layers.{n}."
    tensors.update(_split_experts(mtp, model.mtp.block.state_dict()))
    tensors.update({
        mtp + "embed_tokens.weight": model.lm.model.embed_tokens.weight,
        mtp + "enorm.weight": model.mtp.enorm.weight, mtp + "hnorm.weight": model.mtp.hnorm.weight,
        mtp + "eh_proj.weight": model.mtp.eh_proj.weight,
        mtp + "shared_head.norm.weight": model.mtp.shared_head_norm.weight,
        mtp + "shared_head.head.weight": model.lm.lm_head.weight,
    })
    return {k: v.detach().to(torch.float32 if _keep_fp32(k) else torch.bfloat16).contiguous().clone()
            for k, v in sorted(tensors.items()) if not k.endswith("rotary_emb.inv_freq")}


def write_checkpoint(out: Path, model: DemoModel, cfg: TrainConfig, tokenizer_file: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {**make_config(**cfg.model), "dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(export_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_file != out / "tokenizer.json":
        (out / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>", "model_max_length": config["max_position_embeddings"],
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(  # how the demo samples (greedy text loops)
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], **DEMO_SAMPLING},
        indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- main


def train(cfg: TrainConfig, corpus_path: str | Path = DEFAULT_CORPUS, out: str | Path | None = DEFAULT_OUT,
          work_dir: str | Path | None = None) -> dict[str, Any]:
    """The whole recipe. `out=None` trains without writing a checkpoint (what the test re-runs);
    the tokenizer then goes to `work_dir`. Returns the run's log (what train_log.json holds)."""
    import tokenizers
    import transformers

    t_start = time.monotonic()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    corpus = read_corpus(corpus_path)
    n_val = max(1, int(len(corpus.verses) * cfg.val_fraction))
    train_verses, val_verses = corpus.verses[:-n_val], corpus.verses[-n_val:]
    tok_dir = Path(out) if out is not None else Path(work_dir or ".")
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok_file = tok_dir / "tokenizer.json"
    tok = train_tokenizer(train_verses, cfg.model["vocab_size"], tok_file)
    train_split, val_split = tokenize(tok, train_verses), tokenize(tok, val_verses)
    log(f"corpus {corpus.info['package']} {corpus.info['version']}: {len(train_verses)} train verses "
        f"({len(train_split.ids)} tokens), {len(val_verses)} validation verses ({len(val_split.ids)} tokens); "
        f"tokenizer {time.monotonic() - t_start:.0f}s")

    # fixed data order: a seeded permutation of the training verse starts (those with a full window)
    usable = int((train_split.starts + cfg.seq_len - 1 <= len(train_split.ids)).sum())
    gen = torch.Generator().manual_seed(cfg.seed)
    total = (cfg.steps + cfg.sparse_steps) * cfg.batch + cfg.align_steps * cfg.align_batch
    order = torch.cat([torch.randperm(usable, generator=gen) for _ in range(-(-total // usable))])
    dense_order, order = order[: cfg.steps * cfg.batch], order[cfg.steps * cfg.batch :]
    align_order, sparse_order = order[: cfg.align_steps * cfg.align_batch], order[cfg.align_steps * cfg.align_batch :]

    model = DemoModel(cfg.model, cfg.seed).to(DEVICE)
    topk = cfg.model["index_topk"]
    params = [p for p in model.parameters()]
    n_params = sum(p.numel() for p in params)
    log(f"model: {n_params / 1e6:.2f}M parameters (incl. MTP layer)")

    t0 = time.monotonic()
    model.set_index_topk(None)  # phase 1: dense (every key selected)
    history = train_lm(model, train_split, cfg, cfg.steps, cfg.lr, dense_order, "dense", params)
    t_dense = time.monotonic() - t0
    result: dict[str, Any] = {"first_losses": history[:20], "final_dense_loss": history[-1] if history else None}
    if out is None:
        return result

    dense_eval = evaluate(model, val_split, cfg, None)
    log(f"dense validation: {dense_eval}")
    t0 = time.monotonic()
    align = align_indexers(model, train_split, cfg, align_order)
    t_align = time.monotonic() - t0
    aligned_eval = evaluate(model, val_split, cfg, topk)
    log(f"sparse (top-{topk}) validation after indexer alignment: {aligned_eval}")

    t0 = time.monotonic()
    model.set_index_topk(topk)  # phase 3: sparse, the shipped index_topk; indexers frozen
    lm_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    sparse = train_lm(model, train_split, cfg, cfg.sparse_steps, cfg.sparse_lr, sparse_order, "sparse", lm_params)
    t_sparse = time.monotonic() - t0
    final_eval = evaluate(model, val_split, cfg, topk)
    final_dense = evaluate(model, val_split, cfg, None)
    log(f"final validation, sparse top-{topk}: {final_eval}; dense: {final_dense}")

    out = Path(out)
    write_checkpoint(out, model, cfg, tok_file)
    result.update({
        "train_config": asdict(cfg),
        "corpus": {**corpus.info, "validation": f"last {n_val} verses ({cfg.val_fraction:.0%})"},
        "parameters": n_params,
        "validation": {
            "after_dense": dense_eval, "after_indexer_alignment_sparse": aligned_eval,
            "final_sparse": final_eval, "final_dense": final_dense,
        },
        "validation_perplexity": final_eval["perplexity"],
        "mtp_top1_accuracy": final_eval["mtp_top1"],
        "indexer_alignment": {"first": align[:3], "last": align[-3:]},
        "final_sparse_loss": sparse[-1] if sparse else None,
        "seconds": {"dense": round(t_dense, 1), "align": round(t_align, 1), "sparse": round(t_sparse, 1),
                    "total": round(time.monotonic() - t_start, 1)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "mtp": "x_i = eh_proj(cat([enorm(embed(t_{i+1})), hnorm(h_i)])), h_i = main post-final-norm state; "
               "decoder block at rotary position i, causal over MTP states <= i; "
               "logits_i = shared_head.head(shared_head.norm(block_i)) predict t_{i+2}; loss = main + 0.3 mtp",
    })
    (out / "train_log.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out} in {time.monotonic() - t_start:.0f}s")
    return result


def main(argv: list[str] | None = None) -> None:
    if argv is None and "OMP_WAIT_POLICY" not in os.environ:
        # libgomp reads this when torch loads, before any code of ours runs: start again with it set. Spinning
        # OpenMP workers make 2 threads ~8x slower on a busy 2-core machine; passive ones cost nothing.
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "shared.demo.train", *sys.argv[1:]])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="bible.data of bible-kjv-text, or a text file")
    p.add_argument("--steps", type=int, default=TrainConfig.steps, help="dense-phase steps")
    p.add_argument("--align-steps", type=int, default=TrainConfig.align_steps)
    p.add_argument("--sparse-steps", type=int, default=TrainConfig.sparse_steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a TrainConfig field")
    p.add_argument("--losses-only", action="store_true",
                   help="run only the first --steps dense steps; print their losses as JSON (no checkpoint)")
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if not Path(args.corpus).exists():
        raise SystemExit(f"corpus {args.corpus} not found: {MAKE_HINT}")
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = TrainConfig(steps=args.steps, align_steps=args.align_steps, sparse_steps=args.sparse_steps, seed=args.seed,
                      **overrides)
    if args.losses_only:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(train(cfg, args.corpus, None, tmp)["first_losses"]))
        return
    train(cfg, args.corpus, args.out)


if __name__ == "__main__":
    main()
