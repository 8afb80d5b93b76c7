"""The engine's model against transformers' no-cache forward (fp32, random tiny checkpoints)."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.kvcache import KVCache, KVLayout
from shared.loader import load_model
from shared.model import ForwardBatch, SeqChunk
from tests.helpers import (
    assert_close_logits,
    engine_logits,
    load_reference,
    random_prompts,
    reference_greedy,
    reference_logits,
)

CASES = ["v32_dense", "v32_sparse", "v32_yarn", "v3"]


@pytest.mark.parametrize("name", CASES)
def test_logits_every_position(ckpt, name):
    path = ckpt(name)
    model, _ = load_model(path, "float32", indexer_numerics="transformers")
    ref = load_reference(path)
    length = 48  # > index_topk of the sparse cases, > original_max_position_embeddings (32) for YaRN
    for ids in random_prompts(2, [length, 33], model.config.vocab_size, seed=1):
        assert_close_logits(engine_logits(model, ids), reference_logits(ref, ids))


def test_yarn_is_active(ckpt):
    model, _ = load_model(ckpt("v32_yarn"), "float32", indexer_numerics="transformers")
    assert model.config.rope.rope_type == "yarn" and model.config.rope.factor > 1
    plain = 1 / 10000 ** (torch.arange(0, 16, 2) / 16)
    assert not torch.allclose(model.rotary.inv_freq, plain)
    assert model.config.softmax_scale > model.config.qk_head_dim**-0.5  # mscale² folded in


@pytest.mark.parametrize("name", ["v32_sparse", "v3"])
def test_incremental_decode_matches_reference_positions(ckpt, name):
    path = ckpt(name)
    model, _ = load_model(path, "float32", indexer_numerics="transformers")
    ref = load_reference(path)
    ids = random_prompts(1, [40], model.config.vocab_size, seed=2)[0]
    full = reference_logits(ref, ids)
    bs = 4
    kv = KVCache(KVLayout.from_model_config(model.config, bs, torch.float32), 16, torch.device("cpu"))
    table = kv.allocator.allocate(kv.blocks_needed(len(ids)))
    prefill = 6  # below index_topk: the decode steps cross from dense into sparse selection
    fb = ForwardBatch.build([SeqChunk(ids[:prefill], 0, table)], bs, torch.device("cpu"))
    assert_close_logits(model(fb, kv), full[prefill - 1 : prefill])
    for t in range(prefill, len(ids)):
        fb = ForwardBatch.build([SeqChunk([ids[t]], t, table)], bs, torch.device("cpu"))
        assert fb.is_decode
        assert_close_logits(model(fb, kv), full[t : t + 1])


@pytest.mark.parametrize("name", ["v32_sparse", "v3"])
def test_greedy_continuation_matches_reference(ckpt, name):
    path = ckpt(name)
    llm = LLM(str(path), block_size=4, indexer_numerics="transformers")
    ref = load_reference(path)
    prompts = random_prompts(8, [3, 7, 12, 20, 5, 9, 15, 30], llm.engine.model_config.vocab_size, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(ref, prompt, 20)
        assert out.finish_reason == "length"


def test_hidden_states_per_layer(ckpt):
    path = ckpt("v32_sparse")
    model, _ = load_model(path, "float32", indexer_numerics="transformers")
    ref = load_reference(path)
    ids = random_prompts(1, [40], model.config.vocab_size, seed=4)[0]
    ours, theirs = [], []
    hooks = [layer.register_forward_hook(lambda m, a, out: ours.append(out)) for layer in model.model.layers]
    hooks += [layer.register_forward_hook(lambda m, a, out: theirs.append(out[0] if isinstance(out, tuple) else out))
              for layer in ref.model.layers]
    engine_logits(model, ids)
    reference_logits(ref, ids)
    for h in hooks:
        h.remove()
    assert len(ours) == len(theirs) == model.config.num_hidden_layers
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        cos = torch.nn.functional.cosine_similarity(a, b.reshape(a.shape), dim=-1).min().item()
        assert cos >= 0.999, f"layer {layer}: cosine {cos}"


def test_tiny_generator_is_hf_layout(tmp_path):
    """Checkpoints from `python -m shared.loader.tiny` load in transformers and agree with us."""
    from shared.loader.tiny import write_checkpoint

    path = write_checkpoint(tmp_path / "tiny", "deepseek_v32", num_hidden_layers=2, index_topk=8, shards=2)
    model, _ = load_model(path, "float32", indexer_numerics="transformers")
    ref = load_reference(path)
    ids = random_prompts(1, [24], model.config.vocab_size, seed=5)[0]
    assert_close_logits(engine_logits(model, ids), reference_logits(ref, ids))
    assert (path / "tokenizer.json").exists() and (path / "model.safetensors.index.json").exists()
