"""DeepSeek-V3.2 tool calling: the DSML format of the prompt and of the model's calls, a streaming
parser for the model's output, and an llguidance grammar that forces calls (tool_choice "required" or
a named function). Torch-free, like the rest of shared.protocol.

The format, from DeepSeek's V3.2 release (`encoding/encoding_dsv32.py` and its test data
`test_input.json` → `test_output.txt`):
* the tools go into the system prompt: `\\n\\n` + the "## Tools" instructions below, one JSON line per
  function (`{"name", "description", "parameters"}` as `json.dumps`, non-ASCII kept) inside
  `<functions>…</functions>`;
* an assistant turn's calls follow its content as `\\n\\n<｜DSML｜function_calls>\\n{invokes}\\n
  </｜DSML｜function_calls>`, invokes joined by `\\n`, each `<｜DSML｜invoke name="NAME">\\n{params}\\n
  </｜DSML｜invoke>`, params joined by `\\n` in the arguments' key order, each
  `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`: a JSON string is
  written raw with string="true", any other value as JSON text (`json.dumps`) with string="false";
* decoding turns a string="true" value into a JSON string and keeps a string="false" value's text as
  the JSON value: the arguments are `{"k": v, "k2": v2}` (json.dumps separators).
Chat-level rules (tool results, thinking) are in chat.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DSML = "｜DSML｜"  # fullwidth bars (U+FF5C); plain text, not a special token
FUNCTION_CALLS_OPEN = f"<{DSML}function_calls>"
FUNCTION_CALLS_CLOSE = f"</{DSML}function_calls>"
INVOKE_OPEN, INVOKE_CLOSE = f'<{DSML}invoke name="', f"</{DSML}invoke>"  # open: + name + '">'
PARAMETER_OPEN = f'<{DSML}parameter name="'  # + name + '" string="true|false">'
PARAMETER_CLOSE = f"</{DSML}parameter>"
CALLS_LEAD = "\n\n"  # between an assistant's content and its calls
RESULTS_OPEN, RESULTS_CLOSE = "\n\n<function_results>", "\n</function_results>"
RESULT = "\n<result>{}</result>"

# DeepSeek's tool instructions, word for word (the model was trained on exactly this text).
_TOOLS_TEMPLATE = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<@function_calls>" block like the following as part of your reply to the user:
<@function_calls>
<@invoke name="$FUNCTION_NAME">
<@parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</@parameter>
...
</@invoke>
<@invoke name="$FUNCTION_NAME2">
...
</@invoke>
</@function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and \
objects should use JSON format. The "string" attribute should be set to "true" for string type parameters \
and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a \
thinking block. Here is an example:

<@function_calls>
...
</@function_calls>

<function_results>
...
</function_results>

<think>...thinking about results</think>

Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
""".replace("@", DSML)

_Q = '"'
_BAD_NAME_CHARS = re.compile(r'["<>\n]')


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class ToolFunction:
    """An OpenAI function tool: `parameters` is the JSON schema of its arguments object."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tool: Mapping, where: str = "tool") -> ToolFunction:
        """`{"type": "function", "function": {...}}` or the bare function object → a ToolFunction;
        ValueError naming the field."""
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where}: must be an object")
        if "function" in tool or "type" in tool:
            if tool.get("type", "function") != "function":
                raise ValueError(f"{where}.type: only 'function' tools are supported, got {tool.get('type')!r}")
            tool, where = tool.get("function"), f"{where}.function"
            if not isinstance(tool, Mapping):
                raise ValueError(f"{where}: must be an object")
        name, description = tool.get("name"), tool.get("description") or ""
        parameters = tool.get("parameters") or {}
        if not isinstance(name, str):
            raise ValueError(f"{where}.name: must be a string")
        if not isinstance(description, str):
            raise ValueError(f"{where}.description: must be a string")
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.parameters: must be a JSON schema object")
        fn = cls(name, description, dict(parameters))
        fn.validate(where)
        return fn

    def validate(self, where: str = "tool") -> None:
        if not self.name or _BAD_NAME_CHARS.search(self.name):
            raise ValueError(f"{where}.name: must be non-empty without '\"', '<', '>' or newlines, got {self.name!r}")
        if not isinstance(self.parameters, Mapping):
            raise ValueError(f"{where}.parameters: must be a JSON schema object")

    def schema_line(self) -> str:
        """This function's line in the prompt's <functions> list (an empty description or parameters
        object is left out, as an OpenAI request that omits them)."""
        d: dict[str, Any] = {"name": self.name}
        if self.description:
            d["description"] = self.description
        if self.parameters:
            d["parameters"] = self.parameters
        return _to_json(d)


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made: `arguments` is the JSON object text (as OpenAI); `id` is the
    OpenAI tool_call id (not part of the prompt)."""

    name: str
    arguments: str
    id: str = ""

    @classmethod
    def from_openai(cls, call: Mapping) -> ToolCall:
        """`{"id", "type": "function", "function": {"name", "arguments"}}` (or a flat `{name,
        arguments}`) → a ToolCall; arguments given as an object are serialized."""
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        if not isinstance(fn, Mapping):
            fn = {}
        args = fn.get("arguments", "")
        if isinstance(args, Mapping):
            args = _to_json(args)
        return cls(str(fn.get("name") or ""), args if isinstance(args, str) else _to_json(args),
                   str(call.get("id") or "") if isinstance(call, Mapping) else "")

    def arguments_object(self, where: str = "tool_call") -> dict:
        """The arguments as a dict; ValueError naming `{where}.function.arguments` if they are not a
        JSON object."""
        try:
            args = json.loads(self.arguments)
        except (TypeError, ValueError):
            args = None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.function.arguments: not a JSON object: {self.arguments[:80]!r}")
        return args


def render_tools(tools: Sequence[ToolFunction]) -> str:
    """The "## Tools" system-prompt section for `tools` (without the `\\n\\n` before it)."""
    return _TOOLS_TEMPLATE.replace("{schemas}", "\n".join(t.schema_line() for t in tools))


def render_tool_calls(calls: Sequence[ToolCall], where: str = "tool_calls") -> str:
    """The `<｜DSML｜function_calls>` block for an assistant turn's calls (without the `\\n\\n` before it)."""
    invokes = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        if not call.name or _BAD_NAME_CHARS.search(call.name):
            raise ValueError(f"{w}.function.name: must be non-empty without '\"', '<', '>' or newlines, "
                             f"got {call.name!r}")
        params = [f'{PARAMETER_OPEN}{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f"{v if isinstance(v, str) else _to_json(v)}{PARAMETER_CLOSE}"
                  for k, v in call.arguments_object(w).items()]
        invokes.append(f'{INVOKE_OPEN}{call.name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return FUNCTION_CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + FUNCTION_CALLS_CLOSE


# ---------------------------------------------------------------------------------------------------
# Parsing the model's output


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
        return _to_json(raw)


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
        out._call(self._index, f'{sep}{_to_json(m[1])}: ' + ('"' if string else ""))
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


# ---------------------------------------------------------------------------------------------------
# Forcing calls: an llguidance (Lark) grammar

# JSON values as DeepSeek's encoder writes them (json.dumps separators), so forced output looks like
# the training data; `lenient` lets schema keywords llguidance does not implement pass.
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False, "lenient": True}


def _lit(s: str) -> str:
    """A Lark string literal (JSON escapes are valid Lark escapes)."""
    return json.dumps(s, ensure_ascii=False)


def _schema_kinds(schema: Any) -> tuple[bool, bool]:
    """Which forms a value of `schema` may take: (raw string="true" text, string="false" JSON)."""
    if not isinstance(schema, Mapping):
        return True, True
    t = schema.get("type")
    if isinstance(t, str):
        return t == "string", t != "string"
    if isinstance(t, list) and t:
        return "string" in t, any(x != "string" for x in t)
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        strings = sum(isinstance(v, str) for v in values)
        return strings > 0, strings < len(values)
    return True, True


def _string_choices(schema: Any) -> list[str] | None:
    """The exact strings allowed by an enum / const of strings, else None (any text)."""
    if not isinstance(schema, Mapping):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None


def tool_call_grammar(tools: Sequence[ToolFunction], required_name: str | None = None) -> str:
    """An llguidance Lark grammar for an answer that is one or more DSML calls and nothing else
    (tool_choice "required"; with `required_name`, calls of that function only), exactly in the
    encoder's layout: `\\n\\n<｜DSML｜function_calls>\\n`, invokes joined by `\\n`,
    `\\n</｜DSML｜function_calls>`, then the model's EOS.

    Per function with `properties`: its parameters in the schema's order, each at most once, the
    `required` ones present, no others; a string-typed one (`"type": "string"`) as string="true" raw
    text without `</｜DSML｜parameter>` (an enum / const of strings: exactly one of them), a typed
    non-string one as string="false" `%json{its schema}` (root `$defs` / `definitions` carried
    along), an untyped or mixed one in either form. Without `properties`: any named parameters.
    The DSML strings are text (they are not special tokens). In thinking mode this constrains the
    answer only (apply it after `</think>`). ValueError naming the field for unusable tools."""
    if not tools:
        raise ValueError("tools: a tool-call grammar needs at least one tool")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        t.validate(f"tools[{i}].function")
        if t.name in seen:
            raise ValueError(f"tools[{i}].function.name: {t.name!r} is given twice")
        seen.add(t.name)
    chosen = [(i, t) for i, t in enumerate(tools) if required_name is None or t.name == required_name]
    if not chosen:
        raise ValueError(f"tool_choice.function.name: no tool named {required_name!r}")
    # Every "\n" is a lexeme of its own: llguidance lexes greedily, so a literal "\n</…>" next to an
    # alternative "\n" followed by "<…" would fail on the byte after "<".
    rules = [
        "%llguidance {}",
        f"start: NL NL {_lit(FUNCTION_CALLS_OPEN)} NL invoke (NL invoke)* NL {_lit(FUNCTION_CALLS_CLOSE)}",
        'NL: "\\n"',
        "invoke: " + " | ".join(f"call{k}" for k in range(len(chosen))),
        f"sval[lazy]: /(?s:.*)<\\/{DSML}parameter>/",  # raw text up to the first closing tag
        'PNAME: /[^"<>\\n]+/',
    ]
    for k, (i, fn) in enumerate(chosen):
        rules.append(f"call{k}: {_lit(f'{INVOKE_OPEN}{fn.name}{_Q}>')} NL args{k} NL {_lit(INVOKE_CLOSE)}")
        rules += _args_rules(f"args{k}", fn, f"tools[{i}].function.parameters")
    return "\n".join(rules) + "\n"


def _json_form(schema: Any, defs: Mapping) -> str:
    schema = dict(schema) if isinstance(schema, Mapping) else {}
    for k, v in defs.items():
        schema.setdefault(k, v)
    schema["x-guidance"] = _JSON_OPTIONS
    return f"%json {_to_json(schema)} {_lit(PARAMETER_CLOSE)}"


def _param_rule(name: str | None, schema: Any, defs: Mapping) -> str:
    """One parameter: open tag (`name`, or any name when None), value, closing tag."""
    raw_ok, json_ok = _schema_kinds(schema)

    def open_tag(string: str) -> str:
        if name is None:
            return f"{_lit(PARAMETER_OPEN)} PNAME {_lit(f'{_Q} string={_Q}{string}{_Q}>')}"
        return _lit(f'{PARAMETER_OPEN}{name}" string="{string}">')

    forms = []
    if raw_ok:
        choices = _string_choices(schema)
        value = "sval" if choices is None else f"({' | '.join(map(_lit, choices))}) {_lit(PARAMETER_CLOSE)}"
        forms.append(f"{open_tag('true')} {value}")
    if json_ok:
        forms.append(f"{open_tag('false')} {_json_form(schema, defs)}")
    return " | ".join(forms)


def _args_rules(rule: str, fn: ToolFunction, where: str) -> list[str]:
    """Rules for one invoke's parameter list (`rule`; the empty string when there are none)."""
    params = fn.parameters
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    props = params.get("properties")
    if not isinstance(props, Mapping) or not props:
        return [f"{rule}: ({rule}p (NL {rule}p)*)?", f"{rule}p: " + _param_rule(None, {}, defs)]
    required = set(params.get("required") or ())
    names = list(props)
    for name in names:
        if not name or _BAD_NAME_CHARS.search(name):
            raise ValueError(f"{where}.properties: parameter name {name!r} cannot be written in DSML")
    # {rule}a{k}: parameters k.. with none written yet; {rule}b{k}: after one was written (NL first)
    empty = _lit("")
    out = [f"{rule}: {rule}a0"]
    for k, name in enumerate(names):
        p = f"{rule}p{k}"
        out.append(f"{p}: " + _param_rule(name, props[name], defs))
        last = k + 1 == len(names)
        a_next, b_next = ("", "") if last else (f"{rule}a{k + 1}", f"{rule}b{k + 1}")
        a, b = f"{p} {b_next}".strip(), f"NL {p} {b_next}".strip()
        if name not in required:
            a += f" | {a_next or empty}"
            b += f" | {b_next or empty}"
        out += [f"{rule}a{k}: {a}", f"{rule}b{k}: {b}"]
    return out
