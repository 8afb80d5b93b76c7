"""bench/step_profile.py's accounting: a decode step's wall time split into kernels by kind and host time, every
C kernel call seen (attention is the paged-attention kernel's time, not the Python around it), the parts adding
up to the step, and the instrumentation gone afterwards."""

from __future__ import annotations

import pytest

from bench.step_profile import PARTS, profile_batch
from shared.engine import LLM
from shared.model import cpu_kernels


@pytest.mark.parametrize("eager", [True, False])
def test_a_step_splits_into_parts_that_add_up(ckpt, eager):
    """Eager steps (the profiler's view), and replayed ones (their recorded calls timed, split as the eager ops')."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the portable kernels run (their ops are aten ops, counted the same way)")
    llm = LLM(str(ckpt("v32_sparse")), dtype="float32", block_size=4, enforce_eager=eager)
    paged = cpu_kernels.library().paged_mqa
    step_ms, parts = profile_batch(llm, 4, 12, 3)
    assert set(parts) == set(PARTS)
    assert sum(parts.values()) == pytest.approx(step_ms)
    assert parts["matmul"] > 0 and parts["attention"] > 0 and parts["MoE"] > 0 and parts["host"] >= 0
    assert parts["host"] > 0 or not eager
    assert eager or llm.engine.graphs.stats.replays > 0
    assert cpu_kernels.library().paged_mqa is paged  # the kernels' scopes removed
    assert not llm.engine.has_work
