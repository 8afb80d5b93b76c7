"""DeepSeek-V3.2 / V3 causal LM over a paged KV cache: one implementation for every caller.

Module names mirror the Hugging Face checkpoint (`model.layers.N.self_attn.q_a_proj`, ...), so the
loader maps tensors by name; the routed experts are stacked per layer (see moe.Experts).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

import shared.model.attention as attention
import shared.model.moe_kernels as moe_kernels
from shared.config import EngineConfig, ModelConfig, knob_choices
from shared.device import compute_dtype, on_host
from shared.kvcache import KVCache
from shared.model.attention import HeadDims
from shared.model.batch import ForwardBatch
from shared.model.decoder import DecoderLayer
from shared.model.indexer import DEFAULT_NUMERICS
from shared.model.layers import MLP, LinearFormats, RMSNorm, WeightFormat, linear
from shared.model.moe import Experts, Gate
from shared.model.mtp import MTPLayer
from shared.model.offload import LayerOffloader
from shared.model.rope import RotaryTable
from shared.model.tensor_parallel import VocabParallelEmbedding, shard_linear
from shared.parallel.layer_shard import LayerSharder
from shared.parallel.state import ParallelState

QUANTIZATIONS = knob_choices(EngineConfig, "quantization")


def quantization_of(cfg: ModelConfig, asked: str | None) -> str:
    """The weight format the model runs: `asked` ("none": the model dtype; "w8a8"; "fp8": FP8 weights kept
    as FP8; None or "auto": the checkpoint's own — none for bf16 and FP8 releases, which are dequantized)."""
    if asked is not None and asked not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {asked!r}")
    if cfg.w8a8:
        if asked not in (None, "auto", "w8a8"):
            raise ValueError(f"the checkpoint is W8A8 (int8 weights); it cannot run with quantization {asked!r}")
        return "w8a8"
    return "none" if asked in (None, "auto") else asked


def linear_formats(cfg: ModelConfig, quantization: str, dtype: torch.dtype, device: torch.device) -> LinearFormats:
    """W8A8: int8 for the target linears only; FP8: every linear DeepSeek ships in FP8 stays FP8."""
    if quantization == "w8a8":
        return LinearFormats(target=WeightFormat("int8"))
    if quantization == "fp8":
        scheme = cfg.fp8
        fmt = WeightFormat("fp8", scheme.block if scheme else (128, 128), compute_dtype(dtype, device))
        return LinearFormats(target=fmt, other=fmt)
    return LinearFormats()


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, indexer_numerics: str, parallel: ParallelState,
                 fmts: LinearFormats | None = None):
        super().__init__()
        # given its (uninitialized) weight, nn.Embedding skips its random init: that init (even on the meta
        # device) imports torch._dynamo, 1.8 s of every process's start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _freeze=True,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, indexer_numerics, parallel, fmts) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)  # fp32, as DeepSeek keeps it


class DeepseekForCausalLM(nn.Module):
    """`parallel` places the one model: experts split over EP ranks at construction (the loader then
    reads only local experts); `apply_parallel()` after loading shards o_proj / lm_head / embedding
    for local TP and sets up layer sharding."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, indexer_numerics: str = DEFAULT_NUMERICS,
                 parallel: ParallelState | None = None, quantization: str | None = None, mtp: bool = False):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.parallel = parallel or ParallelState.single()
        # W8A8: asked for (weights quantized while loading) or the checkpoint is already W8A8
        self.quantization = quantization_of(cfg, quantization)
        fmts = linear_formats(cfg, self.quantization, dtype, device or torch.device("cpu"))
        self.model = Backbone(cfg, dtype, indexer_numerics, self.parallel, fmts)
        # DeepSeek computes the head in fp32 (fp32 weight, fp32 input): logits of a 129k vocabulary
        # differ by less than bf16's resolution, so a bf16 head would reorder near-ties.
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, torch.float32)
        self.rotary = RotaryTable(cfg.rope, cfg.qk_rope_head_dim, device or torch.device("cpu"))
        # the MTP drafter (speculative decoding), its KV in one more pool layer (index num_hidden_layers)
        self.mtp = None
        if mtp:
            if cfg.num_nextn_predict_layers < 1:
                raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers is 0)")
            self.mtp = MTPLayer(cfg, dtype, indexer_numerics, self.parallel, fmts)
        self.sharder = None
        self.offloader = None  # enable_offload(): chosen layers' weights stream from host memory
        self.stored_dtypes: dict[str, torch.dtype] = {}  # parameters held in the compute dtype: their own
        self.requires_grad_(False)

    def apply_parallel(self) -> None:
        """After loading: convert weights to this rank's shards (local TP, layer sharding) and precompute
        the absorbed MLA matrices."""
        self.store_for_compute()
        p = self.parallel
        tp = p.config.tp
        if tp > 1:
            self.model.embed_tokens = VocabParallelEmbedding(self.model.embed_tokens.weight.data, tp, p.tp_rank,
                                                             p.tp_group)
            self.lm_head = shard_linear(self.lm_head, "all_to_sharded", tp, p.tp_rank, p.tp_group, gather_output=True)
            for layer in self.model.layers:
                layer.self_attn.o_proj = shard_linear(layer.self_attn.o_proj, "sharded_to_all", tp, p.tp_rank,
                                                      p.tp_group)
        if p.config.layer_sharding and p.world > 1:
            self.sharder = LayerSharder(self.model.layers, p.config.layer_sharding, p.rank, p.world, p.world_group)
        for layer in self.model.layers:
            layer.self_attn.absorb()
        if self.mtp is not None:
            self.mtp.block.self_attn.absorb()

    def enable_offload(self, layers: list[int], buffers: int = 2) -> None:
        """Keep `layers`' weights in host memory; each is copied into one of `buffers` device staging
        buffers just before it runs, overlapped with the previous layer's compute (shared.model.offload).
        Call after apply_parallel(): it packs the final (sharded, absorbed) tensors."""
        if self.offloader is not None:
            raise RuntimeError("offload is already enabled")
        if not layers:
            return
        if self.sharder is not None:  # both would re-point the same weights around each layer
            raise ValueError("--offload-layers cannot be combined with layer sharding")
        for layer in self.model.layers:  # absorb now: a lazy absorb() in forward would replace offloaded tensors
            if layer.layer_idx in layers and layer.self_attn.w_uk is None:
                layer.self_attn.absorb()
        self.offloader = LayerOffloader(self.model.layers, layers, self.model.norm.weight.device, buffers)

    def store_for_compute(self) -> None:
        """On a CPU without bf16 arithmetic (oneDNN emulates it, 4-250× slower) a bf16 model keeps its
        matmul weights in fp32: exact copies, fp32 accumulation, outputs rounded back to bf16 — the
        numerics of a bf16 GEMM on an accelerator, at fp32 speed, for twice the weight memory.
        Routed experts stay bf16 where the CPU kernels run (moe_kernels.widened_experts: widened in registers,
        half the memory and half the bytes a decode step reads). Elsewhere nothing changes."""
        weight = self.model.embed_tokens.weight
        cdt = compute_dtype(self.dtype, weight.device)
        if cdt == self.dtype:
            return
        for prefix, module in self.named_modules():
            if isinstance(module, Experts) and moe_kernels.widened_experts(module.gate_up_proj):
                continue
            if isinstance(module, (nn.Linear, Experts, Gate)):
                for name, param in list(module.named_parameters(recurse=False)):
                    if param.dtype in (torch.bfloat16, torch.float16) and param.dtype != cdt:  # not FP8/int8
                        self.stored_dtypes[f"{prefix}.{name}"] = param.dtype
                        setattr(module, name, nn.Parameter(param.data.to(cdt), requires_grad=False))

    def compile_token_parts(self) -> None:
        """torch.compile (inductor, dynamic shapes) the parts of each layer that work token by token —
        norms, dense MLPs and shared experts, the MoE router — so their elementwise ops fuse. Attention
        (paged, tiled, data-dependent) and the grouped experts stay eager."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Gate)):
                module.forward = torch.compile(module.forward, dynamic=True)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters by checkpoint name as loaded (kv_b_proj rebuilt from its absorbed pair)."""
        out = {name: p.to(self.stored_dtypes.get(name, p.dtype)) for name, p in self.named_parameters()}
        for layer in self.model.layers:
            name = f"model.layers.{layer.layer_idx}.self_attn.kv_b_proj.weight"
            w = layer.self_attn.kv_b_weight()
            out[name] = w.to(self.stored_dtypes.get(name, w.dtype))
        return out

    @torch.inference_mode()
    def warm_host_gemms(self) -> float:
        """Build oneDNN's primitives for every bf16 host GEMM a prompt step can run (each linear weight shape and
        the grouped experts, at each of shared.device.host_gemm_sizes()) before the engine serves, so no prompt
        length pays for them later. Returns the seconds it took; 0 off the host."""
        if not on_host(self.model.embed_tokens.weight):
            return 0.0
        start = time.perf_counter()
        seen: set[tuple] = set()
        for module in self.modules():
            warm = getattr(module, "warm_host_gemms", None)
            weight = getattr(module, "weight", getattr(module, "gate_up_proj", None))
            key = (type(module), None if weight is None else (tuple(weight.shape), weight.dtype))
            if warm is not None and module is not self and key not in seen:
                seen.add(key)
                warm()
        return time.perf_counter() - start

    def context_bound(self, context: int, capacity: int) -> int:
        """The `max_context` a step whose longest context is `context` may be given in place of its own, up to
        `capacity`, and still take every branch its own would (a recorded decode step's, shared.engine.graphs):
        with an indexer, index_topk while the context fits it (dense attention), else the capacity."""
        cfg = self.config
        if cfg.has_indexer and context <= cfg.index_topk:
            return min(cfg.index_topk, capacity)
        return capacity

    @torch.inference_mode()
    def expand_from(self) -> int:
        """The fewest queries a request needs in a step to take the expanded prompt form (per request: steps
        split their parts there, see ForwardBatch.build)."""
        cfg = self.config
        return attention.expand_from(HeadDims(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                              cfg.v_head_dim, cfg.kv_lora_rank))

    def forward(self, fb: ForwardBatch, kv: KVCache, layer_done: Callable[[int], None] | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run one step; writes every layer's KV for the new tokens; returns fp32 logits
        [len(fb.logits_index), vocab]. `layer_done(i)` fires after layer i's KV is in the pool
        (the prefill service pushes that layer to decode while the next one computes). With
        `return_hidden`, also every token's post-final-norm hidden state [N, H] (what MTP drafts from)."""
        h = self.model.embed_tokens(fb.input_ids)
        rope = self.rotary.lookup(fb.positions, self.dtype, fb.max_context)
        sharder, offloader = self.sharder, self.offloader
        offloaded = offloader.offloaded if offloader is not None else frozenset()
        if offloader is not None:
            offloader.begin()  # the first offloaded layer's copy (usually issued at the end of the last step)
        for layer in self.model.layers:
            i = layer.layer_idx
            if sharder is not None:
                sharder.acquire(i)  # waits for layer i's weights (broadcast issued one layer earlier)
                sharder.prefetch(i + 1)  # layer i+1's broadcast flies while layer i computes
                sharder.events.append(("compute_start", i))
            if i in offloaded:
                offloader.acquire(i)  # waits for layer i's copy, issues the next offloaded layer's
                offloader.events.append(("compute_start", i))
            h = layer(h, rope, fb, kv)
            if sharder is not None:
                sharder.events.append(("compute_end", i))
                sharder.release(i)
            if i in offloaded:
                offloader.events.append(("compute_end", i))
                offloader.release(i)
            if layer_done is not None:
                layer_done(i)
        # DeepSeek's final norm: fp32 math with the fp32 weight, rounded to the model dtype, then the fp32 head.
        if return_hidden:
            normed = self.model.norm.fp32(h).to(self.dtype)
            return self.lm_head(normed[fb.logits_index].float(), fb.logits_generated), normed
        h = self.model.norm.fp32(h[fb.logits_index]).to(self.dtype).float()
        return self.lm_head(h, fb.logits_generated)

    @torch.inference_mode()
    def forward_mtp(self, fb: ForwardBatch, kv: KVCache, hidden_prev: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step: fb's tokens are t_{j+1} at positions j, `hidden_prev` [N, H] the states h_j (or the
        previous draft's g_j); writes the MTP layer's KV; returns (fp32 logits at fb.logits_index — each
        predicts t_{j+2} — and every token's g_j [N, H])."""
        rope = self.rotary.lookup(fb.positions, self.dtype, fb.max_context)
        g = self.mtp(self.model.embed_tokens(fb.input_ids), hidden_prev, rope, fb, kv, self.dtype)
        return self.lm_head(g[fb.logits_index].float(), fb.logits_generated), g
