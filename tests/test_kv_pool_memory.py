"""The KV pools' host memory: zeroed, and backed by 2 MiB pages where the kernel lends them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shared.config import ModelConfig
from shared.device import zeros_on_huge_pages
from shared.kvcache import KVCache, KVLayout
from shared.loader.tiny import make_config

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1])
    return huge


def _thp_lent() -> bool:
    return THP.exists() and re.search(r"\[(always|madvise)\]", THP.read_text()) is not None


def test_a_large_pool_is_zero_and_on_huge_pages_where_the_kernel_lends_them():
    cfg = ModelConfig.from_dict(make_config("deepseek_v32"))
    layout = KVLayout.from_model_config(cfg, 16, torch.bfloat16)
    kv = KVCache(layout, 2048, torch.device("cpu"))  # 4 layers x 2,048 blocks x 16 x 576 bf16: 151 MB
    assert kv.mla.dtype == torch.bfloat16 and kv.mla.shape == (4, 2048, 16, 576)
    assert not kv.mla.any() and not kv.index.any()
    if not _thp_lent():
        pytest.skip("no transparent huge pages on this kernel: the pools are plain pages")
    assert _huge_kb(kv.mla.data_ptr() + kv.mla.nbytes // 2) > 0


def test_the_advice_covers_every_whole_huge_page_of_the_pool(monkeypatch):
    """Whatever this kernel lends: the pool's memory is advised before it is touched, from its first 2 MiB
    boundary to its last, and the pool is zero after."""
    import shared.device as device

    advised: list[tuple[int, int, int]] = []
    monkeypatch.setattr(device, "_madvise", lambda: lambda addr, length, advice: advised.append((addr, length, advice)))
    pool = zeros_on_huge_pages((3, 1000, 16, 576), torch.bfloat16, torch.device("cpu"))
    (addr, length, advice), = advised
    huge, start, end = 2 << 20, pool.data_ptr(), pool.data_ptr() + pool.nbytes
    assert advice == 14 and addr % huge == 0 and length % huge == 0 and length > 0  # MADV_HUGEPAGE
    assert start <= addr < start + huge and end - huge < addr + length <= end
    assert not pool.any()
    advised.clear()
    zeros_on_huge_pages((3, 5), torch.float32, torch.device("cpu"))  # no whole huge page inside: not advised
    assert advised == []


def test_small_or_foreign_tensors_are_plain_zeros():
    small = zeros_on_huge_pages((3, 5), torch.float32, torch.device("cpu"))
    assert small.shape == (3, 5) and not small.any()
    odd = zeros_on_huge_pages((0, 7), torch.int8, torch.device("cpu"))
    assert odd.numel() == 0
