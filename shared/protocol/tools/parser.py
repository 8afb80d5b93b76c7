"""A streaming parser of the model's output: plain content and OpenAI-style tool-call deltas out of the DSML
blocks the model writes (held back while a tag may be starting, so no piece of a tag reaches the content)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.protocol.tools.dsml import (
    CALLS_LEAD,
    DSML,
    FUNCTION_CALLS_CLOSE,
    FUNCTION_CALLS_OPEN,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    ToolCall,
    ToolFunction,
    to_json,
)


@dataclass
class ToolCallDelta:
    """A piece of call `index`: `name` on its first delta only; `arguments_delta` is the next piece of
    the arguments' JSON text (the pieces of one call concatenate to its `arguments`)."""

    index: int
    name: str = ""
    arguments_delta: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def _text(self, s: str) -> None:
        if s:
            self.content += s

    def _call(self, index: int, args: str, name: str = "") -> None:
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == index and not name:
            last.arguments_delta += args
        elif args or name:
            self.tool_calls.append(ToolCallDelta(index, name, args))


_TEXT, _BLOCK, _INVOKE, _STRING, _VALUE, _PASS = range(6)
_INVOKE_TAG = re.compile(rf'<{DSML}invoke name="([^"]*)">')
_PARAM_TAG = re.compile(rf'<{DSML}parameter name="([^"]*)"(?: string="(true|false)")?>')
_BLOCK_MARKERS = (CALLS_LEAD + FUNCTION_CALLS_OPEN, "\n" + FUNCTION_CALLS_OPEN, FUNCTION_CALLS_OPEN)
_MAX_TAG = 512  # a tag's text held while waiting for its '>'; longer is not a tag


def _held(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buf` that may be the start of one of `markers`."""
    for k in range(min(len(buf), max(map(len, markers)) - 1), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def _escape(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


def _reject_constant(name: str) -> None:
    raise ValueError(name)


def _json_value(raw: str) -> str:
    """A string="false" value → its JSON text (kept as written, as DeepSeek's decoder); text that is
    not JSON (NaN and Infinity included) becomes a JSON string, so the arguments always parse."""
    text = raw.strip()
    try:
        json.loads(text, parse_constant=_reject_constant)
        return text
    except ValueError:
        return to_json(raw)


class ToolCallParser:
    """Streams a reply's answer text (in thinking mode: the part after `</think>`) into plain content
    and OpenAI-style tool-call deltas.

    * Text that may be the start of `\\n\\n<｜DSML｜function_calls>` is held back until it is decided,
      so no piece of a tag reaches `content`; the `\\n\\n` before a block belongs to the block.
    * A call's name is emitted when its invoke tag is complete (and known: in `tools`, when given);
      then `{`, each parameter's `"key": ` and its value — a string="true" value streamed as JSON string
      text while it arrives, another value when its closing tag arrives — and `}` at `</｜DSML｜invoke>`.
    * Anything that does not follow the format (an unknown function name, text or another tag where a
      tag must be, a repeated parameter, a block left open at the end) ends tool parsing: the open
      call, if any, is closed so its arguments parse, and the rest — from the start of the block when
      no call of it was emitted yet, else from the offending text — is content, as is everything
      after. Nothing the model wrote is dropped and no call names a function the client lacks.
    * A string="false" value that is not JSON becomes a JSON string of its text.
    * A reply cut inside a value (max_tokens) keeps the value's text up to the cut, less a closing
      `</｜DSML｜parameter>` tag cut short: no piece of a tag reaches the arguments.
    """

    def __init__(self, tools: Sequence[ToolFunction] | None = None):
        self._names = None if tools is None else {t.name for t in tools}
        self._state = _TEXT
        self._buf = ""
        self._raw = ""  # block text not yet represented by an emitted call: content if we give up
        self._value = ""
        self._index = 0
        self._params: set[str] = set()
        self._finished = False

    @property
    def calls_emitted(self) -> int:
        """How many calls have been started so far."""
        return self._index + (self._state in (_INVOKE, _STRING, _VALUE))

    def feed(self, text: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("ToolCallParser.feed after finish")
        self._buf += text
        out = ParsedDelta()
        self._run(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        """The end of the reply: releases held text and closes whatever is open."""
        out = ParsedDelta()
        if not self._finished:
            self._finished = True
            self._run(out, final=True)
        return out

    # -- the state machine --------------------------------------------------------------------------

    def _run(self, out: ParsedDelta, final: bool) -> None:
        while True:
            state = self._state
            if state == _TEXT:
                more = self._text(out, final)
            elif state in (_BLOCK, _INVOKE):
                more = self._tag(out, final)
            elif state in (_STRING, _VALUE):
                more = self._value_text(out, final)
            else:
                out._text(self._buf)
                self._buf, more = "", False
            if not more:
                return

    def _text(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        p = buf.find(FUNCTION_CALLS_OPEN)
        if p >= 0:
            before = buf[:p]
            lead = CALLS_LEAD if before.endswith(CALLS_LEAD) else ""
            out._text(before[: len(before) - len(lead)])
            self._raw = lead + FUNCTION_CALLS_OPEN
            self._buf = buf[p + len(FUNCTION_CALLS_OPEN):]
            self._state = _BLOCK
            return True
        keep = 0 if final else _held(buf, _BLOCK_MARKERS)
        out._text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _tag(self, out: ParsedDelta, final: bool) -> bool:
        """Between tags: whitespace, then the next tag (a whole one, up to its '>')."""
        buf = self._buf
        rest = buf.lstrip()
        in_block = self._state == _BLOCK
        openings = (INVOKE_OPEN, FUNCTION_CALLS_CLOSE) if in_block else (PARAMETER_OPEN, INVOKE_CLOSE)
        if not rest:
            if final:
                self._give_up(out)
            return False
        end = rest.find(">")
        if not rest.startswith("<") or (end < 0 and (
                final or len(rest) > _MAX_TAG
                or not any(o.startswith(rest) or rest.startswith(o) for o in openings))):
            self._give_up(out)
            return False
        if end < 0:
            return False  # the tag is still arriving
        tag, after = rest[: end + 1], rest[end + 1:]
        if in_block:
            if tag == FUNCTION_CALLS_CLOSE:
                self._raw, self._buf, self._state = "", after, _TEXT
                return True
            m = _INVOKE_TAG.fullmatch(tag)
            if not m or (self._names is not None and m[1] not in self._names):
                self._give_up(out)
                return False
            out._call(self._index, "{", name=m[1])
            self._raw, self._buf, self._state, self._params = "", after, _INVOKE, set()
            return True
        if tag == INVOKE_CLOSE:
            out._call(self._index, "}")
            self._index += 1
            self._buf, self._state = after, _BLOCK
            return True
        m = _PARAM_TAG.fullmatch(tag)
        if not m or m[1] in self._params:
            self._give_up(out)
            return False
        sep = ", " if self._params else ""
        self._params.add(m[1])
        string = m[2] == "true"
        out._call(self._index, f'{sep}{to_json(m[1])}: ' + ('"' if string else ""))
        self._buf, self._value, self._state = after, "", (_STRING if string else _VALUE)
        return True

    def _value_text(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        p = buf.find(PARAMETER_CLOSE)
        piece, rest = (buf[:p], buf[p + len(PARAMETER_CLOSE):]) if p >= 0 else (buf, "")
        keep = 0 if p >= 0 else _held(buf, (PARAMETER_CLOSE,))  # at the end: a closing tag cut short, dropped
        piece, held = piece[: len(piece) - keep], piece[len(piece) - keep:]
        if self._state == _STRING:
            out._call(self._index, _escape(piece) + ('"' if p >= 0 else ""))
        else:
            self._value += piece
            if p >= 0:
                out._call(self._index, _json_value(self._value))
        if p >= 0:
            self._buf, self._state = rest, _INVOKE
            return True
        self._buf = "" if final else held
        if final:
            self._give_up(out)
        return False

    def _give_up(self, out: ParsedDelta) -> None:
        """Not the format (or the end came inside a block): close the open call; the rest is content."""
        state = self._state
        if state == _STRING:
            out._call(self._index, '"}')
        elif state == _VALUE:
            out._call(self._index, _json_value(self._value) + "}")
        elif state == _INVOKE:
            out._call(self._index, "}")
        if state in (_STRING, _VALUE, _INVOKE):
            self._index += 1
        rest = self._raw + self._buf
        if not (self._finished and not rest.strip()):  # a block left open after its calls: no content
            out._text(rest)
        self._raw, self._buf, self._state = "", "", _PASS


def parse_tool_calls(text: str, tools: Sequence[ToolFunction] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole reply's answer text → (content, calls), through ToolCallParser (same rules)."""
    parser = ToolCallParser(tools)
    content, names, args = "", [], []
    for delta in (parser.feed(text), parser.finish()):
        content += delta.content
        for d in delta.tool_calls:
            if d.index == len(names):
                names.append(d.name)
                args.append("")
            args[d.index] += d.arguments_delta
    return content, [ToolCall(n, a) for n, a in zip(names, args)]
