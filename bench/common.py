"""Helpers for benchmarks: output folder, markdown tables, matplotlib bar plots, the machine's limits."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("PDSERVE_BENCH_OUT", ROOT / "bench" / "out"))  # tables' plots (smoke tests: a tmp dir)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def kernels_used() -> str:
    """Which instruction sets the built CPU kernels multiply with on this machine (a bench prints it under its
    tables): the bf16 dot products (indexer, bf16 attention scores and experts) and the W8A8 int8 kernels."""
    from shared.model import cpu_kernels, int8_kernels

    if cpu_kernels.library() is None:
        return "CPU kernels: off (portable torch path)"
    dots = "vdpbf16ps (AVX512-BF16) for bf16 values, FMA otherwise" if cpu_kernels.bf16_dots() else "FMA"
    return (f"CPU kernels: dots (indexer, bf16 attention scores and experts) {dots}; "
            f"W8A8 int8 {int8_kernels.isa() or 'off'}")


def best_seconds(fn, rounds: int) -> float:
    """The fastest of `rounds` timed calls of `fn`, after one untimed call (warm-up)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class OpTimes:
    """Seconds spent in chosen functions while active, each exclusive of the other chosen functions it calls:
    where a step's time goes, at the cost of one timer per chosen call (a profiler would slow every call).
    `targets`: label → (module or object, attribute name); the attributes are replaced on entry, restored on
    exit."""

    def __init__(self, targets: dict[str, tuple[object, str]]):
        self.targets = targets
        self.seconds = dict.fromkeys(targets, 0.0)
        self._callees: list[float] = []  # per open timed call: seconds inside the timed calls it made
        self._saved: list[tuple[object, str, object, bool]] = []

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            self._callees.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds[label] += dt - self._callees.pop()
                if self._callees:
                    self._callees[-1] += dt
        return timed

    def __enter__(self) -> OpTimes:
        for label, (owner, name) in self.targets.items():
            own = name in vars(owner)
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn, own))
            setattr(owner, name, self._timed(label, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn, own in reversed(self._saved):
            if own:
                setattr(owner, name, fn)
            else:  # a method found on the class: drop the instance's wrapper
                delattr(owner, name)
        self._saved.clear()


# where a decode step's time goes: label → the shared.model.ops function timed (decode_parts)
STEP_PARTS = {"linears (bf16 / fp32)": "linear", "W8A8 linears": "w8a8_linear", "MoE": "moe",
              "sparse attention": "sparse_attention", "dense attention": "dense_attention",
              "indexer top-k": "indexer_topk", "absorbed heads": "head_matmul"}


@contextlib.contextmanager
def eager_steps(engine) -> Iterator[None]:
    """The engine's recorded decode steps set aside for a while (shared.engine.graphs): every step runs its ops'
    Python functions, which timers and profilers see (a replay runs the same kernels and ops, nothing else)."""
    graphs, engine.graphs = engine.graphs, None
    try:
        yield
    finally:
        engine.graphs = graphs


def decode_parts(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict[str, float]]:
    """(ms per decode step, ms per step in each of STEP_PARTS, each exclusive of the others) over one greedy
    run's decode steps (the steps after every request has its first token) of an LLM, run eagerly: the parts
    are timed around the ops' Python functions, which a replayed step (shared.engine.graphs) does not call."""
    import shared.model.ops as ops
    from shared.engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in prompts]
    while any(not s.output_token_ids for s in seqs):
        eng.step()
    steps, seconds = 0, 0.0
    with eager_steps(eng), OpTimes({label: (ops, name) for label, name in STEP_PARTS.items()}) as parts:
        while eng.has_work:
            t0 = time.perf_counter()
            eng.step()
            seconds += time.perf_counter() - t0
            steps += 1
    steps = max(steps, 1)
    return 1e3 * seconds / steps, {k: 1e3 * v / steps for k, v in parts.seconds.items()}


def fastest_parts(engines: dict, prompts: list[list[int]], new_tokens: int, runs: int = 2
                  ) -> dict[str, tuple[float, dict[str, float]]]:
    """decode_parts of each engine, `runs` times, engines alternating (order reversed every run), the fastest
    run of each kept: a burst of another process on a shared machine hits one run, not the figure."""
    best: dict[str, tuple[float, dict[str, float]]] = {}
    for r in range(runs):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            run = decode_parts(engines[name], prompts, new_tokens)
            if name not in best or run[0] < best[name][0]:
                best[name] = run
    return best


def kv_read_bound(step_ms: float, parts: dict[str, float], kv_ratio: float) -> tuple[float, float]:
    """(ms of a decode step in the parts that read the KV cache: attention and the indexer's top-k; the step's
    speedup at most were those parts bound by bytes alone and the KV bytes scaled by kv_ratio, e.g. C8's)."""
    read = parts["sparse attention"] + parts["dense attention"] + parts["indexer top-k"]
    return read, step_ms / (step_ms - (1 - kv_ratio) * read)


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


EMULATED_BF16_GFLOPS = 20.0  # below this a bf16 product is emulated (no AVX512-BF16 / AMX): read from a small one


@dataclass(frozen=True)
class MachineLimits:
    """What this machine can do at the bench's thread count: dense GEMM rates and memory copy bandwidth.
    A bench prints its model's FLOP and KV bytes per token against these, so a table says how far the
    engine is from the machine and not only from a peer."""

    threads: int
    fp32_gflops: float
    bf16_gflops: float
    copy_gbps: float  # bytes read + written per second by a large tensor copy

    @classmethod
    def measure(cls, gemm: int = 1024, copy_mib: int = 256, rounds: int = 5) -> MachineLimits:
        """Best of `rounds` timings: a gemm³ matmul in fp32 and bf16, a copy of `copy_mib` MiB (past caches). Where
        a (gemm / 4)³ bf16 product runs below EMULATED_BF16_GFLOPS, its rate is the bf16 reading (the full-size
        timings took 12 s at 1 GFLOP/s on a Zen 3, in every bench that prints the limits)."""
        import torch

        flops = 2.0 * gemm**3
        a32, b32 = torch.randn(gemm, gemm), torch.randn(gemm, gemm)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        src = torch.ones(copy_mib << 20, dtype=torch.uint8)  # written: pages never touched all read the zero page
        dst = torch.ones_like(src)
        probe = gemm // 4  # a CPU without bf16 arithmetic emulates it (~1 GFLOP/s): seconds a full-size product
        bf16 = 2.0 * probe**3 / best_seconds(lambda: a16[:probe, :probe] @ b16[:probe, :probe], 1) / 1e9
        if bf16 >= EMULATED_BF16_GFLOPS:
            bf16 = flops / best_seconds(lambda: a16 @ b16, rounds) / 1e9
        return cls(threads=torch.get_num_threads(), fp32_gflops=flops / best_seconds(lambda: a32 @ b32, rounds) / 1e9,
                   bf16_gflops=bf16,
                   copy_gbps=2 * src.numel() / best_seconds(lambda: dst.copy_(src), rounds) / 1e9)

    def describe(self) -> str:
        return (f"this machine at {self.threads} thread(s): GEMM {self.fp32_gflops:,.0f} GFLOP/s fp32, "
                f"{self.bf16_gflops:,.0f} GFLOP/s bf16; copy {self.copy_gbps:,.1f} GB/s")


@dataclass(frozen=True)
class TokenCost:
    """One decode token's work in a model: matmul FLOP (2 per active weight; embeddings are lookups, routed
    experts count top_k of E) plus attention FLOP over its context, and the KV bytes it reads."""

    weight_flop: float
    attention_flop_per_position: float  # FLOP per attended context position, all layers
    attended: int | None  # positions attended at most (index_topk for V3.2's sparse attention; None: all)
    index_flop_per_position: float  # the indexer scores every position, all layers
    kv_bytes_per_position: int  # every layer's rows read per attended position

    @classmethod
    def of(cls, model, kv_bytes_per_token: int) -> TokenCost:
        """From a built model (any device, meta included) and its KV layout's bytes per token (all layers)."""
        cfg = model.config
        routed_share = cfg.num_experts_per_tok / cfg.n_routed_experts if cfg.n_routed_experts else 1.0
        active = 0.0
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed_tokens" in name:
                continue
            active += p.numel() * (routed_share if ".mlp.experts." in name else 1.0)
        layers = cfg.num_hidden_layers
        latent = cfg.kv_lora_rank
        per_position = layers * cfg.num_attention_heads * 2.0 * ((latent + cfg.qk_rope_head_dim) + latent)
        index = layers * cfg.index_n_heads * 2.0 * cfg.index_head_dim if cfg.has_indexer else 0.0
        return cls(2.0 * active, per_position, cfg.index_topk or None, index, kv_bytes_per_token)

    def flop(self, context: int) -> float:
        attended = min(context, self.attended) if self.attended else context
        return self.weight_flop + self.attention_flop_per_position * attended + self.index_flop_per_position * context

    def kv_bytes(self, context: int) -> float:
        return float(self.kv_bytes_per_position * context)

    def sequence_flop(self, prompt_len: int, new_tokens: int) -> float:
        """FLOP of one request: every prompt and generated token through the weights, each attending to the
        positions before it (prefill counted in the absorbed form too: an upper bound of its attention)."""
        return sum(self.flop(t) for t in range(1, prompt_len + new_tokens + 1))

    def sequence_kv_read(self, prompt_len: int, new_tokens: int) -> float:
        """KV bytes the decode steps of one request read (each generated token reads its whole context)."""
        return sum(self.kv_bytes(t) for t in range(prompt_len + 1, prompt_len + new_tokens + 1))

    def describe(self, context: int) -> str:
        return (f"{self.flop(context) / 1e6:,.1f} MFLOP and {self.kv_bytes(context) / 1e3:,.1f} kB of KV per token "
                f"at context {context}")


def against_limits(limits: MachineLimits, flop_per_s: float, kv_bytes_per_s: float, dtype_name: str) -> str:
    """The rates a measured run implies, as shares of the machine's GEMM rate in the dtype the model computes
    in and of its copy bandwidth. A `bfloat16` model computes in bf16 where the CPU multiplies bf16, else in fp32
    (shared.device.compute_dtype: its matmul weights are kept as fp32 copies), so that rate is its limit."""
    import torch

    from shared.device import compute_dtype

    if dtype_name == "bfloat16" and compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32:
        dtype_name = "float32 (a bf16 model on a CPU without bf16 arithmetic)"
    peak = limits.bf16_gflops if dtype_name == "bfloat16" else limits.fp32_gflops
    gflops, gbps = flop_per_s / 1e9, kv_bytes_per_s / 1e9
    return (f"{gflops:,.1f} GFLOP/s ({100 * gflops / peak:.0f}% of the {dtype_name} GEMM rate), "
            f"KV read {gbps:,.2f} GB/s ({100 * gbps / limits.copy_gbps:.1f}% of copy bandwidth)")


def proxy_shapes(hidden: int) -> dict[str, int]:
    """DeepSeek-V3's layer shapes scaled to `hidden` (7,168 there): its head dims, latent and rope as they are
    (kv_lora 512, nope 128, rope 64, v 128), heads, q_lora and the MLPs' widths in proportion (rounded to powers
    of two or multiples of 512), 64 experts top-8 in 8 groups (a batch of 256 gives each expert 32 rows, as
    256 experts on 4 EP ranks would); 4 layers, the first dense, vocabulary 1,024 (the head would dominate 4
    layers at the real 129,280)."""
    scale = hidden / 7168
    return {"hidden_size": hidden, "num_attention_heads": max(4, 1 << round(scale * 128).bit_length() - 1),
            "q_lora_rank": max(64, 512 * round(1536 * scale / 512)), "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": max(512, 512 * round(18432 * scale / 512)),
            "moe_intermediate_size": max(128, 512 * round(2048 * scale / 512)), "n_routed_experts": 64,
            "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}
