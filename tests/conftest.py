from __future__ import annotations

import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("PDSERVE_DEVICE", "cpu")
os.environ.setdefault("PDSERVE_KV_LEDGER_CHECK", "1")  # every step checks each KV block has one owner
# no tqdm monitor thread (its progress bars, transformers' among them, still draw): a test process with one
# thread starts its gloo ranks by fork (shared.device.process_start_method), not by a spawn that imports torch again
tqdm.monitor_interval = 0

from tests.helpers import make_hf_checkpoint  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

CHECKPOINTS = {
    "v32_dense": ("deepseek_v32", dict(index_topk=256)),
    "v32_sparse": ("deepseek_v32", dict(index_topk=8)),
    "v32_yarn": ("deepseek_v32", dict(index_topk=12, rope_parameters=YARN)),
    "v3": ("deepseek_v3", {}),
    "v32_4layers": ("deepseek_v32", dict(index_topk=8, num_hidden_layers=4)),
    # experts past moe_kernels.BF16_EXPERT_MAX in bf16 (as DeepSeek's): oneDNN's grouped GEMMs, not the kernel
    "v3_wide_experts": ("deepseek_v3", dict(hidden_size=512, moe_intermediate_size=256)),
}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt(name) → path of a session-cached tiny HF checkpoint."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            model_type, overrides = CHECKPOINTS[name]
            made[name] = make_hf_checkpoint(tmp_path_factory.mktemp(name), model_type, **overrides)
        return made[name]

    return get


@pytest.fixture(scope="session")
def served_model(ckpt, tmp_path_factory):
    """The sparse v32 test checkpoint (written by transformers) plus a tokenizer for text prompts."""
    import shutil

    from shared.loader.tokenizer_train import train_tokenizer

    path = tmp_path_factory.mktemp("served") / "model"
    shutil.copytree(ckpt("v32_sparse"), path)
    train_tokenizer(512, path / "tokenizer.json")
    return path


KERNEL_ARCHES = ("native", "haswell", "x86-64-v2", "x86-64")  # every -march a test builds the CPU kernels for


@pytest.fixture(scope="session")
def arch_builds(tmp_path_factory) -> Path:
    """One kernel cache for every test that builds for another -march: builds are keyed by source, flags and
    ISA, so each is compiled once a session (a fresh cache per test compiled the same three builds 5 times).
    The builds are made at once, in parallel (a compiler run is one thread: 7-10 s each here)."""
    from shared.model import cpu_kernels, kernel_build

    path = tmp_path_factory.mktemp("kernel-builds")
    arches = KERNEL_ARCHES if platform.machine() == "x86_64" else KERNEL_ARCHES[:1]
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(len(arches)) as pool:
        mp.setenv("PDSERVE_KERNEL_CACHE", str(path))
        built = list(pool.map(lambda arch: kernel_build.build_library(cpu_kernels._SOURCE_FILE, arch), arches))
    assert all(lib is not None for lib in built), "the kernels must build here (a C compiler is part of the install)"
    return path


@pytest.fixture
def portable(monkeypatch):
    """portable(True) forces the CPU kernels' portable path, portable(False) the built kernels."""
    from shared.model import cpu_kernels

    lib = cpu_kernels.library()
    assert lib is not None, "the kernel must build here (a C compiler is part of the install)"

    def force(on: bool) -> None:
        monkeypatch.setattr(cpu_kernels, "_library", None if on else lib)
        monkeypatch.setattr(cpu_kernels, "_tried", True)

    return force
