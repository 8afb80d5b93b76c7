"""The demo recipe's phases: language-model training (main + MTP loss, dense or sparse), the indexers'
alignment to the dense attention, and the validation every phase ends with."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from shared.demo.corpus import TokenSplit, make_batch
from shared.demo.model import DemoModel, RouterBalance, losses
from shared.demo.recipe import MTP_WEIGHT, TrainConfig, log, lr_at, make_optimizer


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
        seq = make_batch(split, split.starts[idx].tolist(), cfg.seq_len - 1, bos, model_device(model))
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
        seq = make_batch(split, split.starts[idx].tolist(), cfg.seq_len - 1, bos, model_device(model))
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
        seq = make_batch(split, starts[i : i + cfg.batch], cfg.seq_len - 1, bos, model_device(model))
        main, _, out = losses(model, seq)
        nll += main.item() * seq[:, 1:].numel()
        n_tok += seq[:, 1:].numel()
        draft = out["mtp_logits"].argmax(-1)
        hit += int((draft == seq[:, 2:]).sum())
        agree += int((draft == out["logits"][:, 1:].argmax(-1)).sum())
        n_mtp += draft.numel()
    return {"perplexity": math.exp(nll / n_tok), "tokens": n_tok, "mtp_top1": hit / n_mtp,
            "mtp_agrees_with_main_greedy": agree / n_mtp}




def model_device(model: nn.Module) -> torch.device:
    """Where the model's weights are: its batches go there too."""
    return next(model.parameters()).device
