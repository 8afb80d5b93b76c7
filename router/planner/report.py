"""`pdserve plan`: stage A picks (M, N), stage B checks it with the router's policy, both goodputs and the
deployment keys are printed (and, asked, a plot of attainment against rate)."""

from __future__ import annotations

import math
from collections.abc import Callable

from router.perf import PerfModel
from router.planner.stage_a import Prediction, Workload, analytic, goodput, plan
from router.planner.stage_b import simulate


def _row(name: str, p: Prediction) -> list[str]:
    def ms(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x * 1e3:.0f}"

    att = "-" if p.attainment is None else f"{p.attainment:.0%}"
    return [name, str(p.m), str(p.n), ms(p.ttft_p50_s), ms(p.ttft_p90_s), ms(p.tpot_p50_s), ms(p.tpot_p90_s), att]


def run_plan(perf: PerfModel, w: Workload, max_m: int, max_n: int, ranks: int = 1, requests: int = 2000,
             seed: int = 0, plot: str | None = None, say: Callable[[str], None] = print) -> Prediction | None:
    """Stage A picks (M, N); stage B simulates it with the router's SLA policy; both goodputs; the
    deployment keys. Returns stage B's prediction (None when no (M, N) within the limits fits)."""
    chosen = plan(perf, w, max_m, max_n, ranks)
    if chosen is None:
        say(f"no M <= {max_m}, N <= {max_n} meets TTFT p90 {w.ttft_p90_s * 1e3:.0f} ms and TPOT p90 "
            f"{w.tpot_p90_s * 1e3:.0f} ms at {w.rate:g} req/s; raise --max-m / --max-n or relax the targets")
        return None
    m, n = chosen.m, chosen.n
    sim = simulate(perf, w, m, n, ranks=ranks, requests=requests, seed=seed).prediction
    high = 4 * w.rate

    def analytic_ok(rate: float) -> bool:
        return analytic(perf, _at(w, rate), m, n, ranks).meets(w)

    def sim_ok(rate: float) -> bool:
        return simulate(perf, _at(w, rate), m, n, ranks=ranks, requests=requests, seed=seed).prediction.meets(w)

    good_a, good_b = goodput(analytic_ok, high), goodput(sim_ok, high, tolerance=0.03)
    header = ["stage", "M", "N", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms", "attainment"]
    rows = [_row("A analytic", chosen), _row("B simulated", sim)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        say("  ".join(c.rjust(wd) for c, wd in zip(r, widths)))
    say(f"goodput at M={m}, N={n}: stage A {good_a:.2f} req/s ({good_a / (m + n):.2f} per instance), "
        f"stage B {good_b:.2f} req/s ({good_b / (m + n):.2f} per instance); binds: {chosen.binds(w)}")
    say("# deployment (pdserve up --config FILE, or helm -f FILE):")
    say(f"prefill:\n  instances: {m}\ndecode:\n  instances: {n}\nrouter:\n  policy: sla\n"
        f"  ttftSloMs: {w.ttft_p90_s * 1e3:g}\n  tpotSloMs: {w.tpot_p90_s * 1e3:g}")
    if plot:
        _plot(perf, w, m, n, ranks, requests, seed, plot)
        say(f"plot: {plot}")
    return sim


def _at(w: Workload, rate: float) -> Workload:
    return Workload(rate, w.isl, w.osl, w.ttft_p90_s, w.tpot_p90_s, w.attainment, w.cached_tokens)


def _plot(perf: PerfModel, w: Workload, m: int, n: int, ranks: int, requests: int, seed: int, path: str) -> None:
    """SLA attainment vs request rate (stage B) for the chosen (M, N) and its neighbours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [w.rate * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for mm, nn in sorted({(m, n), (max(1, m - 1), n), (m, max(1, n - 1)), (m + 1, n), (m, n + 1)}):
        att = [simulate(perf, _at(w, r), mm, nn, ranks=ranks, requests=requests, seed=seed).prediction.attainment
               for r in rates]
        ax.plot(rates, att, marker="o", label=f"M={mm} N={nn}" + (" (chosen)" if (mm, nn) == (m, n) else ""))
    ax.axhline(w.attainment, color="grey", linestyle="--")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLA attainment")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
