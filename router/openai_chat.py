"""`POST /v1/chat/completions`' response: its choices, whole (an assistant message with its reasoning and
tool calls) or streamed (the role first, then deltas), with the chat API's logprobs object. The request side
(messages, tools, tool_choice) is router.openai_models' chat_request and call_rules."""

from __future__ import annotations

from typing import Any

from router.openai_choices import Choice, TokenText, call_deltas
from shared.rpc.pdserve.v1 import generation_pb2


class ChatFormat:
    """A /v1/chat/completions response's choices."""

    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tokens: TokenText):
        self.tokens = tokens

    def opening(self, count: int) -> list[dict[str, Any]]:
        """Each sample's first chunk: the assistant's role, before any of its messages."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(count)]

    def chunk(self, index: int, msg: generation_pb2.GenerateResponse) -> dict[str, Any]:
        delta: dict[str, Any] = {k: v for k, v in (("reasoning_content", msg.reasoning_text), ("content", msg.text))
                                 if v}
        if msg.tool_calls:
            delta["tool_calls"] = call_deltas(msg.tool_calls)
        return {"index": index, "delta": delta, "finish_reason": msg.finish_reason or None,
                "logprobs": self._logprobs(list(msg.logprobs))}

    def prompt_only(self, index: int) -> bool:
        return False

    def whole(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [{"index": i, "finish_reason": c.finish_reason, "logprobs": self._logprobs(c.logprobs),
                 "message": {"role": "assistant", "content": c.text or None if c.tool_calls else c.text,
                             "reasoning_content": c.reasoning or None,
                             **({"tool_calls": c.tool_calls} if c.tool_calls else {})}}
                for i, c in enumerate(choices)]

    def _logprobs(self, lps: list[generation_pb2.TokenLogprob]) -> dict[str, Any] | None:
        """The chat API's logprobs object: content, one entry per token with its top alternatives."""
        if not lps:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokens.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}
                            for lp in lps]}


__all__ = ["ChatFormat"]
