"""The bounds of one model's requests, checked in one place: the router (before any work reaches an
instance), each service's gRPC front (once per request: its engine trusts what it admits), the offline
engine API and the decode service's reservations all ask the same `RequestLimits`, so a request refused
by one is refused by all with the same words."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.protocol.sampling import SamplingParams

MAX_CACHE_SALT = 256  # characters of a request's cache_salt (vLLM's field; a tenant's prefix-cache namespace)


def check_cache_salt(cache_salt: str) -> None:
    """Raise ValueError naming cache_salt when it is longer than MAX_CACHE_SALT or not text (a lone
    surrogate from a JSON body: no UTF-8 bytes to hash)."""
    if len(cache_salt) > MAX_CACHE_SALT:
        raise ValueError(f"cache_salt: at most {MAX_CACHE_SALT} characters, got {len(cache_salt)}")
    try:
        cache_salt.encode()
    except UnicodeEncodeError:
        raise ValueError("cache_salt: not valid Unicode text (a lone surrogate)") from None


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens."""
    return (num_tokens + block_size - 1) // block_size


@dataclass(frozen=True)
class RequestLimits:
    """`context_tokens` (the model's max_position_embeddings), its vocabulary, and where known (on an
    engine, not in the router) the KV blocks one request may hold."""

    context_tokens: int
    vocab_size: int
    block_size: int = 0
    kv_blocks: int = 0  # 0: not known here
    speculative: bool = False  # the engine drafts (MTP): requests that need an exact token history are refused

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams, num_resumed: int = 0,
                      cache_salt: str = "") -> None:
        """Raise ValueError naming the offending field of a request an engine would run (its sampling
        parameters already `validate()`d): the prompt, a migrated request's resumed outputs, the length,
        the sampling token ids, the cache salt, and what a speculative engine cannot do exactly."""
        self.check_prompt_ids(prompt_ids)
        check_cache_salt(cache_salt)
        if not 0 <= num_resumed < min(len(prompt_ids), params.max_tokens):
            raise ValueError(f"num_resumed: {num_resumed} earlier outputs do not fit a {len(prompt_ids)}-token "
                             f"prompt with max_tokens {params.max_tokens}")
        self.check_length(len(prompt_ids) - num_resumed, params.max_tokens)
        self.check_sampling(params)
        if self.speculative and params.exact_history_needed:
            raise ValueError("presence_penalty / frequency_penalty / repetition_penalty / min_p / min_tokens / "
                             "logit_bias / logprobs / prompt_logprobs: not supported with --speculative mtp (a drafted "
                             "position's token history and distribution would not be exact)")

    def check_prompt_ids(self, ids: Sequence[int], field: str = "prompt_token_ids") -> None:
        """Raise ValueError naming `field` for an empty prompt, one longer than the context or a token id
        outside the vocabulary."""
        if not ids:
            raise ValueError(f"{field} must not be empty")
        if len(ids) > self.context_tokens:
            raise ValueError(f"{field}: {len(ids)} tokens exceed the model's context of {self.context_tokens}")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        """Raise ValueError naming `field` for a token id outside the vocabulary (stop_token_ids,
        logit_bias keys)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def check_sampling(self, params: SamplingParams) -> None:
        """The sampling parameters' token ids (stop_token_ids, logit_bias keys) are in the vocabulary."""
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias), "logit_bias")

    def check_length(self, num_prompt_tokens: int, max_tokens: int, field: str = "max_tokens") -> None:
        """Raise ValueError naming `field` when prompt + max_tokens does not fit the context, or needs
        more KV blocks than a rank's pool has (a request that could never be served, not an overload)."""
        if num_prompt_tokens <= 0 or max_tokens <= 0:
            raise ValueError(f"{field}: the prompt and max_tokens must be > 0 tokens")
        total = num_prompt_tokens + max_tokens
        if total > self.context_tokens:
            raise ValueError(f"{field}: prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the model's context of {self.context_tokens}")
        if self.kv_blocks and blocks_for(total, self.block_size) > self.kv_blocks:
            raise ValueError(f"{field}: prompt + max_tokens needs {blocks_for(total, self.block_size)} KV blocks, "
                             f"a rank's pool has {self.kv_blocks}")
