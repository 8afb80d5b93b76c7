"""bench.common.OpTimes, which the benches' step breakdowns rest on: each timed function's time excludes the
other timed functions it calls, and every replaced attribute is back afterwards (a module's function and an
object's method alike). A fake clock that the functions advance: exact, whatever the machine's load."""

from __future__ import annotations

import types

import bench.common as common
from bench.common import OpTimes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Model:
    def __init__(self, clock: Clock):
        self.clock = clock

    def forward(self, depth: int) -> int:
        self.clock.now += 2.0
        return depth


def test_times_are_exclusive_and_attributes_restored(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(common, "time", clock)
    mod = types.ModuleType("fake_ops")

    def inner() -> str:
        clock.now += 5.0
        return "inner"

    def outer() -> str:
        clock.now += 3.0
        return mod.inner() + "+outer"

    mod.inner, mod.outer = inner, outer
    model = Model(clock)
    with OpTimes({"inner": (mod, "inner"), "outer": (mod, "outer"), "forward": (model, "forward")}) as t:
        assert mod.outer() == "inner+outer"
        assert mod.inner() == "inner"
        assert model.forward(3) == 3
    assert t.seconds == {"inner": 10.0, "outer": 3.0, "forward": 2.0}  # outer: its own 3 s, not inner's 5
    assert mod.inner is inner and mod.outer is outer
    assert "forward" not in vars(model) and model.forward(1) == 1  # the class's method again
