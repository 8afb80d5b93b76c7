"""DeepSeek-V3.2 chat encoding: messages → the prompt string the model was trained on.

Implemented from the rules DeepSeek publishes with the V3.2 release (`encoding/encoding_dsv32.py`):
* BOS once at the start; a system message is its content as is (no wrapper);
* a user turn is `<｜User｜>{content}<｜Assistant｜>` followed by `<think>` when it is the last user
  turn in thinking mode, else by `</think>` (earlier turns, and every turn in chat mode);
* an assistant turn is `{content}<｜end▁of▁sentence｜>`; only an assistant turn *after* the last user
  turn in thinking mode carries its reasoning, as `{reasoning}</think>{content}` — earlier turns'
  reasoning is dropped (their `</think>` comes from the user turn before them);
* nothing else is inserted between turns.
Tool calls and developer messages are not supported here (a clear error, not a silent skip).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str = ""
    reasoning_content: str = ""


def render_messages(messages: Sequence[ChatMessage], thinking: bool = False, add_bos: bool = True) -> str:
    """The prompt for `messages` in thinking mode (the reply opens inside <think>) or chat mode."""
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {m.role!r}")
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    parts = [BOS] if add_bos else []
    for i, m in enumerate(messages):
        if m.role == "system":
            parts.append(m.content)
        elif m.role == "user":
            parts += [USER, m.content, ASSISTANT, THINK_START if thinking and i == last_user else THINK_END]
        else:
            if thinking and i > last_user:
                if not m.reasoning_content:
                    raise ValueError(f"messages[{i}]: an assistant turn after the last user turn needs "
                                     "reasoning_content in thinking mode")
                parts += [m.reasoning_content, THINK_END]
            parts += [m.content, EOS]
    return "".join(parts)


def split_reasoning(text: str) -> tuple[str, str]:
    """A thinking-mode reply (special tokens kept) → (reasoning, answer)."""
    reasoning, sep, answer = text.partition(THINK_END)
    if not sep:
        return "", text.removeprefix(THINK_START)
    return reasoning.removeprefix(THINK_START), answer
