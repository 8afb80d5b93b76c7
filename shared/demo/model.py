"""The trainable demo model: transformers' DeepseekV32ForCausalLM with an MTP layer beside it (DeepSeek-V3's
multi-token prediction), its losses, and the aux-loss-free router balancing."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shared.loader.tiny import make_config


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
