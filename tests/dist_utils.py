"""Tests run parallel code on real gloo ranks through shared.parallel.launch.run_ranks."""

from shared.parallel.launch import run_ranks

__all__ = ["run_ranks"]
