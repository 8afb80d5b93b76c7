"""A recorded trace (Mooncake's format: arrival, lengths, prefix-block hashes) and what its replay measured."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request of a recorded trace: arrival (s from the start), prompt and output tokens, and the
    prompt's prefix-block hashes (equal leading hashes: a shareable prefix, `block_tokens` tokens each)."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()


def load_trace(path: str, limit: int | None = None, minutes: float | None = None) -> list[TraceRequest]:
    """A Mooncake-format trace (JSON lines: `timestamp` ms, `input_length`, `output_length`, `hash_ids`),
    sorted by arrival; the first `limit` requests and / or `minutes` of it."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append(TraceRequest(r["timestamp"] / 1e3, max(1, int(r["input_length"])),
                                        max(1, int(r["output_length"])), tuple(r.get("hash_ids") or ())))
    out.sort(key=lambda r: r.arrival)
    if minutes is not None:
        out = [r for r in out if r.arrival < minutes * 60]
    return out[:limit] if limit is not None else out


@dataclass
class TraceResult:
    """simulate_trace's outcome. Per request (in trace order) TTFT and TPOT (inf: refused by the policy);
    `met`: both within the targets. `series`: per bucket (start s, arrivals / s, mean M, mean N,
    attainment of the bucket's arrivals). `sizes`: (time, prefill, decode) whenever the pools' provisioned
    sizes change (instances booting included)."""

    ttft: list[float]
    tpot: list[float]
    met: list[bool]
    ttft_s: float
    tpot_s: float
    instance_hours: float
    end_s: float
    rejected: int
    migrations: int
    prompt_tokens: int  # prompt tokens of the prompts prefilled (re-prefills of migrations included)
    computed_tokens: int  # of them, the tokens not found in the instance's prefix cache
    series: list[tuple[float, float, float, float, float]]
    sizes: list[tuple[float, int, int]]
    booting_hours: float = 0.0  # of the instance-hours, those of instances asked for and not serving yet

    @property
    def changes_per_hour(self) -> float:
        """How often the pools' provisioned sizes changed, per hour of the replay."""
        return (len(self.sizes) - 1) * 3600.0 / self.end_s if self.end_s > 0 else 0.0

    @property
    def attainment(self) -> float:
        """Share of all requests (a refusal is a miss) whose TTFT and TPOT both met their targets."""
        return sum(self.met) / len(self.met) if self.met else 1.0

    @property
    def cache_hit_rate(self) -> float:
        return 1 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def quantile(self, which: str, q: float) -> float:
        """Quantile of the served requests' TTFT or TPOT (`which`: "ttft" / "tpot"; nearest rank)."""
        xs = sorted(x for x in getattr(self, which) if not math.isinf(x))
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.inf
