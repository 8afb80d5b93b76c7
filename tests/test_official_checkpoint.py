"""The release as DeepSeek publishes it: FP8 block scales, MTP layer, shards, legacy rope_scaling, config
defaults — loaded through `load_model` / `LLM(path)` and checked against transformers and by hand."""

from __future__ import annotations

import json

import pytest
import torch

from shared.config import ModelConfig
from shared.engine import LLM, SamplingParams
from shared.loader import load_model
from shared.quant.fp8 import dequant_block_fp8
from tests.helpers import assert_close_logits, engine_logits, load_reference, random_prompts, reference_logits
from tests.official_layout import CONFIG, build_official_checkpoint, dequantize_by_hand, read_all, rewrite


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return build_official_checkpoint(tmp_path_factory.mktemp("official") / "DeepSeek-V3.2-tiny")


def _hf_dequantized(official, out):
    """The same model as plain fp32 tensors (dequantized by hand, MTP layer dropped) for transformers."""
    tensors = read_all(official)
    n = CONFIG["num_hidden_layers"]
    plain = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv") or name.startswith(f"model.layers.{n}."):
            continue
        scale = tensors.get(name + "_scale_inv")
        plain[name] = dequantize_by_hand(t, scale) if scale is not None else t.float()
    cfg = {k: v for k, v in CONFIG.items() if k != "quantization_config"} | {"torch_dtype": "float32"}
    return rewrite(official, out, plain, cfg)


def test_official_layout_matches_transformers(official, tmp_path):
    """FP8 release layout → our loader → logits at every position == transformers on the weights
    dequantized by hand (sparse: 48 tokens > index_topk 16; YaRN factor 40)."""
    ours, report = load_model(official, "float32", indexer_numerics="transformers")
    assert report.skipped_mtp > 0 and not report.mtp_tensors
    ref = load_reference(_hf_dequantized(official, tmp_path / "hf"))
    for ids in random_prompts(2, [48, 30], CONFIG["vocab_size"], seed=7):
        assert_close_logits(engine_logits(ours, ids), reference_logits(ref, ids), atol=2e-4)


def test_fp8_parameters_equal_transformers_dequant(official):
    """Every FP8 tensor as loaded == transformers' fine-grained FP8 dequantization of it."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    model, _ = load_model(official, "float32")
    params = model.checkpoint_tensors()
    tensors = read_all(official)
    checked = 0
    for name, t in tensors.items():
        if t.dtype != torch.float8_e4m3fn or name.startswith(f"model.layers.{CONFIG['num_hidden_layers']}."):
            continue
        want = _dequantize_fp8_weight(t, tensors[name + "_scale_inv"], [128, 128], torch.float32)
        if ".mlp.experts." in name:  # stacked per layer: experts.gate_up_proj [E, 2I, D], down_proj [E, D, I]
            prefix, e, proj, _ = name.rsplit(".", 3)
            e = int(e)
            inter = CONFIG["moe_intermediate_size"]
            got = (params[f"{prefix}.down_proj"][e] if proj == "down_proj" else
                   params[f"{prefix}.gate_up_proj"][e, :inter] if proj == "gate_proj" else
                   params[f"{prefix}.gate_up_proj"][e, inter:])
        else:
            got = params[name]
        assert torch.equal(got, want), name
        checked += 1
    assert checked > 40
    # bf16 weights_proj / gate / embeddings keep their values; fp32 norms, k_norm bias and router bias exact
    layer = model.model.layers[1]
    assert torch.equal(layer.self_attn.indexer.weights_proj.weight,
                       tensors["model.layers.1.self_attn.indexer.weights_proj.weight"].float())
    assert torch.equal(layer.self_attn.indexer.k_norm.bias, tensors["model.layers.1.self_attn.indexer.k_norm.bias"])
    assert torch.equal(layer.mlp.gate.e_score_correction_bias,
                       tensors["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_block_dequant_by_hand():
    """A 3×5 FP8 weight in 2×2 blocks (ragged on both edges), worked out element by element."""
    values = torch.tensor([[1.0, -2.0, 0.5, 4.0, -1.5], [3.0, 0.25, -0.75, 2.0, 1.0], [-4.0, 1.5, 6.0, -0.5, 0.125]])
    q = values.to(torch.float8_e4m3fn)  # all exactly representable
    scale = torch.tensor([[0.5, 2.0, 4.0], [0.25, 8.0, 1.0]])
    want = [[1.0 * 0.5, -2.0 * 0.5, 0.5 * 2, 4.0 * 2, -1.5 * 4],
            [3.0 * 0.5, 0.25 * 0.5, -0.75 * 2, 2.0 * 2, 1.0 * 4],
            [-4.0 * 0.25, 1.5 * 0.25, 6.0 * 8, -0.5 * 8, 0.125 * 1]]
    assert dequant_block_fp8(q, scale, (2, 2)).tolist() == want
    e8m0 = scale.to(torch.float8_e8m0fnu)  # powers of two: exact as e8m0 exponents
    assert dequant_block_fp8(q, e8m0, (2, 2)).tolist() == want
    raw = torch.log2(scale).to(torch.int32).add(127).to(torch.uint8)  # raw exponent bytes
    assert dequant_block_fp8(q, raw, (2, 2), scale_fmt="ue8m0").tolist() == want
    with pytest.raises(ValueError, match="does not match"):
        dequant_block_fp8(q, scale[:1], (2, 2))


@pytest.mark.parametrize("kind", ["float8_e8m0fnu", "uint8"])
def test_e8m0_weight_scales(official, tmp_path, kind):
    """Scales stored as e8m0 exponents (dtype float8_e8m0fnu, or raw uint8 bytes under scale_fmt ue8m0)
    load to the same parameters as the fp32 power-of-two scales."""
    tensors = read_all(official)
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        s = tensors[name]
        tensors[name] = (s.to(torch.float8_e8m0fnu) if kind == "float8_e8m0fnu"
                         else torch.log2(s).to(torch.int32).add(127).to(torch.uint8))
    other = rewrite(official, tmp_path / kind, tensors)
    a, _ = load_model(official, "float32")
    b, _ = load_model(other, "float32")
    for (name, pa), (_, pb) in zip(a.checkpoint_tensors().items(), b.checkpoint_tensors().items()):
        assert torch.equal(pa, pb), name


def test_weight_block_size_read_from_config(official, tmp_path):
    """A checkpoint quantized in 64×64 blocks loads with 64×64 (the block size is not hard-coded)."""
    tensors = read_all(official)
    name = "model.layers.0.self_attn.o_proj.weight"
    w = dequantize_by_hand(tensors[name], tensors[name + "_scale_inv"])
    rows, cols = w.shape
    scale = w.abs().reshape(rows // 64, 64, cols // 64, 64).amax(dim=(1, 3)).div(448).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / scale.repeat_interleave(64, 0).repeat_interleave(64, 1)).to(torch.float8_e4m3fn)
    quant = {**CONFIG["quantization_config"], "weight_block_size": [64, 64]}
    only = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv") and v.dtype != torch.float8_e4m3fn}
    for k, v in tensors.items():  # re-block every FP8 tensor at 64×64 from its dequantized values
        if v.dtype == torch.float8_e4m3fn:
            deq = dequantize_by_hand(v, tensors[k + "_scale_inv"])
            r, c = deq.shape
            pad = torch.zeros(-(-r // 64) * 64, -(-c // 64) * 64)
            pad[:r, :c] = deq
            s = pad.abs().reshape(pad.shape[0] // 64, 64, pad.shape[1] // 64, 64).amax(dim=(1, 3)).div(448)
            s = torch.exp2(torch.ceil(torch.log2(s.clamp(min=1e-12))))
            only[k] = (deq / s.repeat_interleave(64, 0).repeat_interleave(64, 1)[:r, :c]).to(torch.float8_e4m3fn)
            only[k + "_scale_inv"] = s
    assert torch.equal(only[name], q)
    path = rewrite(official, tmp_path / "b64", only, {**CONFIG, "quantization_config": quant})
    model, _ = load_model(path, "float32")
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight,
                       q.float() * scale.repeat_interleave(64, 0).repeat_interleave(64, 1))


def test_fused_fp8_experts_sliced_under_expert_parallelism(official, tmp_path):
    """transformers-5 fused experts (gate_up_proj [E, 2I, D]) in FP8 with 3-D block scales: dequantized
    per expert, and under EP rank 1 of 2 both weights and scales are sliced to experts 4..7."""
    from shared.parallel import ParallelConfig, ParallelState

    tensors = read_all(official)
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in (1, 2):  # the MoE layer and the MTP layer
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(CONFIG["n_routed_experts"])
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                             tensors[f"{p}.{e}.up_proj.weight"]]) for e in experts])
        fused[f"{p}.gate_up_proj_scale_inv"] = torch.stack([torch.cat([
            tensors[f"{p}.{e}.gate_proj.weight_scale_inv"], tensors[f"{p}.{e}.up_proj.weight_scale_inv"]])
            for e in experts])
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in experts])
        fused[f"{p}.down_proj_scale_inv"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight_scale_inv"]
                                                         for e in experts])
    path = rewrite(official, tmp_path / "fused", fused)
    per_expert, _ = load_model(official, "float32")
    whole, _ = load_model(path, "float32")
    want = per_expert.model.layers[1].mlp.experts
    assert torch.equal(whole.model.layers[1].mlp.experts.gate_up_proj, want.gate_up_proj)
    assert torch.equal(whole.model.layers[1].mlp.experts.down_proj, want.down_proj)
    rank1 = ParallelState(ParallelConfig(world=2, dp=2, ep=2), rank=1)  # placement only: no collectives run
    part, _ = load_model(path, "float32", parallel=rank1)
    got = part.model.layers[1].mlp.experts
    assert torch.equal(got.gate_up_proj, want.gate_up_proj[4:8]) and torch.equal(got.down_proj, want.down_proj[4:8])


def test_mtp_layer_skipped_by_default_or_kept_as_stored(official):
    n = CONFIG["num_hidden_layers"]
    _, skipped = load_model(official, "float32")
    assert skipped.skipped_mtp > 30 and not skipped.mtp_tensors
    _, kept = load_model(official, "float32", include_mtp=True)
    mtp = kept.mtp_tensors
    assert mtp[f"model.layers.{n}.eh_proj.weight"].dtype == torch.bfloat16
    assert mtp[f"model.layers.{n}.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn  # not expanded
    assert mtp[f"model.layers.{n}.self_attn.q_b_proj.weight_scale_inv"].dtype == torch.float32
    assert f"model.layers.{n}.mlp.experts.7.down_proj.weight" in mtp
    assert {f"model.layers.{n}.{k}.weight" for k in ("enorm", "hnorm", "shared_head.norm", "shared_head.head",
                                                      "embed_tokens")} <= set(mtp)


def test_llm_defaults_on_the_release_layout(official):
    """What a user gets from `LLM(path)`: bf16 (the release's dtype), DeepSeek's indexer numerics,
    fp32 head, the checkpoint's tokenizer; text, token and chat prompts generate."""
    llm = LLM(str(official))
    model = llm.engine.model
    assert model.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.indexer.numerics == "deepseek"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = random_prompts(1, [60], CONFIG["vocab_size"], seed=9)[0]  # > index_topk: sparse selection
    out = llm.generate([prompt], params)[0]
    assert len(out.token_ids) == 6 and all(0 <= t < CONFIG["vocab_size"] for t in out.token_ids)
    text = llm.generate("Hello world", params)[0]
    assert text.prompt_token_ids[0] == 0 and text.prompt_token_ids.count(0) == 1  # one BOS
    chat = llm.chat([{"role": "user", "content": "Hello"}], params)
    assert chat.prompt_token_ids[0] == 0 and chat.prompt_token_ids.count(0) == 1  # the encoding's BOS only
    assert len(chat.token_ids) == 6


def test_config_defaults_match_transformers():
    """A config.json that leaves fields out reads them as transformers' DeepseekV3/V32 configs do."""
    from transformers import DeepseekV3Config, DeepseekV32Config

    fields = ["n_group", "topk_group", "routed_scaling_factor", "index_topk", "index_head_dim", "index_n_heads",
              "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
              "max_position_embeddings", "rms_norm_eps", "q_lora_rank", "kv_lora_rank", "norm_topk_prob"]
    sparse = {"model_type": "deepseek_v32", "num_hidden_layers": 4, "hidden_size": 256}
    ours, theirs = ModelConfig.from_dict(sparse), DeepseekV32Config(num_hidden_layers=4, hidden_size=256)
    for f in fields:
        assert getattr(ours, f) == getattr(theirs, f), f
    assert ours.mlp_layer_types == tuple(theirs.mlp_layer_types)  # first_k_dense_replace 3
    v3 = {"model_type": "deepseek_v3", "num_hidden_layers": 5}
    ours, theirs = ModelConfig.from_dict(v3), DeepseekV3Config(num_hidden_layers=5)
    for f in [f for f in fields if not f.startswith("index")]:
        assert getattr(ours, f) == getattr(theirs, f), f


@pytest.mark.parametrize(("change", "message"), [
    ({"index_topk": 0}, "index_topk must be > 0"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not implemented"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not implemented"),
    ({"n_group": 3}, "n_group 3 does not divide"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt='e5m2' is not supported"),
])
def test_unsupported_configs_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**CONFIG, **change}).fp8  # noqa: B018 - fp8 parses quantization_config


def test_unsupported_quantization_fails_at_load(official, tmp_path):
    cfg = {**json.loads((official / "config.json").read_text()), "quantization_config": {"quant_method": "gptq"}}
    path = rewrite(official, tmp_path / "gptq", read_all(official), cfg)
    with pytest.raises(ValueError, match="quant_method='gptq' is not supported"):
        load_model(path)
