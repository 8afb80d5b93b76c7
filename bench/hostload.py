"""CPU that other programs on this machine use while a benchmark runs (the machine is shared: another
session's test suite on the same 2 cores halves a measurement). `ForeignLoad` counts the machine's busy
CPU (/proc/stat) minus this process tree's (itself, its reaped children, its live descendants: the
servers it started); `wait_quiet` holds a measurement until the others are (nearly) idle."""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """The machine's busy CPU seconds since boot, all cores (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK  # user nice system idle iowait irq softirq steal


def tree_seconds(root: int) -> float:
    """CPU seconds of `root` and every live descendant, each with its reaped children."""
    stats: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = Path(entry.path, "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue  # exited meanwhile
    children: dict[int, list[int]] = {}
    for pid, f in stats.items():
        children.setdefault(int(f[1]), []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            f = stats[pid]
            total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])  # utime stime cutime cstime
        todo.extend(children.get(pid, []))
    return total / TICK


def own_seconds(pid: int) -> float:
    """CPU seconds of one process alone (its threads; not its children)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / TICK


def front_and_engine(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named service process (its front: the process itself) and of what it started
    (its engine ranks: its descendants), as "NAME front" / "NAME engine"."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        own = own_seconds(pid)
        out[f"{name} front"], out[f"{name} engine"] = own, tree_seconds(pid) - own
    return out


class ForeignLoad:
    """`start()`, then `cores()`: the average number of cores others kept busy since."""

    def __init__(self, root: int | None = None):
        self.root = root or os.getpid()
        self.start()

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), _busy_seconds(), tree_seconds(self.root)

    def cores(self) -> float:
        wall = max(time.monotonic() - self.t0, 1e-6)
        return max(0.0, (_busy_seconds() - self.busy0) - (tree_seconds(self.root) - self.own0)) / wall


def wait_quiet(threshold: float, timeout: float, window: float = 2.0) -> float:
    """Wait (at most `timeout` s) until others use under `threshold` cores over a `window`; returns
    their load over the last window."""
    deadline = time.monotonic() + timeout
    while True:
        probe = ForeignLoad()
        time.sleep(window)
        load = probe.cores()
        if load < threshold or time.monotonic() >= deadline:
            return load
