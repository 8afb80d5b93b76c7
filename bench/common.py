"""Helpers for benchmarks: output folder, markdown tables, matplotlib bar plots."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("PDSERVE_BENCH_OUT", ROOT / "bench" / "out"))  # tables' plots (smoke tests: a tmp dir)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank; nan when there are none)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:,.1f}" if isinstance(v, float) else str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def _axes():  # (pyplot, figure, axes)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    return plt, fig, ax


def _save(plt, fig, ax, path: Path, title: str, ylabel: str) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bar_plot(path: Path, title: str, labels: list[str], series: dict[str, list[float]], ylabel: str) -> Path:
    plt, fig, ax = _axes()
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels)
    return _save(plt, fig, ax, path, title, ylabel)


def line_plot(path: Path, title: str, xs: list[int], series: dict[str, list[float]], xlabel: str,
              ylabel: str) -> Path:
    """One line per system over a sweep (log-scaled x), values labelled."""
    plt, fig, ax = _axes()
    for name, values in series.items():
        if values:
            ax.plot(xs[: len(values)], values, marker="o", label=name)
            for x, v in zip(xs, values):
                ax.annotate(f"{v:.0f}", (x, v), fontsize=7, textcoords="offset points", xytext=(0, 4))
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    return _save(plt, fig, ax, path, title, ylabel)
