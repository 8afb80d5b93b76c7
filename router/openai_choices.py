"""The choices of an OpenAI response as the samples' messages build them: a whole choice gathered message by
message, a streamed one's tool-call deltas, the samples' streams merged as their messages come, an echoed
prompt before a completion, the response's usage (each prompt counted once), and token ids as text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.openai_errors import HttpAbort
from router.openai_fanout import prompt_usage
from router.reply import api_finish_reason
from shared.protocol.finish import FinishReason
from shared.protocol.tokenizer import Tokenizer
from shared.rpc.pdserve.v1 import generation_pb2


class TokenText:
    """Token ids as the logprobs objects and an echoed prompt show them (special tokens kept; a model
    without a tokenizer shows `token_id:N` and echoes no text)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        tok = self.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def text(self, ids: list[int]) -> str:
        tok = self.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None and ids else ""


@dataclass
class OpenStream:
    """One sample's running request: its first message (None: it ended before any) and the rest."""

    first: generation_pb2.GenerateResponse | None
    events: AsyncGenerator[generation_pb2.GenerateResponse, None]


@dataclass
class Echo:
    """/v1/completions with `echo`: the prompt comes back before the completion (its tokens' logprobs
    too, with `logprobs`); with max_tokens 0 only the prompt (one token is generated and dropped)."""

    text: str
    prompt_only: bool


@dataclass
class Choice:
    """One sample's output, gathered from its messages."""

    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)  # with echo and logprobs
    prompt_logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat: OpenAI's tool_calls, made whole

    def add(self, msg: generation_pb2.GenerateResponse) -> None:
        """The next message of the sample."""
        self.reasoning += msg.reasoning_text
        self.text += msg.text
        self.add_calls(msg.tool_calls)
        self.token_ids += msg.token_ids
        self.logprobs += msg.logprobs
        self.prompt_token_ids += msg.prompt_token_ids
        self.prompt_logprobs += msg.prompt_logprobs
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.prompt_tokens, self.completion_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
            self.cached_tokens = msg.usage.cached_prompt_tokens

    def add_calls(self, deltas: Sequence[generation_pb2.ToolCallDelta]) -> None:
        for d in deltas:
            if d.index == len(self.tool_calls):
                self.tool_calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            self.tool_calls[d.index]["function"]["arguments"] += d.arguments_delta


def spent(msg: generation_pb2.GenerateResponse, prompt_only: bool = False) -> Choice:
    """A sample's usage from its last message (an echo-only completion generated nothing the client sees)."""
    return Choice(prompt_tokens=msg.usage.prompt_tokens, cached_tokens=msg.usage.cached_prompt_tokens,
                  completion_tokens=0 if prompt_only else msg.usage.completion_tokens)


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """OpenAI's usage of a response whose choices are `n` samples of each prompt: each prompt counted once."""
    return prompt_usage([c.prompt_tokens for c in choices], [c.cached_tokens for c in choices],
                        [c.completion_tokens for c in choices], n)


@dataclass(frozen=True)
class CallRules:
    """What a chat request allows of the reply's tool calls: `single` (parallel_tool_calls: false) keeps the
    first call only, as vLLM does; `forced` (tool_choice required or a function's name): the grammar makes
    the answer nothing but calls, so any content is a call tag cut short by max_tokens and is dropped."""

    single: bool = False
    forced: bool = False

    @property
    def active(self) -> bool:
        return self.single or self.forced

    def apply(self, msg: generation_pb2.GenerateResponse) -> None:
        if self.forced:
            msg.text = ""
        if self.single and any(d.index > 0 for d in msg.tool_calls):
            kept = [d for d in msg.tool_calls if d.index == 0]
            del msg.tool_calls[:]
            msg.tool_calls.extend(kept)


def call_deltas(deltas: Sequence[generation_pb2.ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed tool-call pieces as OpenAI's delta.tool_calls (id, type and name on a call's first piece)."""
    out = []
    for d in deltas:
        entry: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments_delta}}
        if d.id:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        out.append(entry)
    return out


async def merged(streams: list[OpenStream]
                 ) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse | HttpAbort]]:
    """(sample index, message or the error that ended it) of every sample as they come; one sample is
    read directly (no task and queue per token). Closing this closes every sample's request."""
    async def each(stream: OpenStream) -> AsyncIterator[generation_pb2.GenerateResponse | HttpAbort]:
        msg = stream.first
        try:
            while msg is not None:
                yield msg
                msg = await anext(stream.events, None)
        except HttpAbort as exc:
            yield exc

    if len(streams) == 1:
        try:
            async for msg in each(streams[0]):
                yield 0, msg
        finally:
            await streams[0].events.aclose()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: OpenStream) -> None:
        try:
            async for msg in each(stream):
                await merged.put((index, msg))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            index, msg = await merged.get()
            if msg is None:
                live -= 1
            else:
                yield index, msg
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.events.aclose()


def echo(choice: Choice, echo: Echo) -> None:
    """The prompt before the completion (max_tokens 0: instead of it, the one token generated dropped)."""
    if echo.prompt_only:
        choice.text, choice.token_ids, choice.logprobs, choice.completion_tokens = "", [], [], 0
        if choice.finish_reason:
            choice.finish_reason = api_finish_reason(FinishReason.LENGTH)
    choice.text = echo.text + choice.text
