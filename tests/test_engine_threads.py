"""How many threads a service's engine ranks take (shared.parallel.launch.engine_threads): --cpu-threads, else
OMP_NUM_THREADS, else the usable cores less one for the front ends, shared out among the host's ranks."""

from __future__ import annotations

import argparse

import pytest
import torch

from shared.config import DecodeConfig, PrefillConfig, parse_flags
from shared.parallel import launch


@pytest.fixture
def host(monkeypatch):
    """host(cores, torch_default): a machine with that many usable cores and torch's default thread count."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def make(cores: int, torch_default: int) -> None:
        monkeypatch.setattr(launch, "usable_cores", lambda: cores)
        monkeypatch.setattr(torch, "get_num_threads", lambda: torch_default)

    return make


def test_auto_leaves_one_core_to_the_front_ends(host):
    host(2, 2)
    assert launch.engine_threads(0, 1) == 1
    host(16, 16)
    assert launch.engine_threads(0, 1) == 15
    assert launch.engine_threads(0, 4) == 3  # four ranks on the host share the 15
    host(64, 32)  # SMT: torch counts physical cores
    assert launch.engine_threads(0, 1) == 31
    host(1, 1)
    assert launch.engine_threads(0, 1) == 1  # never none
    assert launch.engine_threads(0, 8) == 1


def test_explicit_threads_and_omp_num_threads_win(host, monkeypatch):
    host(16, 16)
    assert launch.engine_threads(6, 1) == 6
    assert launch.engine_threads(6, 2) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert launch.engine_threads(0, 1) == 4
    assert launch.engine_threads(6, 1) == 6  # the flag over the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "four")  # not a count: ignored
    assert launch.engine_threads(0, 1) == 15


def test_a_container_cpu_quota_caps_the_cores(monkeypatch, tmp_path):
    cpu_max = tmp_path / "cpu.max"
    real_path = launch.Path
    monkeypatch.setattr(launch, "Path", lambda p: cpu_max if p == "/sys/fs/cgroup/cpu.max" else real_path(p))
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(32)))
    cpu_max.write_text("250000 100000\n")  # 2.5 CPUs
    assert launch.usable_cores() == 3
    cpu_max.write_text("max 100000\n")
    assert launch.usable_cores() == 32
    cpu_max.unlink()  # no cgroup v2 quota file
    assert launch.usable_cores() == 32


def test_the_flag_on_both_services():
    for cls in (PrefillConfig, DecodeConfig):
        assert parse_flags(cls, argparse.ArgumentParser(), ["--model", "m"]).cpu_threads == 0
        assert parse_flags(cls, argparse.ArgumentParser(), ["--model", "m", "--cpu-threads", "3"]).cpu_threads == 3
        with pytest.raises(SystemExit):
            parse_flags(cls, argparse.ArgumentParser(), ["--model", "m", "--cpu-threads", "-1"])
