"""What a request asks to generate, and the bounds every request is held to (checked before any work,
in the router as in the engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.protocol.structured import StructuredOutput

# Bounds every request is held to (a request beyond them is refused before any work).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 100.0  # below 1e-5, logits / T overflow fp32: use 0 (greedy)
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 16, 256, 64
MAX_PENALTY = 2.0  # presence / frequency penalties in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty in (0, 10] (1 = off; HF / vLLM semantics)
MAX_LOGIT_BIAS_ENTRIES, MAX_LOGIT_BIAS = 300, 100.0  # OpenAI's limits: 300 tokens, biases in [-100, 100]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


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
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    repetition_penalty: float = 1.0  # logits of prompt and generated tokens: / p when > 0, × p when < 0
    min_p: float = 0.0  # drop tokens whose probability is below min_p × the most likely token's
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit
    logprobs: int | None = None  # each generated token's log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # each prompt token's (after the first) log-probability and alternatives
    structured: StructuredOutput | None = None  # what the output must match (shared.protocol.structured)

    def validate(self) -> None:
        """Raise ValueError naming the bad field. Every number must be finite and in range, and every
        size bounded, before any work is done for the request."""
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_p"):
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            if asked is not None and not 0 <= asked <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {asked}")
        if self.structured is not None:
            self.structured.validate()
        for token, bias in self.logit_bias.items():
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-{MAX_LOGIT_BIAS}, "
                                 f"{MAX_LOGIT_BIAS}], got {bias}")

    @property
    def exact_history_needed(self) -> bool:
        """Sampling reads what MTP's drafted positions cannot give exactly: the token history (logits
        processors) or each position's own distribution (logprobs; prompt logprobs, which need every
        prompt position's logits where MTP's verification takes the last ones)."""
        return self.processes_logits or self.logprobs is not None or self.prompt_logprobs is not None

    @property
    def processes_logits(self) -> bool:
        """The logits are changed before sampling (penalties, bias, min_p, min_tokens): the token history
        matters, which MTP's drafted positions cannot provide exactly."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.min_p or self.min_tokens or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's own distribution (the log-softmax of the
    raw logits, before penalties, bias and temperature: vLLM's default "raw" logprobs) and the
    `logprobs` most likely tokens of that position, best first."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
