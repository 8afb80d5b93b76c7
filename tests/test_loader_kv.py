"""Loader (FP8 blocks, shards, MTP skip), KV layout, config parsing, DeepSeek indexer numerics."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.config import ModelConfig
from shared.kvcache import KVLayout
from shared.loader import load_model
from shared.loader.checkpoint import checkpoint_files
from shared.loader.synthetic import REAL_671B
from shared.loader.tiny import write_checkpoint
from shared.quant.fp8 import act_quant_ue8m0, dequant_block_fp8, fake_quant_ue8m0, hadamard_transform
from tests.helpers import assert_close_logits, engine_logits, random_prompts


def test_real_config_parses_and_kv_bytes():
    cfg = ModelConfig.from_dict(REAL_671B)
    assert cfg.softmax_scale == pytest.approx(0.1352337789, rel=1e-8)
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    for dtype, nbytes in ((torch.bfloat16, 2), (torch.float32, 4)):
        layout = KVLayout.from_model_config(cfg, 64, dtype)
        assert layout.bytes_per_token_per_layer() == (512 + 64) * nbytes + 128 * nbytes
        assert layout.bytes_per_token() == 61 * layout.bytes_per_token_per_layer()
    v3 = ModelConfig.from_dict({**REAL_671B, "model_type": "deepseek_v3"})
    assert KVLayout.from_model_config(v3, 64, torch.bfloat16).bytes_per_token_per_layer() == 576 * 2


def test_real_yarn_table():
    from shared.model.rope import inv_frequencies

    cfg = ModelConfig.from_dict(REAL_671B)
    inv, scale = inv_frequencies(cfg.rope, 64)
    base = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    assert scale == 1.0  # mscale == mscale_all_dim: cos/sin unscaled
    # dims below low=10 keep their frequency (extrapolate); from high=23 on they are divided by 40
    assert torch.allclose(inv[:11], base[:11]) and torch.allclose(inv[23:], base[23:] / 40)
    assert (inv[11:23] < base[11:23]).all() and (inv[11:23] > base[11:23] / 40).all()


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    # hidden 192 and kv 96+32: ragged 128-blocks everywhere; two shards split weights from their scales
    path = write_checkpoint(tmp_path / "fp8", "deepseek_v32", fp8=True, shards=3, tokenizer=False,
                            hidden_size=192, kv_lora_rank=96, qk_rope_head_dim=32, num_hidden_layers=2,
                            intermediate_size=320, moe_intermediate_size=96, q_lora_rank=160, vocab_size=300)
    model, report = load_model(path, "float32")
    params = model.checkpoint_tensors()
    checked = 0
    for fname, names in checkpoint_files(path).items():
        with safe_open(path / fname, "pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if t.dtype != torch.float8_e4m3fn:
                    continue
                scale_file = next(fn for fn, ns in checkpoint_files(path).items() if name + "_scale_inv" in ns)
                with safe_open(path / scale_file, "pt") as g:
                    expected = dequant_block_fp8(t, g.get_tensor(name + "_scale_inv"))
                if ".experts." in name:
                    prefix, e, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
                    inter = model.config.moe_intermediate_size
                    stacked = params[f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"][e]
                    if proj == "down_proj":
                        got = stacked
                    else:
                        got = stacked[:inter] if proj == "gate_proj" else stacked[inter:]
                else:
                    got = params[name]
                assert torch.equal(got, expected), name
                checked += 1
    assert checked > 20 and report.loaded > 0
    kv_a = params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape == (128, 192)  # 96 + 32 rows: a ragged block on both axes


def test_fp8_dequant_ragged_block():
    w = torch.randn(576, 200)
    from shared.quant.fp8 import quant_block_fp8

    q, s = quant_block_fp8(w)
    assert s.shape == (5, 2)
    assert torch.allclose(dequant_block_fp8(q, s), w, rtol=0.07, atol=1e-3)


def test_mtp_layers_skipped_unless_asked(tmp_path):
    path = write_checkpoint(tmp_path / "mtp", "deepseek_v3", num_hidden_layers=2, tokenizer=False)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(256, 512)
    tensors["model.layers.2.enorm.weight"] = torch.ones(256)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    _, report = load_model(path, "float32")
    assert report.skipped_mtp == 2 and not report.mtp_tensors
    _, report = load_model(path, "float32", include_mtp=True)
    assert set(report.mtp_tensors) == {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"}


def test_missing_tensor_is_an_error(tmp_path):
    path = write_checkpoint(tmp_path / "bad", "deepseek_v3", num_hidden_layers=1, tokenizer=False)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "o_proj" not in k}
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(KeyError, match="missing"):
        load_model(path, "float32")


def test_bf16_load(ckpt):
    model, _ = load_model(ckpt("v32_sparse"), "bfloat16")
    assert model.lm_head.weight.dtype == torch.float32  # DeepSeek: fp32 head
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    ref, _ = load_model(ckpt("v32_sparse"), "float32")
    ids = random_prompts(1, [6], 512, seed=20)[0]  # short: dense selection, so only bf16 rounding differs
    cos = torch.nn.functional.cosine_similarity(engine_logits(model, ids), engine_logits(ref, ids), dim=-1)
    assert cos.min() > 0.99


def test_hadamard_and_ue8m0():
    x = torch.randn(5, 128)
    hx = hadamard_transform(x)
    assert torch.allclose(hx @ hadamard_transform(x).T, x @ x.T, atol=1e-4)  # orthonormal: dots preserved
    q, s = act_quant_ue8m0(x * 3)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # power-of-two scales
    assert (q.float().abs() <= 448).all()
    deq = fake_quant_ue8m0(x)
    assert torch.allclose(deq, x, rtol=0.07, atol=1e-3)
    assert torch.equal(fake_quant_ue8m0(deq), deq)  # idempotent values


def test_deepseek_indexer_numerics_close_to_transformers(ckpt):
    path = ckpt("v32_sparse")
    default, _ = load_model(path, "float32", indexer_numerics="transformers")
    official, _ = load_model(path, "float32")  # the default: DeepSeek's own
    ids = random_prompts(1, [40], 512, seed=21)[0]
    a, b = engine_logits(default, ids), engine_logits(official, ids)
    assert not torch.equal(a, b)  # the FP8 path is really taken
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() > 0.9
    assert_close_logits(a[:8], b[:8])  # while context <= index_topk selection is all keys either way


def test_fused_expert_layout_loads(tmp_path):
    """transformers 5 can store experts fused (experts.gate_up_proj [E, 2I, D], gate first)."""
    path = write_checkpoint(tmp_path / "perexpert", "deepseek_v32", num_hidden_layers=2, tokenizer=False)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fused, n_experts = {}, 8
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = t
    for layer in (1,):
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"],
                                                                  tensors[f"{prefix}.{e}.up_proj.weight"]])
                                                       for e in range(n_experts)])
        downs = [tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(n_experts)]
        fused[f"{prefix}.down_proj"] = torch.stack(downs)
    other = tmp_path / "fused"
    other.mkdir()
    (other / "config.json").write_text((path / "config.json").read_text())
    save_file(fused, str(other / "model.safetensors"))
    a, _ = load_model(path, "float32")
    b, _ = load_model(other, "float32")
    ids = random_prompts(1, [20], 1000, seed=22)[0]
    assert torch.equal(engine_logits(a, ids), engine_logits(b, ids))


def test_expert_parallel_loading_reads_only_local_experts(tmp_path):
    from shared.parallel import ParallelConfig, ParallelState

    path = write_checkpoint(tmp_path / "ep", "deepseek_v32", num_hidden_layers=2, tokenizer=False)
    full, full_report = load_model(path, "float32")
    rank1 = ParallelState(ParallelConfig(world=2, dp=2, ep=2), rank=1)  # placement only: no collectives run
    part, report = load_model(path, "float32", parallel=rank1)
    experts = part.model.layers[1].mlp.experts
    assert (experts.first_expert, experts.num_local) == (4, 4)
    assert torch.equal(experts.gate_up_proj, full.model.layers[1].mlp.experts.gate_up_proj[4:8])
    assert torch.equal(experts.down_proj, full.model.layers[1].mlp.experts.down_proj[4:8])
    assert full_report.loaded - report.loaded == 4 * 3  # experts 0-3 (gate, up, down) were never read
