"""A chat reply as the client receives it: thinking mode's reasoning apart from the answer, and the
answer's DeepSeek-V3.2 tool calls parsed into OpenAI-shaped call deltas, streamed piece by piece. One
parser per request, on the router's single request path, so the gRPC and HTTP APIs return the same."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol.chat import SPECIAL_TOKENS, THINK_END
from shared.protocol.finish import FinishReason, wire
from shared.protocol.tools import ToolCallDelta, ToolCallParser, ToolFunction

TOOL_CALLS = "tool_calls"  # the API's finish reason of a reply that ended by calling tools


def api_finish_reason(reason: FinishReason | None, called: bool = False) -> str:
    """The one place a hop's finish reason becomes the API's word (gRPC and HTTP alike): a reply that
    stopped after making tool calls (`called`) finished with "tool_calls"; "" while it goes on."""
    if reason is FinishReason.STOP and called:
        return TOOL_CALLS
    return wire(reason)


@dataclass(frozen=True)
class ReplyShape:
    """How one request's reply is parsed (decided when it is validated): thinking mode's reasoning apart,
    the tools it may call (None: no tool parsing), a forced call (tool_choice required or a name)."""

    thinking: bool = False
    tools: tuple[ToolFunction, ...] | None = None
    forced: bool = False

    @property
    def parses(self) -> bool:
        """Whether the text is rewritten at all (the engine must then keep special tokens)."""
        return self.thinking or self.tools is not None

    def parser(self) -> ReplyParser:
        return ReplyParser(self.thinking, self.tools, forced=self.forced)


@dataclass
class ReplyDelta:
    """The next piece of a reply: reasoning text, answer text, and tool-call pieces (`ids[i]` is the id
    of call `tool_calls[i].index`, on its first piece only)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)


class ReasoningSplitter:
    """Thinking-mode output streamed apart: text before `</think>` is reasoning, after it the answer.
    A tail that could be the start of `</think>` is held back until the next piece decides it."""

    def __init__(self) -> None:
        self.in_reasoning = True
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) deltas of `text`."""
        text, self.pending = self.pending + text, ""
        if not self.in_reasoning:
            return "", text
        head, sep, tail = text.partition(THINK_END)
        if sep:
            self.in_reasoning = False
            return head, tail
        keep = next((k for k in range(min(len(THINK_END) - 1, len(text)), 0, -1)
                     if THINK_END.startswith(text[-k:])), 0) if not final else 0
        self.pending = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""


class ReplyParser:
    """One request's output text → ReplyDelta pieces. With neither thinking nor tools the text passes
    as it is; otherwise the router asked the engine to keep special tokens (to find `</think>` and the
    end of the calls) and they are taken out here. `forced` (tool_choice required or a function's name:
    a grammar makes the answer nothing but calls): the answer has no content, so a reply cut by
    max_tokens inside a call tag leaks no piece of it."""

    def __init__(self, thinking: bool, tools: Sequence[ToolFunction] | None, forced: bool = False):
        self.splitter = ReasoningSplitter() if thinking else None
        self.tools = ToolCallParser(tools) if tools is not None else None
        self.forced = forced  # a forced call (tool_choice required / a name): the answer is calls only
        self.call_ids: dict[int, str] = {}

    @property
    def parses(self) -> bool:
        """Whether the text is rewritten at all (special tokens kept by the engine and stripped here)."""
        return self.splitter is not None or self.tools is not None

    def feed(self, text: str, final: bool = False) -> ReplyDelta:
        if not self.parses:
            return ReplyDelta(content=text)
        reasoning, content = self.splitter.feed(text, final) if self.splitter else ("", text)
        out = ReplyDelta(_visible(reasoning), _visible(content))
        if self.tools is not None:
            parsed = self.tools.feed(out.content)
            if final:
                rest = self.tools.finish()
                parsed.content += rest.content
                parsed.tool_calls += rest.tool_calls
            # a forced call's grammar leaves no room for content: any is a call tag cut short by max_tokens
            out.content, out.tool_calls = "" if self.forced else parsed.content, parsed.tool_calls
            for delta in out.tool_calls:
                new = delta.index not in self.call_ids
                if new:
                    self.call_ids[delta.index] = f"call_{uuid.uuid4().hex[:24]}"
                out.ids.append(self.call_ids[delta.index] if new else "")
        return out

    @property
    def called(self) -> bool:
        """Whether the reply made a tool call (its finish reason is then `tool_calls`)."""
        return bool(self.call_ids)


def _visible(text: str) -> str:
    """Text without the chat encoding's special tokens (an EOS at the end of a reply, `<think>`)."""
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text
