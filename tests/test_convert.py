"""`pdserve convert --format w8a8`: converted tensors, EP-sliced files, bounded memory, end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.loader import checkpoint
from shared.loader.checkpoint import checkpoint_files, iter_tensors, load_model
from shared.loader.convert import INDEX, convert_checkpoint
from shared.loader.tiny import make_config, write_checkpoint
from shared.quant.fp8 import dequant_block_fp8
from shared.quant.int8 import QUANT_METHOD, SCALE_SUFFIX, dequantize_weight, is_w8a8_target, quantize_weight
from tests.helpers import engine_logits, random_prompts

ROOT = Path(__file__).resolve().parents[1]
N_LAYERS = 2  # the tiny FP8 checkpoint has one more layer, index 2: the MTP layer, copied as stored
MIB = 1 << 20
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


def is_mtp(name: str) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= N_LAYERS


def read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read with the real safetensors reader (so the streamed files parse)."""
    out: dict[str, torch.Tensor] = {}
    for fname, names in checkpoint_files(path).items():
        with safe_open(path / fname, "pt") as f:
            assert set(f.keys()) == set(names), f"{fname}: index and file disagree"
            out.update({n: f.get_tensor(n) for n in names})
    return out


def with_mtp_layer(path: Path) -> Path:
    """Declare the last of the generated layers the MTP layer, as DeepSeek's release does."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=N_LAYERS, mlp_layer_types=cfg["mlp_layer_types"][:N_LAYERS],
               num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory) -> Path:
    """Tiny FP8 checkpoint in the release layout (e4m3 + weight_scale_inv, two shards, MTP layer 2)."""
    path = write_checkpoint(tmp_path_factory.mktemp("fp8") / "src", "deepseek_v32", fp8=True, shards=2,
                            num_hidden_layers=N_LAYERS + 1)
    return with_mtp_layer(path)


@pytest.fixture(scope="module")
def w8a8(fp8_src, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("w8a8") / "out"
    summary = convert_checkpoint(fp8_src, dst, max_shard_gb=1 / 1024)  # 1 MiB shards: several of them
    print(summary)
    assert summary.tensors == len(json.loads((dst / INDEX).read_text())["weight_map"])
    assert len(summary.files) > 2 and all((dst / f).exists() for f in summary.files)
    return dst


@pytest.fixture(scope="module")
def w8a8_ep2(fp8_src, tmp_path_factory) -> Path:
    from router.cli import main

    dst = tmp_path_factory.mktemp("w8a8ep") / "out"
    main(["convert", "--src", str(fp8_src), "--dst", str(dst), "--format", "w8a8", "--ep", "2"])
    return dst


def test_w8a8_tensors_match_fp8_source(fp8_src, w8a8):
    src, out = read_all(fp8_src), read_all(w8a8)
    cfg = json.loads((fp8_src / "config.json").read_text())
    expected: set[str] = set()
    n_targets = 0
    for name, t in src.items():
        if is_mtp(name):  # copied as stored, FP8 and scale_inv included
            assert out[name].dtype == t.dtype and torch.equal(out[name].view(torch.uint8), t.view(torch.uint8))
            expected.add(name)
            continue
        if name.endswith("_scale_inv"):
            continue
        scale_inv = src.get(name + "_scale_inv")
        ref = dequant_block_fp8(t, scale_inv) if t.dtype == torch.float8_e4m3fn else t.float()
        if is_w8a8_target(name):
            n_targets += 1
            q, s = out[name], out[name + SCALE_SUFFIX]
            assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == t.shape[:-1], name
            err = (dequantize_weight(q, s) - ref).abs()
            bound = s[..., None] * (0.5 + 1e-4)  # int8 rounding: half a step per channel
            assert (err <= bound).all(), f"{name}: max error {err.max():.3e} over the int8 bound"
            want_q, want_s = quantize_weight(ref)  # chunked conversion = whole-tensor quantization, bit for bit
            assert torch.equal(q, want_q) and torch.equal(s, want_s), name
            expected |= {name, name + SCALE_SUFFIX}
        elif t.dtype == torch.float8_e4m3fn:
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], ref.to(torch.bfloat16)), name
            expected.add(name)
        else:
            assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
            expected.add(name)
    assert n_targets > 20
    assert set(out) == expected
    assert all(is_mtp(n) for n in out if n.endswith("_scale_inv"))
    assert any(is_mtp(n) and n.endswith("_scale_inv") for n in out)
    index = json.loads((w8a8 / INDEX).read_text())
    assert set(index["weight_map"]) == set(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f) for f in index["weight_map"].values())
    new_cfg = json.loads((w8a8 / "config.json").read_text())
    assert new_cfg["quantization_config"] == {"quant_method": QUANT_METHOD, "weight_granularity": "per_channel",
                                              "activation_scheme": "dynamic_per_token", "source": "fp8"}
    assert new_cfg["torch_dtype"] == new_cfg["dtype"] == "bfloat16"
    assert {k: v for k, v in new_cfg.items() if k not in ("quantization_config", "torch_dtype", "dtype")} == \
        {k: v for k, v in cfg.items() if k not in ("quantization_config", "torch_dtype", "dtype")}
    for other in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (w8a8 / other).read_bytes() == (fp8_src / other).read_bytes()
    with pytest.raises(FileExistsError):
        convert_checkpoint(fp8_src, w8a8)


def test_ep_rank_opens_only_shared_shards_and_its_file(w8a8, w8a8_ep2, monkeypatch):
    index = json.loads((w8a8_ep2 / INDEX).read_text())["weight_map"]
    rank0, rank1 = "model-ep000-of-002.safetensors", "model-ep001-of-002.safetensors"
    assert (w8a8_ep2 / rank0).exists() and (w8a8_ep2 / rank1).exists()
    assert json.loads((w8a8_ep2 / "config.json").read_text())["quantization_config"]["ep_size"] == 2
    for name, fname in index.items():  # experts [0, 4) → rank 0, [4, 8) → rank 1, weights and scales alike
        routed = _ROUTED.match(name)
        if routed and not is_mtp(name):
            assert fname == (rank0 if int(routed.group(1)) < 4 else rank1), name
        else:
            assert fname.startswith("model-0000"), name
    assert read_all(w8a8_ep2).keys() == read_all(w8a8).keys()  # same tensors, only placed differently

    opened: list[str] = []
    real_open = checkpoint.safe_open

    def recording(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", recording)

    def rows(name: str) -> slice | None:
        """Rank 1 of 2: its own experts and every non-expert tensor (no MTP)."""
        routed = _ROUTED.match(name)
        if is_mtp(name) or (routed and int(routed.group(1)) < 4):
            return None
        return slice(None)

    got = {name: scale for name, _, scale in iter_tensors(w8a8_ep2, checkpoint_files(w8a8_ep2), rows)}
    print(f"opened: {sorted(set(opened))}")
    assert rank0 not in opened and rank1 in opened
    assert set(got) == {n for n in index if not n.endswith("_scale_inv") and rows(n) is not None}
    assert any(n.endswith(".experts.5.up_proj.weight" + SCALE_SUFFIX) for n in got)
    assert all(got[n] is None for n in got if n.endswith(SCALE_SUFFIX))  # weight scales are plain tensors


def _fused_experts(src: dict[str, torch.Tensor], layer: int, n_experts: int) -> dict[str, torch.Tensor]:
    """The layer's per-expert FP8 tensors (and their block scales) stacked into transformers' fused layout."""
    prefix = f"model.layers.{layer}.mlp.experts"
    out = {n: t for n, t in src.items() if not n.startswith(prefix + ".")}

    def stack(parts: list[list[str]]) -> torch.Tensor:
        """One tensor per expert, each its parts concatenated along rows (FP8 moved as bytes)."""
        fp8 = src[parts[0][0]].dtype == torch.float8_e4m3fn
        t = torch.stack([torch.cat([src[n].view(torch.uint8) if fp8 else src[n] for n in names]) for names in parts])
        return t.view(torch.float8_e4m3fn) if fp8 else t

    for s in ("", "_scale_inv"):  # gate rows first, then up rows (I = 128: whole scale blocks)
        experts = range(n_experts)
        out[f"{prefix}.gate_up_proj{s}"] = stack([[f"{prefix}.{e}.gate_proj.weight{s}",
                                                   f"{prefix}.{e}.up_proj.weight{s}"] for e in experts])
        out[f"{prefix}.down_proj{s}"] = stack([[f"{prefix}.{e}.down_proj.weight{s}"] for e in experts])
    return out


def test_fused_fp8_experts_convert_like_per_expert(fp8_src, w8a8, tmp_path):
    """Fused 3-D FP8 experts [E, 2I, D] (gate rows first): --ep 1 keeps them fused, int8 [E, out, in] +
    scale [E, out]; --ep N splits them into per-expert names; both equal the per-expert conversion."""
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((fp8_src / "config.json").read_text())
    save_file(_fused_experts(read_all(fp8_src), 1, 8), str(fused_dir / "model.safetensors"))
    ref = read_all(w8a8)
    prefix, inter = "model.layers.1.mlp.experts", 128

    convert_checkpoint(fused_dir, tmp_path / "one")
    one = read_all(tmp_path / "one")
    gate_up, gate_up_scale = one[f"{prefix}.gate_up_proj"], one[f"{prefix}.gate_up_proj{SCALE_SUFFIX}"]
    assert gate_up.dtype == torch.int8 and gate_up.shape == (8, 2 * inter, 256) and gate_up_scale.shape == (8, 256)
    for e in range(8):
        for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            assert torch.equal(gate_up[e, rows], ref[f"{prefix}.{e}.{proj}.weight"])
            assert torch.equal(gate_up_scale[e, rows], ref[f"{prefix}.{e}.{proj}.weight{SCALE_SUFFIX}"])
        assert torch.equal(one[f"{prefix}.down_proj"][e], ref[f"{prefix}.{e}.down_proj.weight"])
        assert torch.equal(one[f"{prefix}.down_proj{SCALE_SUFFIX}"][e], ref[f"{prefix}.{e}.down_proj.weight_scale"])

    convert_checkpoint(fused_dir, tmp_path / "ep4", ep=4)
    ep4 = read_all(tmp_path / "ep4")
    assert ep4.keys() == ref.keys()
    assert all(torch.equal(ep4[n], ref[n]) for n in ref)
    weight_map = json.loads((tmp_path / "ep4" / INDEX).read_text())["weight_map"]
    assert weight_map[f"{prefix}.5.up_proj.weight{SCALE_SUFFIX}"] == "model-ep002-of-004.safetensors"


def test_fp32_source_quantizes_and_copies(tmp_path):
    src_dir = write_checkpoint(tmp_path / "fp32", "deepseek_v3", num_hidden_layers=2, tokenizer=False)
    summary = convert_checkpoint(src_dir, tmp_path / "out")
    src, out = read_all(src_dir), read_all(tmp_path / "out")
    assert summary.tensors == len(out)
    for name, t in src.items():
        if is_w8a8_target(name):
            q, s = quantize_weight(t)
            assert torch.equal(out[name], q) and torch.equal(out[name + SCALE_SUFFIX], s), name
        else:
            assert out[name].dtype == torch.float32 and torch.equal(out[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["source"] == "fp32"
    with pytest.raises(ValueError, match="divide"):
        convert_checkpoint(src_dir, tmp_path / "ep3", ep=3)  # 8 experts


# --- peak memory -------------------------------------------------------------------------------------------

HIDDEN, VOCAB, EXPERTS, MOE_LAYERS, DENSE_INTER = 1024, 32768, 16, 6, 4096


def write_large_fp8(path: Path) -> tuple[int, int]:
    """An FP8 checkpoint (release layout: bf16 embeddings/head, e4m3 linears with 128×128 fp32 block
    scales, one shard per layer) of ≈ 435 MiB whose largest tensor is the 64 MiB bf16 embedding.
    Values are random e4m3 (no calibration needed here). Returns (total bytes, largest working bytes)."""
    path.mkdir(parents=True)
    cfg = make_config("deepseek_v32", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=DENSE_INTER,
                      moe_intermediate_size=HIDDEN, num_hidden_layers=MOE_LAYERS + 1, n_routed_experts=EXPERTS)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    pool: dict[tuple[int, int], torch.Tensor] = {}

    def fp8(rows: int, cols: int) -> dict[str, torch.Tensor]:
        """A weight and its scales; the e4m3 values are drawn once per shape and copied (fast to make)."""
        if (rows, cols) not in pool:
            pool[rows, cols] = (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn)
        return {"": pool[rows, cols].clone(),
                "_scale_inv": torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 1e-3}

    shards: list[dict[str, torch.Tensor]] = [{
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(HIDDEN)}]
    for layer in range(MOE_LAYERS + 1):
        p = f"model.layers.{layer}"
        linears = {f"{p}.self_attn.o_proj.weight": (HIDDEN, HIDDEN)}
        if layer == 0:
            linears |= {f"{p}.mlp.gate_proj.weight": (DENSE_INTER, HIDDEN), f"{p}.mlp.up_proj.weight":
                        (DENSE_INTER, HIDDEN), f"{p}.mlp.down_proj.weight": (HIDDEN, DENSE_INTER)}
        else:
            linears |= {f"{p}.mlp.experts.{e}.{proj}.weight": (HIDDEN, HIDDEN)
                        for e in range(EXPERTS) for proj in ("gate_proj", "up_proj", "down_proj")}
        shard = {f"{p}.input_layernorm.weight": torch.ones(HIDDEN)}
        for name, shape in linears.items():
            shard |= {name + k: v for k, v in fp8(*shape).items()}
        shards.append(shard)
    weight_map, total, largest = {}, 0, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in shard}
        for t in shard.values():
            total += t.numel() * t.element_size()
            # the working form: FP8 linears are widened to fp32 (a chunk at a time), the rest copied as stored
            largest = max(largest, t.numel() * (4 if t.dtype == torch.float8_e4m3fn else t.element_size()))
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, largest


CHILD = textwrap.dedent("""
    import json, sys
    from shared.loader.convert import convert_checkpoint

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS: the peak then covers the conversion only
    except OSError:
        pass
    before = status("VmRSS")
    summary = convert_checkpoint(sys.argv[1], sys.argv[2])
    print(json.dumps({"rss_before": before, "hwm": status("VmHWM"), "tensors": summary.tensors,
                      "seconds": summary.seconds}))
""")


def test_peak_memory_stays_near_one_tensor(tmp_path):
    total, largest = write_large_fp8(tmp_path / "src")
    assert total >= 6 * largest
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PDSERVE_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "src"), str(tmp_path / "dst")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    grown = got["hwm"] - got["rss_before"]
    bound = 2 * largest + 64 * MIB
    print(f"checkpoint {total / MIB:.0f} MiB, largest tensor {largest / MIB:.0f} MiB (bf16 embedding, copied), "
          f"RSS before {got['rss_before'] / MIB:.0f} MiB, peak {got['hwm'] / MIB:.0f} MiB, grew "
          f"{grown / MIB:.1f} MiB (bound {bound / MIB:.0f} MiB), {got['tensors']} tensors in {got['seconds']:.1f}s")
    shutil.rmtree(tmp_path, ignore_errors=True)  # ≈ 0.9 GiB of test files: gone as soon as measured
    assert bound < total  # loading the whole model would break the bound
    assert grown < bound


# --- end to end ----------------------------------------------------------------------------------------------

def test_converted_checkpoint_loads_like_in_memory_quantization(fp8_src, w8a8, w8a8_ep2):
    """The converted checkpoint, read as stored, gives the same logits bit for bit as the FP8 source
    quantized while loading (both quantize the fp32-dequantized weights per channel)."""
    ids = random_prompts(1, [24], 1000, seed=31)[0]
    converted, _ = load_model(w8a8, dtype="bfloat16", device="cpu")
    in_memory, _ = load_model(fp8_src, dtype="bfloat16", device="cpu", quantization="w8a8")
    plain, _ = load_model(fp8_src, dtype="bfloat16", device="cpu")
    ep_sliced, _ = load_model(w8a8_ep2, dtype="bfloat16", device="cpu")  # every rank file, one process
    a, b = engine_logits(converted, ids), engine_logits(in_memory, ids)
    assert torch.equal(a, b)
    assert torch.equal(engine_logits(ep_sliced, ids), a)
    assert not torch.equal(engine_logits(plain, ids), a)  # W8A8 really ran
