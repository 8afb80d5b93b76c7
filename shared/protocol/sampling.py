"""What a request asks to generate, and the bounds every request is held to (checked before any work,
in the router as in the engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Bounds every request is held to (a request beyond them is refused before any work).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0  # below 1e-5, logits / T overflow fp32: use 0 (greedy)
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 16, 256, 64


@dataclass
class SamplingParams:
    """What to generate. temperature 0 = greedy; top_k 0 or -1 = off; top_p 1 = off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the bad field. Every number must be finite and in range, and every
        size bounded, before any work is done for the request."""
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not 0 < len(s) <= MAX_STOP_LENGTH:
                raise ValueError(f"stop: each stop string needs 1 to {MAX_STOP_LENGTH} characters, got {len(s)}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
