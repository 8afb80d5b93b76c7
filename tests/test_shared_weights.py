"""Shared read-only weights: co-located processes map one node-wide copy (shared/loader/shared_weights.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from shared.loader.checkpoint import load_model
from shared.loader.shared_weights import (
    ALIGN,
    cleanup,
    private_bytes,
    share_weights,
    shareable_tensors,
    shared_bytes,
    weights_key,
)
from tests.helpers import engine_logits, make_hf_checkpoint

ROOT = Path(__file__).resolve().parents[1]
IDS = [3, 17, 42, 7, 99, 5, 250, 11, 64, 2]

# One child process: load the checkpoint (sharing through load_model, through share_weights directly
# after a barrier, or not at all), make every weight page resident, and print private memory before
# and after as JSON. The baseline is taken after building the model's skeleton once (its first
# construction imports ~800 modules, ~65 MB that have nothing to do with weights; its parameters are
# torch.empty, so no weight page is touched), so "added" is what the weights cost this process.
CHILD = r"""
import gc, json, os, sys, time
import torch
from shared.config import ModelConfig
from shared.loader.checkpoint import load_model
from shared.loader.shared_weights import (_release_freed_memory, private_bytes, share_weights, shareable_tensors,
                                          shared_bytes)
from shared.model import DeepseekForCausalLM

ckpt, mode, share_dir, hold = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
skeleton = DeepseekForCausalLM(ModelConfig.from_pretrained(ckpt), torch.float32)
del skeleton
gc.collect(); _release_freed_memory()
before = private_bytes()
created = None
if mode == "loader":
    model, _ = load_model(ckpt, share_weights_dir=share_dir)
else:
    model, _ = load_model(ckpt)
    if mode == "barrier":  # both processes reach share_weights together
        open(os.path.join(sys.argv[5], f"ready.{os.getpid()}"), "w").close()
        while len([n for n in os.listdir(sys.argv[5]) if n.startswith("ready.")]) < 2:
            time.sleep(0.005)
        created = share_weights(model, "concurrent", share_dir).created
tensors = shareable_tensors(model)
weights = sum(t.numel() * t.element_size() for t in tensors.values())
checksum = sum(int(t.reshape(-1).view(torch.uint8).sum()) for t in tensors.values())  # every page resident
gc.collect(); _release_freed_memory()
after = private_bytes()
print(json.dumps({"pid": os.getpid(), "before": before, "after": after, "added": after - before,
                  "weights": weights, "shared": shared_bytes(), "checksum": checksum, "created": created}),
      flush=True)
if hold:  # keep the mapping alive (pages count as shared only while two processes map them)
    sys.stdin.readline()
"""


def _child(ckpt: Path, mode: str, share_dir: Path | str, hold: bool = False, barrier: Path | None = None,
           ) -> subprocess.Popen:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PDSERVE_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", CHILD, str(ckpt), mode, str(share_dir), "1" if hold else "0"]
    if barrier is not None:
        args.append(str(barrier))
    return subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: float = 120) -> dict:
    """The child's JSON line (read before it exits when it holds its mapping)."""
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    if not line:
        proc.wait(max(1.0, deadline - time.monotonic()))
        raise AssertionError(f"child failed (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def _finish(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.write("\n")
        proc.stdin.flush()
    assert proc.wait(60) == 0, proc.stderr.read()[-3000:]


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (from /proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == str(path):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def _all_mapped(model: nn.Module, path: Path) -> bool:
    ranges = _mapped_ranges(path)
    return all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in shareable_tensors(model).values())


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """~59 MB of fp32 weights (vocab 8192, hidden 256, 16 experts): far above allocator noise."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("big"), "deepseek_v32", vocab_size=8192, hidden_size=256,
                              num_hidden_layers=4, n_routed_experts=16, moe_intermediate_size=256, index_topk=8)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_shared_logits_identical(ckpt, tmp_path, dtype):
    path = ckpt("v32_sparse")
    plain, _ = load_model(path, dtype=dtype)
    shared, _ = load_model(path, dtype=dtype, share_weights_dir=str(tmp_path / "shm"))
    files = list((tmp_path / "shm").glob("*.safetensors"))
    assert len(files) == 1
    assert _all_mapped(shared, files[0]), "some tensor still lives in private memory"
    ranges = _mapped_ranges(files[0])
    assert not any(lo <= t.data_ptr() < hi for t in shareable_tensors(plain).values() for lo, hi in ranges)
    names = shareable_tensors(shared)
    assert any(n.endswith("self_attn.w_uk") for n in names) and any(n.endswith("w_uv_t") for n in names)
    assert all(not p.requires_grad and isinstance(p, nn.Parameter) for p in shared.parameters())
    assert torch.equal(engine_logits(plain, IDS), engine_logits(shared, IDS))
    # a second process-equivalent load maps the same file and agrees too
    again, _ = load_model(path, dtype=dtype, share_weights_dir=str(tmp_path / "shm"))
    assert torch.equal(engine_logits(plain, IDS), engine_logits(again, IDS))


class _Odd(nn.Module):
    """Every dtype the format names, odd sizes (alignment padding), a non-contiguous parameter, a tied
    alias, a buffer, plain tensor attributes, inference tensors and an empty tensor."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(3, 5, generator=g).to(torch.bfloat16), requires_grad=False)
        self.b = nn.Parameter(torch.randint(-128, 127, (7,), generator=g, dtype=torch.int8), requires_grad=False)
        self.c = nn.Parameter(torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn), requires_grad=False)
        self.d = nn.Parameter(torch.randn(6, 4, generator=g).t(), requires_grad=False)  # non-contiguous
        self.register_buffer("mask", torch.rand(11, generator=g) > 0.5)
        self.inner = nn.Linear(3, 3, dtype=torch.float16).requires_grad_(False)
        self.tied = self.inner.weight  # the same Parameter in two slots
        self.plain = torch.randn(2, 9, generator=g, dtype=torch.float64)
        self.scalar = torch.tensor(3, dtype=torch.int64)
        self.empty = nn.Parameter(torch.empty(0), requires_grad=False)
        with torch.inference_mode():  # inference tensors cannot take new .data: their slots are replaced
            self.register_buffer("inf_buffer", torch.arange(13, dtype=torch.int32))
            self.inf_plain = torch.arange(5, dtype=torch.int16)


def test_share_roundtrip_dtypes_alignment(tmp_path):
    model = _Odd()
    before = {n: t.clone() for n, t in shareable_tensors(model).items()}
    assert "inner.weight" not in before and "empty" not in before  # an alias once, empty skipped
    report = share_weights(model, "odd", tmp_path)
    assert report.created and report.tensors == len(before) == 11
    assert report.bytes_mapped == sum(t.numel() * t.element_size() for t in before.values())
    after = shareable_tensors(model)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name].float(), t.float()), name
        assert after[name].data_ptr() % ALIGN == 0, name
    assert model.tied is model.inner.weight and isinstance(model.inner.weight, nn.Parameter)
    assert _all_mapped(model, report.path)
    with safe_open(report.path, "pt") as f:  # a valid safetensors file (pads fill the alignment gaps)
        assert f.metadata()["key"] == "odd"
        for name, t in before.items():
            assert torch.equal(f.get_tensor(name).float(), t.float()), name
    again = share_weights(_Odd(), "odd", tmp_path)
    assert not again.created and again.tensors == report.tensors
    cleanup(tmp_path, "odd")
    assert not report.path.exists()
    assert torch.equal(model.plain, before["plain"])  # the mapping outlives the unlinked file


def test_refuses_trainable_parameters(tmp_path):
    with pytest.raises(ValueError, match="requires grad"):
        share_weights(nn.Linear(4, 4), "trainable", tmp_path)


def test_weights_key(ckpt, tmp_path):
    path = ckpt("v32_sparse")
    k = weights_key(path, torch.float32, {"tp": 1, "ep": 2, "ep_rank": 0})
    assert k == weights_key(path, torch.float32, {"ep_rank": 0, "tp": 1, "ep": 2})
    assert k != weights_key(path, torch.float32, {"tp": 1, "ep": 2, "ep_rank": 1})
    assert k != weights_key(path, torch.bfloat16, {"tp": 1, "ep": 2, "ep_rank": 0})
    copy = tmp_path / path.name
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert weights_key(copy, torch.float32) != weights_key(path, torch.float32)
    before = weights_key(copy, torch.float32)
    st = next(copy.glob("*.safetensors"))
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 1_000_000))
    assert weights_key(copy, torch.float32) != before


def test_partial_or_stale_file_rewritten(ckpt, tmp_path):
    path = ckpt("v32_sparse")
    plain, _ = load_model(path)
    ref = engine_logits(plain, IDS)
    first = share_weights(load_model(path)[0], "k", tmp_path)
    assert first.created
    data = first.path.read_bytes()
    # never truncate a mapped file in place (mappers would fault): replace it with a truncated copy
    for broken in (data[: len(data) // 2], data[:-1], data[:4]):
        first.path.unlink()
        first.path.write_bytes(broken)
        model, _ = load_model(path)
        report = share_weights(model, "k", tmp_path)
        assert report.created, f"a {len(broken)}-byte file was mapped"
        assert report.path.stat().st_size == len(data)
        assert torch.equal(engine_logits(model, IDS), ref)
    # a complete file written for another key (stale metadata) is rewritten too
    other = share_weights(load_model(path)[0], "other", tmp_path)
    first.path.unlink()
    first.path.write_bytes(other.path.read_bytes())
    assert share_weights(load_model(path)[0], "k", tmp_path).created
    # a different model under the same key (shapes differ) is rewritten, not mapped
    bigger = ckpt("v32_4layers")
    assert share_weights(load_model(bigger)[0], "k", tmp_path).created
    assert not list(tmp_path.glob(".k.*.tmp"))


def test_memory_second_process_maps_one_copy(big_ckpt, tmp_path):
    """The first process writes the file, the second maps it: the second's private memory grows by
    a small fraction of the weights; a control process that does not share pays all of it."""
    share_dir = tmp_path / "shm"
    first = _child(big_ckpt, "loader", share_dir, hold=True)
    try:
        a = _result(first)
        second = _child(big_ckpt, "loader", share_dir, hold=True)
        try:
            b = _result(second)
            control = _child(big_ckpt, "plain", "", hold=False)
            c = _result(control)
            _finish(control)
        finally:
            _finish(second)
    finally:
        _finish(first)
    mb = 2**20
    summary = {name: {k: round(r[k] / mb, 1) for k in ("before", "after", "added", "weights", "shared")}
               for name, r in (("first", a), ("second", b), ("control", c))}
    print("\nshared weights memory (MiB):", json.dumps(summary, indent=1))
    weights = a["weights"]
    assert weights > 50 * mb and a["weights"] == b["weights"] == c["weights"]
    assert a["checksum"] == b["checksum"] == c["checksum"]
    assert len(list(share_dir.glob("*.safetensors"))) == 1
    assert b["added"] < 0.25 * weights, f"second process added {b['added'] / mb:.1f} MiB of {weights / mb:.1f}"
    assert b["shared"] >= 0.9 * weights, "the second process does not see the weights as shared pages"
    assert c["added"] > 0.75 * weights, "the measurement cannot see the weights (control)"


def test_concurrent_start_one_writer(ckpt, tmp_path):
    path = ckpt("v32_sparse")
    share_dir, barrier = tmp_path / "shm", tmp_path / "barrier"
    barrier.mkdir()
    procs = [_child(path, "barrier", share_dir, barrier=barrier) for _ in range(2)]
    results = [_result(p) for p in procs]
    for p in procs:
        _finish(p)
    assert sorted(r["created"] for r in results) == [False, True]
    assert results[0]["checksum"] == results[1]["checksum"]
    assert [p.name for p in share_dir.iterdir() if not p.name.endswith(".lock")] == ["concurrent.safetensors"]


def test_private_shared_bytes_readable():
    assert private_bytes() > 0 and shared_bytes() >= 0


def test_parallel_slices_keyed(ckpt, tmp_path):
    """EP ranks hold different experts: one file each; DP ranks without EP hold the same: one file."""
    from shared.parallel.state import ParallelConfig, ParallelState

    path, name = ckpt("v32_sparse"), "model.layers.1.mlp.experts.down_proj"
    for rank in (0, 1):
        state = ParallelState(ParallelConfig(world=2, dp=2, ep=2), rank)
        shared, _ = load_model(path, parallel=state, share_weights_dir=str(tmp_path / "ep"))
        plain, _ = load_model(path, parallel=state)
        assert torch.equal(shareable_tensors(shared)[name], shareable_tensors(plain)[name])
    assert len(list((tmp_path / "ep").glob("*.safetensors"))) == 2
    for rank in (0, 1):
        load_model(path, parallel=ParallelState(ParallelConfig(world=2, dp=2), rank),
                   share_weights_dir=str(tmp_path / "dp"))
    assert len(list((tmp_path / "dp").glob("*.safetensors"))) == 1


@pytest.mark.parametrize("key", ["../escape", "a/b", ".hidden", ""])
def test_rejects_path_like_keys(tmp_path, key):
    with pytest.raises(ValueError, match="plain file name"):
        share_weights(_Odd(), key, tmp_path)


def test_accelerators_refuse_weight_sharing_naming_the_flag(ckpt, tmp_path):
    """On a GPU (or NPU: the same rule, any device but the CPU) the weights live in device memory, which the
    host-file mapping cannot share: the library refuses before loading, and a service started with the flag
    exits at start naming it (never a silent no-op). Checked without the accelerator: the device is what
    PDSERVE_DEVICE / device= names."""
    device = "cuda"
    with pytest.raises(ValueError, match=f"--share-weights-dir shares host memory .* on {device} the weights live"):
        load_model(ckpt("v32_sparse"), "float32", device, share_weights_dir=str(tmp_path / "shm"))
    env = {**os.environ, "PDSERVE_DEVICE": device}
    proc = subprocess.run([sys.executable, "-m", "decode_service", "--model", str(ckpt("v32_sparse")), "--insecure",
                           "--share-weights-dir", str(tmp_path / "shm")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 1 and "error: --share-weights-dir shares host memory" in proc.stderr
    assert not (tmp_path / "shm").exists()
