"""Multi-head latent attention, absorbed form, over the paged latent cache.

Per token the cache keeps one 576-d row (c_kv 512 | k_pe 64) shared by all heads (MQA mode of MLA).
Queries are absorbed into latent space, q_abs[h] = q_nope[h] · W_UK[h], so a score is one dot
product of [q_abs | q_pe] with the cached row; the output o_lat = p · c_kv goes back through W_UV.
The same code runs prefill and decode: while the context fits index_topk (or without an indexer)
a causal dense attention over the request's cached rows, beyond it each query gathers only its
top-k rows. Both are tiled to a bounded working set (shared.model.attention). Dense prompt chunks
with enough queries per request attend in the expanded (MHA) form instead, where that is cheaper
(shared.model.attention.prompt_form), at any context length: it too streams key tiles; the cache is
the same either way.
"""

from __future__ import annotations

import torch
from torch import nn

import shared.model.ops as ops
from shared.config import ModelConfig
from shared.device import compute_dtype
from shared.kvcache.layout import RowCodec
from shared.model.attention import HeadDims, PromptForm, expanded_attention, prompt_form
from shared.model.batch import ForwardBatch
from shared.model.indexer import DEFAULT_NUMERICS, Indexer, Selection
from shared.model.layers import LinearFormats, RMSNorm, linear, same_input
from shared.model.rope import RopeAngles, rope_interleaved, rope_neox


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, indexer_numerics: str = DEFAULT_NUMERICS,
                 fmts: LinearFormats | None = None):
        super().__init__()
        fmts = fmts or LinearFormats()
        target = fmts.target
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.scale = cfg.softmax_scale
        self.interleaved = cfg.rope_interleave
        self.rotate = rope_interleaved if cfg.rope_interleave else rope_neox
        qk = self.nope + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = linear(cfg.hidden_size, self.q_lora_rank, dtype, target)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = linear(self.q_lora_rank, self.n_heads * qk, dtype, target)
        else:
            self.q_proj = linear(cfg.hidden_size, self.n_heads * qk, dtype, target)
        self.kv_a_proj_with_mqa = linear(cfg.hidden_size, self.kv_lora_rank + self.rope_dim, dtype, target)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, dtype)
        # absorbed after loading into per-head matrices in the compute dtype (absorb): never kept as FP8/int8
        self.kv_b_proj = linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), dtype)
        self.o_proj = linear(self.n_heads * self.v_dim, cfg.hidden_size, dtype, target)
        self.indexer = Indexer(cfg, dtype, indexer_numerics, fmts) if cfg.has_indexer else None
        self.w_uk: torch.Tensor | None = None  # [H, nope, c], set by absorb() after loading
        self.w_uv_t: torch.Tensor | None = None  # [H, c, v]
        self.expanded_prompts = True  # see prompt_form

    def absorb(self) -> None:
        """Split kv_b_proj once, after loading, into the absorbed per-head matrices (as DeepSeek and
        vLLM do): W_UK [H, nope, c] takes q_nope into latent space, W_UV^T [H, c, v] takes the latent
        output to v, both contiguous in the compute dtype. kv_b_proj's weight is then released, so
        the pair costs no more memory than the weight they replace."""
        weight = self.kv_b_proj.weight
        cdt = compute_dtype(weight.dtype, weight.device)
        w = weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank).to(cdt)
        self.w_uk = w[:, : self.nope].contiguous()
        self.w_uv_t = w[:, self.nope :].transpose(1, 2).contiguous()
        self.kv_b_dtype = weight.dtype
        self.kv_b_proj.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight as the checkpoint holds it, rebuilt from the absorbed pair."""
        if self.w_uk is None:
            return self.kv_b_proj.weight
        w = torch.cat([self.w_uk, self.w_uv_t.transpose(1, 2)], 1)
        return w.reshape(-1, self.kv_lora_rank).to(self.kv_b_dtype)

    def forward(self, x: torch.Tensor, rope: RopeAngles, fb: ForwardBatch, mla_pool: torch.Tensor,
                index_pool: torch.Tensor | None, codecs: tuple[RowCodec, RowCodec] | None = None) -> torch.Tensor:
        """`codecs` (MLA rows, indexer keys): how the pools store rows (None: as they are)."""
        mla_codec, index_codec = codecs or (None, None)
        n, g = x.shape[0], fb.generated  # g: the leading rows that are generated tokens (shared.model.ops)
        if self.q_lora_rank:
            qa, kv = same_input(x, g, self.q_a_proj, self.kv_a_proj_with_mqa)
            qr = self.q_a_layernorm(qa)
            q = self.q_b_proj(qr, g)
        else:
            qr, q = None, self.q_proj(x, g)
            kv = self.kv_a_proj_with_mqa(x, g)
        q = q.view(n, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], -1)

        # the cache row of each new token: [kv_a_layernorm(c_kv) | rope(k_pe)]
        cos, sin = rope.cos_sin(self.interleaved)
        ops.write_mla_rows(kv, self.kv_a_layernorm, cos, sin, self.interleaved, mla_pool, fb, mla_codec)

        index_query = self.indexer(x, qr, rope, fb, index_pool, index_codec) if self.indexer is not None else None

        if self.w_uk is None:
            self.absorb()
        cdt = self.w_uk.dtype  # per-head matmuls: fp32 on CPUs without bf16 arithmetic
        q_rot = q_pe.new_empty(n, self.n_heads, self.rope_dim, dtype=cdt)
        self.rotate(q_pe, rope, out=q_rot)  # rotated in the model dtype, stored in cdt
        o = x.new_empty(n, self.n_heads * self.v_dim)
        absorbed = []
        for tokens, part in fb.attention_parts():  # one part unless the step mixes decodes and chunks
            selection = None
            if index_query is not None:
                selection = self.indexer.select(index_query[0][tokens], index_query[1][tokens], part, index_pool,
                                                index_codec)
            if self.prompt_form(part, selection is not None) is PromptForm.EXPANDED:
                out = expanded_attention(q_nope[tokens], q_rot[tokens], part, mla_pool, self.w_uk, self.w_uv_t,
                                         self.scale, mla_codec)
                o[tokens] = out.reshape(-1, self.n_heads * self.v_dim)
            else:
                absorbed.append((tokens, part, selection))
        if absorbed:
            self._attend_absorbed(q_nope, q_rot, absorbed, mla_pool, mla_codec, o, g)
        return self.o_proj(o, g)

    def prompt_form(self, part: ForwardBatch, sparse: bool) -> PromptForm:
        """The form one attention part takes (shared.model.attention.prompt_form): dense prompt rows where
        expansion is cheaper, at any context length, in expanded form; decodes and sparse parts absorbed.
        `expanded_prompts` False keeps every part absorbed (the benches' baseline)."""
        if not self.expanded_prompts:
            return PromptForm.ABSORBED
        dims = HeadDims(self.n_heads, self.nope, self.rope_dim, self.v_dim, self.kv_lora_rank)
        return prompt_form(part, dims, sparse)

    def _attend_absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor,
                         parts: list[tuple[slice, ForwardBatch, Selection | None]], pool: torch.Tensor,
                         codec: RowCodec | None, o: torch.Tensor, generated: int) -> None:
        """Absorbed attention of the tokens of `parts` (decodes; sparse prompt rows; short chunks after long
        context): q_nope goes into latent space through W_UK, the latent output back through W_UV, into o. A
        part is all generated tokens (the step's first `generated`) or all prompt ones."""
        c, cdt, heads = self.kv_lora_rank, self.w_uk.dtype, self.n_heads
        for tokens, part, selection in parts:
            rows, is_generated = tokens.stop - tokens.start, tokens.stop <= generated
            query = q_nope.new_empty(rows, heads, c + self.rope_dim, dtype=cdt)
            ops.head_matmul(q_nope[tokens], self.w_uk, is_generated, out=query[..., :c])
            query[..., c:] = q_rot[tokens]
            o_lat = self._attend(query, part, pool, selection, codec)  # [rows, H, c]
            o[tokens].view(rows, heads, self.v_dim).copy_(ops.head_matmul(o_lat, self.w_uv_t, is_generated))

    def _attend(self, query: torch.Tensor, fb: ForwardBatch, pool: torch.Tensor,
                sel: Selection | None, codec: RowCodec | None) -> torch.Tensor:
        c = self.kv_lora_rank
        if sel is not None:  # each query attends to its top-k rows only
            return ops.sparse_attention(query, fb, pool, sel.picks, sel.valid, self.scale, c, codec)
        return fb.unpadded(ops.dense_attention(fb.padded(query), fb, pool, self.scale, c, codec))
