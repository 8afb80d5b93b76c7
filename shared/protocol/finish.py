"""Why a request's generation ended: decided once, in the engine (shared.engine.llm), carried as its
wire word on every internal hop, and mapped to an API's words only at the router's front."""

from __future__ import annotations

import enum


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS token, a stop token id, a stop string, or a grammar that completed
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the caller or the service let it go (cancel, deadline, drain) before it ended
    ERROR = "error"  # the engine failed this request (it alone failed a step)

    @classmethod
    def from_wire(cls, word: str) -> FinishReason | None:
        """A hop's `finish_reason` string: "" (not finished) is None; an unknown word is a ValueError."""
        return cls(word) if word else None


def wire(reason: FinishReason | None) -> str:
    """The word a hop sends ("" while the request goes on)."""
    return reason.value if reason is not None else ""


__all__ = ["FinishReason", "wire"]
