"""`POST /v1/completions`: its prompts as the router's GenerateRequests (a string, token ids, or a list of
either; `echo` brings the prompt back before the completion) and its response's choices, whole or streamed,
with the legacy API's logprobs object."""

from __future__ import annotations

import itertools
from typing import Any

import grpc

from router.openai_choices import Choice, Echo, TokenText, echo
from router.openai_errors import HttpAbort
from router.openai_limits import COMPLETION_MAX_TOKENS, check_prompts
from router.openai_models import CompletionRequest, sampling, sla
from shared.rpc.pdserve.v1 import generation_pb2


def completion_requests(body: CompletionRequest, tokens: TokenText, max_prompts: int, max_in_flight: int
                        ) -> tuple[list[generation_pb2.GenerateRequest], list[Echo] | None]:
    """One GenerateRequest per prompt, and with `echo` each prompt's text to lead its choices (max_tokens 0:
    the prompt only, one token generated and dropped)."""
    prompts = _prompts(body.prompt)
    check_prompts(len(prompts), body.n, max_prompts, max_in_flight)
    prompt_only = body.max_tokens == 0
    if prompt_only and not body.echo:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be > 0 (0 only with echo)", "max_tokens")
    sp = sampling(body, 1 if prompt_only else COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens)
    reqs = [generation_pb2.GenerateRequest(sampling_params=sp, priority=body.priority, sla=sla(body),
                                           cache_salt=body.cache_salt or "", **p)
            for p in prompts]
    echoes = [Echo(r.prompt or tokens.text(list(r.prompt_token_ids)), prompt_only) for r in reqs] \
        if body.echo else None
    return reqs, echoes


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if not prompt:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty", "prompt")
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


class CompletionFormat:
    """A /v1/completions response's choices: `echoes` (one per sample, None without echo) lead each
    sample's text, on its first chunk only when streamed."""

    kind = "text_completion"
    chunk_kind = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokens: TokenText, echoes: list[Echo | None]):
        self.tokens, self.echoes = tokens, echoes

    def opening(self, count: int) -> list[dict[str, Any]]:
        """Chunks before any sample's first message: none for completions."""
        return []

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse) -> dict[str, Any]:
        piece = Choice(msg.text, finish_reason=msg.finish_reason or None, completion_tokens=msg.usage.completion_tokens,
                       logprobs=list(msg.logprobs), prompt_token_ids=list(msg.prompt_token_ids),
                       prompt_logprobs=list(msg.prompt_logprobs))
        if (lead := self.echoes[index]) is not None:
            echo(piece, lead)
            self.echoes[index] = Echo("", lead.prompt_only)  # the prompt leads the first chunk only
        return {"index": index, "text": piece.text, "finish_reason": piece.finish_reason,
                "logprobs": self._logprobs(piece.logprobs, piece.prompt_token_ids, piece.prompt_logprobs)}

    def prompt_only(self, index: int) -> bool:
        lead = self.echoes[index]
        return lead is not None and lead.prompt_only

    def whole(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """The choices of a whole response (the echoed prompts put before them first: usage counts that)."""
        for choice, lead in zip(choices, self.echoes, strict=True):
            if lead is not None:
                echo(choice, lead)
        return [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                 "logprobs": self._logprobs(c.logprobs, c.prompt_token_ids, c.prompt_logprobs)}
                for i, c in enumerate(choices)]

    def _logprobs(self, lps: list[generation_pb2.TokenLogprob], prompt_ids: list[int] | None = None,
                  prompt_lps: list[generation_pb2.TokenLogprob] | None = None) -> dict[str, Any] | None:
        """The completions API's logprobs object (tokens, token_logprobs, top_logprobs, text_offset); an
        echoed prompt's tokens first, its first token's logprob null (nothing comes before it)."""
        entries: list[tuple[int, generation_pb2.TokenLogprob | None]] = [(prompt_ids[0], None)] if prompt_ids else []
        entries += [(lp.token_id, lp) for lp in (*(prompt_lps or ()), *lps)]
        if not entries:
            return None
        token = self.tokens.token
        texts = [token(t) for t, _ in entries]
        offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=0))
        return {"tokens": texts, "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
                "text_offset": offsets,
                "top_logprobs": [{token(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)} if lp else None
                                 for _, lp in entries]}


__all__ = ["CompletionFormat", "completion_requests"]
