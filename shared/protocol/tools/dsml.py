"""DeepSeek-V3.2 tool calling, the DSML format: tool definitions and calls, rendered into the prompt
as the model was trained on them. Torch-free, like the rest of shared.protocol.

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

QUOTE = '"'
BAD_NAME_CHARS = re.compile(r'["<>\n]')


def to_json(value: Any) -> str:
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
        if not self.name or BAD_NAME_CHARS.search(self.name):
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
        return to_json(d)


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
            args = to_json(args)
        return cls(str(fn.get("name") or ""), args if isinstance(args, str) else to_json(args),
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
        if not call.name or BAD_NAME_CHARS.search(call.name):
            raise ValueError(f"{w}.function.name: must be non-empty without '\"', '<', '>' or newlines, "
                             f"got {call.name!r}")
        params = [f'{PARAMETER_OPEN}{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f"{v if isinstance(v, str) else to_json(v)}{PARAMETER_CLOSE}"
                  for k, v in call.arguments_object(w).items()]
        invokes.append(f'{INVOKE_OPEN}{call.name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return FUNCTION_CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + FUNCTION_CALLS_CLOSE
