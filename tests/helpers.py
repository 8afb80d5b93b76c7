"""Shared test helpers: tiny HF checkpoints made with transformers' save_pretrained, reference runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.kvcache import KVCache, KVLayout
from shared.model import DeepseekForCausalLM, ForwardBatch, SeqChunk


def _mooncake_param():
    """The Mooncake transport case. `make test` installs Mooncake, so under CI a missing install
    fails the suite; only an ad-hoc run without it skips these cases."""
    from shared.transfer.mooncake import mooncake_available

    missing = not mooncake_available() and not os.environ.get("CI")
    reason = "Mooncake not installed (make installs it)"
    return pytest.param("mooncake", marks=pytest.mark.skipif(missing, reason=reason))


TRANSPORTS = ["tcp", _mooncake_param()]

BASE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=64,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
)
V32 = dict(index_head_dim=32, index_n_heads=16)


def make_hf_checkpoint(out: Path, model_type: str = "deepseek_v32", seed: int = 0, **overrides: Any) -> Path:
    """Random tiny model written by transformers' save_pretrained, with a random router bias."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    if model_type == "deepseek_v32":
        cfg = DeepseekV32Config(**{**BASE, **V32, **overrides})
        model = DeepseekV32ForCausalLM(cfg)
    else:
        cfg = DeepseekV3Config(**{**BASE, **overrides})
        model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.01)
    model.save_pretrained(out)
    return out


def prefill_paths(metrics_url: str) -> dict[str, float]:
    """The router's pdserve_router_prefill_path_total by path (local / disaggregated), from its /metrics."""
    import re
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {p: float(v) for p, v in re.findall(r'pdserve_router_prefill_path_total\{path="(\w+)"\} (\S+)', text)}


def child_processes(pid: int) -> list[int]:
    """The processes `pid` started to work for it (a service front's engine core and follower ranks, forked or
    spawned), not multiprocessing's resource tracker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            helper = b"resource_tracker" in (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and not helper:
            found.append(int(stat.parent.name))
    return found


def wait_for(predicate, timeout: float = 15.0) -> bool:
    """Poll `predicate` until it holds or `timeout` passes (a bounded wait that fails on a hang)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def load_reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    """transformers full-sequence forward without cache: the definition of correct."""
    return ref(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(reference_logits(ref, seq)[-1].argmax()))
    return seq[len(ids):]


def engine_logits(model: DeepseekForCausalLM, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Our logits at every position of a one-shot prefill."""
    layout = KVLayout.from_model_config(model.config, block_size, model.dtype)
    kv = KVCache(layout, num_blocks=len(ids) // block_size + 2, device=torch.device("cpu"))
    table = kv.allocator.allocate(kv.blocks_needed(len(ids)))
    fb = ForwardBatch.build([SeqChunk(ids, 0, table)], block_size, torch.device("cpu"))
    fb.logits_index = torch.arange(len(ids))
    return model(fb, kv)


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, cos_min: float = 0.99999, atol: float = 1e-4) -> None:
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    err = (ours - ref).abs().max().item()
    assert cos.min().item() >= cos_min, f"min cosine {cos.min().item():.8f} < {cos_min}"
    assert err <= atol, f"max abs error {err:.3e} > {atol}"


def concurrent_greedy(address: str, prompts: list[list[int]], max_tokens: int, timeout: float = 180) -> list:
    """Send every prompt to the router at once (one thread each); the streamed greedy tokens per
    prompt, in order (None for a stream that did not finish)."""
    from shared.rpc.pdserve.v1 import generation_pb2

    sp = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = concurrent_generate(address, [generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=sp)
                                         for p in prompts], timeout)
    return [o.token_ids if o is not None else None for o in outs]


@dataclass
class Completion:
    """One served request's whole answer, as the client saw it."""

    token_ids: list[int]
    text: str
    finish_reason: str
    cached_prompt_tokens: int = field(default=0, compare=False)  # usage: prompt tokens from the prefix cache


def concurrent_generate(address: str, requests: list, timeout: float = 180) -> list[Completion | None]:
    """Send every GenerateRequest to the router at once (one thread each); each stream's tokens, text and
    finish reason (None for a stream that failed or did not finish)."""
    import threading

    import grpc

    from shared.rpc.pdserve.v1 import generation_pb2_grpc

    got: dict[int, Completion] = {}
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        def run(i: int) -> None:
            out = Completion([], "", "")
            for m in stub.Generate(requests[i], timeout=timeout):
                out.token_ids += m.token_ids
                out.text += m.text
                out.finish_reason = m.finish_reason or out.finish_reason
                out.cached_prompt_tokens = m.usage.cached_prompt_tokens or out.cached_prompt_tokens
            got[i] = out

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    return [got.get(i) for i in range(len(requests))]


def served_after_push_out(up, target: list[int], stride: int) -> tuple[str, str, int]:
    """Through `pdserve up`'s HTTP API (the openai SDK) with 512-token device pools: complete `target` (nothing
    cached), push it out of the pools with three 400-token prompts (waits let each tier's writer copy off the
    engine thread), complete it again: (first text, second text, the second's cached prompt tokens)."""
    import time

    import openai

    client = openai.OpenAI(base_url=up.http_url, api_key="none", max_retries=0)

    def complete(prompt: list[int]) -> tuple[str, int]:
        out = client.completions.create(model=up.model, prompt=prompt, max_tokens=4, temperature=0)
        details = out.usage.prompt_tokens_details
        return out.choices[0].text, details.cached_tokens if details else 0

    text, cached = complete(target)
    assert cached == 0
    for seed in range(3):
        time.sleep(0.5)
        complete([(7 * seed + stride * i) % 1000 + 3 for i in range(400)])
    time.sleep(0.5)
    again, cached = complete(target)
    return text, again, cached


def host_tier_hits(up) -> tuple[float, float]:
    """Prompt tokens served from the second tier so far, by the prefill and the decode front (their /metrics)."""
    (prefill,) = [name for name in up.metrics if name.startswith("prefill")]
    (decode,) = [name for name in up.metrics if name.startswith("decode")]
    return (up.metric(prefill, 'pdserve_prefix_cache_hit_tokens_total{service="prefill",tier="host"}'),
            up.metric(decode, 'pdserve_prefix_cache_hit_tokens_total{service="decode",tier="host"}'))
