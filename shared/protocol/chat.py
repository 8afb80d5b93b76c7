"""DeepSeek-V3.2 chat encoding: messages (and tools) → the prompt string the model was trained on.

Implemented from the rules DeepSeek publishes with the V3.2 release (`encoding/encoding_dsv32.py`,
checked against its `test_input.json` → `test_output.txt`):
* BOS once at the start; a system message is its content as is (no wrapper);
* a user turn is `<｜User｜>{content}<｜Assistant｜>` followed by `<think>` when it is the last user
  turn in thinking mode, else by `</think>` (earlier turns, and every turn in chat mode);
* an assistant turn is `{content}{calls}<｜end▁of▁sentence｜>`, `{calls}` being `\\n\\n` + the DSML
  `<｜DSML｜function_calls>` block of its tool_calls (tools.py), or nothing; only an assistant turn
  *after* the last user turn in thinking mode carries its reasoning, as `{reasoning}</think>` before
  its content — earlier turns' reasoning is dropped (their `</think>` comes from the turn before
  them); such a turn needs reasoning_content unless it makes tool calls (then `</think>` alone);
* tools: the "## Tools" section (tools.render_tools) goes after the first message's content when that
  is a system message (`{system}\\n\\n## Tools…`), else it is the prompt's first text
  (`\\n\\n## Tools…`), as if an empty system message were inserted;
* tool results answer the tool calls of the assistant turn just before them, in order, with no user
  turn between: consecutive `tool` messages form one group `\\n\\n<function_results>` +
  `\\n<result>{content}</result>` each + `\\n</function_results>`, closed by `\\n\\n<think>` when the
  group is after the last user turn in thinking mode, else by `\\n\\n</think>` (the next assistant
  turn, which continues the reply, starts there);
* nothing else is inserted between turns.
Developer messages and response_format are not supported (a clear error, not a silent skip).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.protocol.tools import (
    CALLS_LEAD,
    RESULT,
    RESULTS_CLOSE,
    RESULTS_OPEN,
    ToolCall,
    ToolFunction,
    render_tool_calls,
    render_tools,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    """One message. `tool_calls`: an assistant turn's calls (OpenAI-shaped dicts are converted);
    `tool_call_id`: which call a `tool` message answers."""

    role: str
    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    def __post_init__(self):
        if not isinstance(self.tool_calls, tuple) or not all(isinstance(c, ToolCall) for c in self.tool_calls):
            calls = []
            for c in self.tool_calls or ():
                if not isinstance(c, (ToolCall, Mapping)):
                    raise TypeError(f"ChatMessage.tool_calls: ToolCall or OpenAI tool_call objects, got {c!r}")
                calls.append(c if isinstance(c, ToolCall) else ToolCall.from_openai(c))
            object.__setattr__(self, "tool_calls", tuple(calls))


def _tool_groups(messages: Sequence[ChatMessage]) -> dict[int, tuple[int, int]]:
    """Validates roles and tool calls; → for each tool message, (its place in its group from 1, the
    group's size)."""
    groups: dict[int, tuple[int, int]] = {}
    caller = -1  # the assistant turn whose calls the current tool messages answer
    answered = 0
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {m.role!r}")
        if m.tool_calls and m.role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only assistant messages make tool calls")
        if m.role == "tool":
            calls = messages[caller].tool_calls if caller >= 0 else ()
            if not calls:
                raise ValueError(f"messages[{i}].role: a 'tool' message must follow an assistant message "
                                 "with tool_calls (or another tool message)")
            if answered == len(calls):
                raise ValueError(f"messages[{i}].role: messages[{caller}] made {len(calls)} tool call(s), "
                                 "all answered already")
            ids = {c.id for c in calls if c.id}
            if m.tool_call_id and ids and m.tool_call_id not in ids:
                raise ValueError(f"messages[{i}].tool_call_id: {m.tool_call_id!r} is not a tool call of "
                                 f"messages[{caller}]")
            answered += 1
            groups[i] = (answered, len(calls))
            continue
        if caller >= 0 and 0 < answered < len(messages[caller].tool_calls):
            raise ValueError(f"messages[{caller}].tool_calls: {len(messages[caller].tool_calls)} calls but "
                             f"only {answered} tool message(s) answer them")
        caller, answered = (i, 0) if m.role == "assistant" else (-1, 0)
        for j, call in enumerate(m.tool_calls):
            call.arguments_object(f"messages[{i}].tool_calls[{j}]")
    if caller >= 0 and 0 < answered < len(messages[caller].tool_calls):
        raise ValueError(f"messages[{caller}].tool_calls: {len(messages[caller].tool_calls)} calls but only "
                         f"{answered} tool message(s) answer them")
    return groups


def render_messages(messages: Sequence[ChatMessage], thinking: bool = False, add_bos: bool = True,
                    tools: Sequence[ToolFunction] = ()) -> str:
    """The prompt for `messages` (offering `tools`) in thinking mode (the reply opens inside <think>)
    or chat mode. ValueError naming the offending field."""
    if not messages:
        raise ValueError("messages must not be empty")
    groups = _tool_groups(messages)
    for i, t in enumerate(tools):
        t.validate(f"tools[{i}].function")
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    parts = [BOS] if add_bos else []
    if tools and messages[0].role != "system":
        parts.append("\n\n" + render_tools(tools))
    for i, m in enumerate(messages):
        if m.role == "system":
            parts.append(m.content)
            if tools and i == 0:
                parts.append("\n\n" + render_tools(tools))
        elif m.role == "user":
            parts += [USER, m.content, ASSISTANT, THINK_START if thinking and i == last_user else THINK_END]
        elif m.role == "tool":
            place, size = groups[i]
            if place == 1:
                parts.append(RESULTS_OPEN)
            parts.append(RESULT.format(m.content))
            if place == size:
                parts += [RESULTS_CLOSE, "\n\n", THINK_START if thinking and i > last_user else THINK_END]
        else:
            if thinking and i > last_user:
                if not (m.reasoning_content or m.tool_calls):
                    raise ValueError(f"messages[{i}]: an assistant turn after the last user turn needs "
                                     "reasoning_content (or tool_calls) in thinking mode")
                parts += [m.reasoning_content, THINK_END]
            parts.append(m.content)
            if m.tool_calls:
                parts.append(CALLS_LEAD + render_tool_calls(m.tool_calls, f"messages[{i}].tool_calls"))
            parts.append(EOS)
    return "".join(parts)


def split_reasoning(text: str) -> tuple[str, str]:
    """A thinking-mode reply (special tokens kept) → (reasoning, answer)."""
    reasoning, sep, answer = text.partition(THINK_END)
    if not sep:
        return "", text.removeprefix(THINK_START)
    return reasoning.removeprefix(THINK_START), answer
