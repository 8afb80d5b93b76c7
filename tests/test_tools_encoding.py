"""DeepSeek-V3.2 tool calling (shared/protocol/tools.py, chat.py): prompts worked out by hand from
DeepSeek's published rules, the streaming DSML parser, and the llguidance grammar that forces calls.

Where the rules come from: DeepSeek-V3.2's `encoding/encoding_dsv32.py` (huggingface
deepseek-ai/DeepSeek-V3.2, MIT) — TOOLS_SYSTEM_TEMPLATE, tool_call_template / tool_calls_template,
encode_arguments_to_dsml, the `tool` branch of render_message (`\\n\\n<function_results>`,
`\\n<result>…</result>`, `\\n</function_results>`, then `\\n\\n<think>` or `\\n\\n</think>`),
find_last_user_index and decode_dsml_to_arguments — and its test pair test_input.json →
test_output.txt (also in ai-dynamo/dynamo lib/llm/tests/data/deepseek-v3.2/), whose first turns
test_official_example_first_turns repeats; the full example renders to the official 4930 characters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shared.protocol.chat import ChatMessage, render_messages
from shared.protocol.tools import (
    ParsedDelta,
    ToolCall,
    ToolCallParser,
    ToolFunction,
    parse_tool_calls,
    render_tool_calls,
    tool_call_grammar,
)

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"  # fullwidth vertical bars, U+FF5C

# DeepSeek's TOOLS_SYSTEM_TEMPLATE with the DSML token and <think>/</think> filled in, written out.
TOOLS_HEAD = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{D}function_calls>" block like the following as part of your reply to the user:
<{D}function_calls>
<{D}invoke name="$FUNCTION_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$FUNCTION_NAME2">
...
</{D}invoke>
</{D}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{D}function_calls>
...
</{D}function_calls>

<function_results>
...
</function_results>

<think>...thinking about results</think>

Here are the functions available in JSONSchema format:
<functions>
"""  # noqa: E501

WEATHER = ToolFunction("get_weather", "Weather for a city",
                       {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                        "required": ["city"]})
TIME = ToolFunction("get_time")
WEATHER_LINE = ('{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}')
TOOLS_SECTION = TOOLS_HEAD + WEATHER_LINE + '\n{"name": "get_time"}\n</functions>\n'
CALL = ToolCall("get_weather", '{"city": "Zürich", "days": 3}', id="call_1")
CALL_DSML = (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
             f'<{D}parameter name="city" string="true">Zürich</{D}parameter>\n'
             f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
             f'</{D}invoke>\n</{D}function_calls>')


# --- prompts ---------------------------------------------------------------------------------------


def test_tools_go_after_the_system_prompt():
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Weather?")]
    assert render_messages(msgs, tools=[WEATHER, TIME]) == f"{B}Be brief.\n\n{TOOLS_SECTION}{U}Weather?{A}</think>"
    assert render_messages(msgs, thinking=True, tools=[WEATHER, TIME]).endswith(f"</functions>\n{U}Weather?{A}<think>")


def test_tools_without_a_system_prompt_open_the_prompt():
    """As an empty system message put first: its content "" then "\\n\\n" + the section."""
    assert render_messages([ChatMessage("user", "Weather?")], tools=[WEATHER, TIME]) == (
        f"{B}\n\n{TOOLS_SECTION}{U}Weather?{A}</think>")
    # a system message that is not first stays where it is; the section still opens the prompt
    got = render_messages([ChatMessage("user", "q"), ChatMessage("system", "S")], tools=[TIME])
    assert got.startswith(f"{B}\n\n{TOOLS_HEAD}") and got.endswith(f"{U}q{A}</think>S")


def test_no_tools_is_the_plain_encoding():
    msgs = [ChatMessage("system", "S"), ChatMessage("user", "q")]
    assert render_messages(msgs, tools=()) == render_messages(msgs) == f"{B}S{U}q{A}</think>"


def test_assistant_tool_call_string_and_non_string_parameters():
    """Strings raw with string="true"; other values as JSON (json.dumps separators, non-ASCII kept)
    with string="false"; the block follows the content after "\\n\\n"."""
    call = ToolCall("get_weather", json.dumps({"city": "Zürich", "days": 3, "opts": {"units": ["c", None]},
                                               "exact": True}))
    msgs = [ChatMessage("user", "Weather?"), ChatMessage("assistant", "Checking.", tool_calls=(call,))]
    assert render_messages(msgs, tools=[WEATHER]) == (
        f"{B}\n\n{TOOLS_HEAD}{WEATHER_LINE}\n</functions>\n{U}Weather?{A}</think>Checking.\n\n"
        f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Zürich</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
        f'<{D}parameter name="opts" string="false">{{"units": ["c", null]}}</{D}parameter>\n'
        f'<{D}parameter name="exact" string="false">true</{D}parameter>\n'
        f'</{D}invoke>\n</{D}function_calls>{E}')


def test_two_calls_and_two_consecutive_tool_results_chat_mode():
    """One assistant turn, two invokes joined by "\\n"; the two results form one <function_results>
    group right after the turn's EOS (no user turn), closed by "\\n\\n</think>" in chat mode; the
    final answer then follows directly."""
    calls = (CALL, ToolCall("get_time", "{}", id="call_2"))
    msgs = [ChatMessage("user", "Weather and time?"), ChatMessage("assistant", "", tool_calls=calls),
            ChatMessage("tool", "sunny", tool_call_id="call_1"), ChatMessage("tool", "12:00", tool_call_id="call_2"),
            ChatMessage("assistant", "Sunny, noon.")]
    two = CALL_DSML.replace(f"</{D}function_calls>",
                            f'<{D}invoke name="get_time">\n\n</{D}invoke>\n</{D}function_calls>')
    body = (f"{U}Weather and time?{A}</think>\n\n{two}{E}"
            "\n\n<function_results>\n<result>sunny</result>\n<result>12:00</result>\n</function_results>\n\n</think>")
    assert render_messages(msgs[:4]) == f"{B}{body}"  # the prompt for the answer after the results
    assert render_messages(msgs) == f"{B}{body}Sunny, noon.{E}"


def test_thinking_mode_with_tools():
    """Turns after the last user turn keep their reasoning ({reasoning}</think>); a tool group after
    it ends with "\\n\\n<think>" (the model thinks again about the results); a turn before it loses
    its reasoning and its results end with "\\n\\n</think>". A calling turn may have no reasoning."""
    msgs = [ChatMessage("user", "q1"),
            ChatMessage("assistant", "", "old thoughts", (CALL,)),
            ChatMessage("tool", "r1"),
            ChatMessage("assistant", "a1", "dropped"),
            ChatMessage("user", "q2"),
            ChatMessage("assistant", "", "need data", (CALL,)),
            ChatMessage("tool", "r2")]
    head = f"{B}\n\n{TOOLS_HEAD}{WEATHER_LINE}\n</functions>\n"
    first = (f"{U}q1{A}</think>\n\n{CALL_DSML}{E}\n\n<function_results>\n<result>r1</result>\n</function_results>"
             f"\n\n</think>a1{E}")
    second = (f"{U}q2{A}<think>need data</think>\n\n{CALL_DSML}{E}"
              "\n\n<function_results>\n<result>r2</result>\n</function_results>\n\n<think>")
    assert render_messages(msgs, thinking=True, tools=[WEATHER]) == head + first + second
    # the reply after the results: its reasoning, then its answer
    done = [*msgs, ChatMessage("assistant", "answer", "about r2")]
    assert render_messages(done, thinking=True, tools=[WEATHER]) == head + first + second + f"about r2</think>answer{E}"
    # a calling turn without reasoning: "</think>" alone
    bare = [ChatMessage("user", "q"), ChatMessage("assistant", "", tool_calls=(CALL,))]
    assert render_messages(bare, thinking=True) == f"{B}{U}q{A}<think></think>\n\n{CALL_DSML}{E}"
    # same conversation in chat mode: no reasoning anywhere, every group closed by </think>
    chat = render_messages(done, tools=[WEATHER])
    assert "need data" not in chat and "<think>" not in chat.replace("<think>...thinking", "")
    assert chat.endswith(f"<result>r2</result>\n</function_results>\n\n</think>answer{E}")


def test_official_example_first_turns():
    """DeepSeek's test_input.json → test_output.txt (thinking mode), its first four messages and the
    tool group's close: the prompt the model continues after the first tool result."""
    tools = [ToolFunction("get_datetime", "Get the current date and time",
                          {"type": "object", "properties": {"timezone": {
                              "type": "string", "description": "The timezone, e.g. America/New_York, UTC"}},
                           "required": ["timezone"]})]
    msgs = [ChatMessage("system", "You are a helpful Assistant."),
            ChatMessage("user", "What's the weather tomorrow in San Francisco and New York?"),
            ChatMessage("assistant", reasoning_content="User is asking about tomorrow's weather. I need to first get "
                        "the current date to calculate tomorrow's date.", tool_calls=[{
                            "id": "call_xK9mN3pL2qR8vT5wY6hZ1aB4", "type": "function",
                            "function": {"arguments": "{\"timezone\": \"America/New_York\"}",
                                         "name": "get_datetime"}}]),
            ChatMessage("tool", '{"current_date": "2024-01-15", "current_time": "14:30:00", "timezone": '
                        '"America/New_York"}', tool_call_id="call_xK9mN3pL2qR8vT5wY6hZ1aB4")]
    assert render_messages(msgs, thinking=True, tools=tools) == (
        f"{B}You are a helpful Assistant.\n\n{TOOLS_HEAD}"
        '{"name": "get_datetime", "description": "Get the current date and time", "parameters": {"type": "object", '
        '"properties": {"timezone": {"type": "string", "description": "The timezone, e.g. America/New_York, UTC"}}, '
        '"required": ["timezone"]}}\n</functions>\n'
        f"{U}What's the weather tomorrow in San Francisco and New York?{A}<think>User is asking about tomorrow's "
        "weather. I need to first get the current date to calculate tomorrow's date.</think>\n\n"
        f'<{D}function_calls>\n<{D}invoke name="get_datetime">\n'
        f'<{D}parameter name="timezone" string="true">America/New_York</{D}parameter>\n'
        f"</{D}invoke>\n</{D}function_calls>{E}\n\n<function_results>\n"
        '<result>{"current_date": "2024-01-15", "current_time": "14:30:00", "timezone": "America/New_York"}</result>\n'
        "</function_results>\n\n<think>")


def test_openai_shaped_inputs():
    fn = ToolFunction.from_openai({"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}, "tools[0]")
    assert fn == ToolFunction("f", "d", {"type": "object"})
    assert ToolFunction.from_openai({"name": "g"}) == ToolFunction("g")
    with pytest.raises(ValueError, match=r"tools\[1\]\.type"):
        ToolFunction.from_openai({"type": "retrieval"}, "tools[1]")
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        ToolFunction.from_openai({"type": "function", "function": {"name": 'a"b'}}, "tools[0]")
    m = ChatMessage("assistant", tool_calls=[{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": {"x": 1}}}])
    assert m.tool_calls == (ToolCall("f", '{"x": 1}', "c"),)
    assert ChatMessage("user", "hi", "r") == ChatMessage(role="user", content="hi", reasoning_content="r")


@pytest.mark.parametrize("msgs, error", [
    ([ChatMessage("user", "q"), ChatMessage("robot", "x")], r"messages\[1\]\.role must be one of"),
    ([ChatMessage("user", "q"), ChatMessage("tool", "x")], r"messages\[1\]\.role: a 'tool' message must follow"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", "a"), ChatMessage("tool", "x")], r"messages\[2\]\.role"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(ToolCall("f", "{x"),))],
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not a JSON object"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(CALL, ToolCall("f", "[1]")))],
     r"messages\[1\]\.tool_calls\[1\]\.function\.arguments: not a JSON object"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(ToolCall("", "{}"),))],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(CALL,)), ChatMessage("tool", "1"),
      ChatMessage("tool", "2")], r"messages\[3\]\.role: messages\[1\] made 1 tool call"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(CALL, CALL)), ChatMessage("tool", "1"),
      ChatMessage("user", "next")], r"messages\[1\]\.tool_calls: 2 calls but only 1"),
    ([ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(CALL,)),
      ChatMessage("tool", "1", tool_call_id="x")],
     r"messages\[2\]\.tool_call_id: 'x'"),
    ([ChatMessage("user", "q", tool_calls=(CALL,))], r"messages\[0\]\.tool_calls: only assistant"),
])
def test_bad_messages_name_the_field(msgs, error):
    with pytest.raises(ValueError, match=error):
        render_messages(msgs)


def test_thinking_turn_without_reasoning_or_calls_is_refused():
    with pytest.raises(ValueError, match=r"messages\[1\].*reasoning_content"):
        render_messages([ChatMessage("user", "q"), ChatMessage("assistant", "a")], thinking=True)


def test_calls_without_results_then_a_user_turn_render_as_deepseek():
    """Not refused (DeepSeek's encoder renders it): the calls' turn, then the next user turn."""
    msgs = [ChatMessage("user", "q"), ChatMessage("assistant", tool_calls=(CALL,)), ChatMessage("user", "never mind")]
    assert render_messages(msgs) == f"{B}{U}q{A}</think>\n\n{CALL_DSML}{E}{U}never mind{A}</think>"


# --- parsing the model's output ---------------------------------------------------------------------


REPLY = (f'Let me check.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
         f'<{D}parameter name="city" string="true">San "Fran"\ncisco \\ ok</{D}parameter>\n'
         f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
         f'</{D}invoke>\n<{D}invoke name="get_time">\n\n</{D}invoke>\n</{D}function_calls>')
REPLY_CALLS = [ToolCall("get_weather", '{"city": "San \\"Fran\\"\\ncisco \\\\ ok", "days": 3}'),
               ToolCall("get_time", "{}")]


def stream(parser: ToolCallParser, pieces) -> tuple[list[ParsedDelta], str, list[ToolCall]]:
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, names, args = "", {}, {}
    for d in deltas:
        content += d.content
        for t in d.tool_calls:
            if t.name:
                assert t.index not in names, "name on the first delta only"
                names[t.index] = t.name
            assert t.index in names
            args[t.index] = args.get(t.index, "") + t.arguments_delta
    return deltas, content, [ToolCall(names[i], args[i]) for i in sorted(names)]


def test_whole_reply():
    content, calls = parse_tool_calls(REPLY, [WEATHER, TIME])
    assert content == "Let me check." and calls == REPLY_CALLS
    assert json.loads(calls[0].arguments) == {"city": 'San "Fran"\ncisco \\ ok', "days": 3}


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_streamed_equals_whole(seed):
    """Char by char (seed None) and in random pieces: the same content and calls; no piece of a DSML
    tag ever reaches the content; arguments grow while a string value streams."""
    if seed is None:
        pieces = list(REPLY)
    else:
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(REPLY):
            n = rng.randint(1, 12)
            pieces.append(REPLY[i:i + n])
            i += n
    deltas, content, calls = stream(ToolCallParser([WEATHER, TIME]), pieces)
    assert content == "Let me check." and calls == REPLY_CALLS
    assert all("<" not in d.content and "｜" not in d.content for d in deltas)
    if seed is None:  # the string value arrives in several pieces, not at its closing tag only
        pieces_of_first = [t.arguments_delta for d in deltas for t in d.tool_calls if t.index == 0]
        assert len(pieces_of_first) > 10


def test_content_text_that_only_looks_like_a_tag_is_released():
    text = "a < b\n\nand <｜DSM is not a tag\n\n"
    for pieces in ([text], list(text)):
        _, content, calls = stream(ToolCallParser([WEATHER]), pieces)
        assert content == text and calls == []


def test_official_search_call_decodes():
    """A call from DeepSeek's test_output_search_wo_date.txt: string="false" values are JSON."""
    text = (f'\n\n<{D}function_calls>\n<{D}invoke name="search">\n'
            f'<{D}parameter name="query" string="true">"16,201,670" vaccine doses</{D}parameter>\n'
            f'<{D}parameter name="topn" string="false">10</{D}parameter>\n'
            f'<{D}parameter name="source" string="true">web</{D}parameter>\n'
            f'</{D}invoke>\n</{D}function_calls>')
    assert parse_tool_calls(text) == ("", [ToolCall(
        "search", '{"query": "\\"16,201,670\\" vaccine doses", "topn": 10, "source": "web"}')])


def test_rendered_calls_parse_back():
    args = {"city": "Zürich </x>", "days": 3, "opts": {"a": [1, None]}, "flag": False}
    text = "\n\n" + render_tool_calls([ToolCall("get_weather", json.dumps(args)), ToolCall("get_time", "{}")])
    content, calls = parse_tool_calls(text, [WEATHER, TIME])
    assert content == "" and [json.loads(c.arguments) for c in calls] == [args, {}]


HOSTILE = [
    # an unterminated tag at the end: kept as content
    ("Hi <｜DSML｜function_calls", "Hi <｜DSML｜function_calls", []),
    (f"Hi\n\n<{D}function_calls>\n<{D}invoke name=\"get_ti", f"Hi\n\n<{D}function_calls>\n<{D}invoke name=\"get_ti",
     []),
    # an unknown function: the whole block stays content (no call names a function the client lacks)
    (f'Hi\n\n<{D}function_calls>\n<{D}invoke name="rm_rf">\n</{D}invoke>\n</{D}function_calls>',
     f'Hi\n\n<{D}function_calls>\n<{D}invoke name="rm_rf">\n</{D}invoke>\n</{D}function_calls>', []),
    # ... after a known one: that call is kept, the rest is content
    (f'<{D}function_calls>\n<{D}invoke name="get_time">\n</{D}invoke>\n<{D}invoke name="rm_rf">\n</{D}invoke>',
     f'\n<{D}invoke name="rm_rf">\n</{D}invoke>', [ToolCall("get_time", "{}")]),
    # a non-string value that is not JSON (or is NaN): a JSON string of its text
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">three'
     f'</{D}parameter>\n<{D}parameter name="x" string="false">NaN</{D}parameter>\n</{D}invoke>\n</{D}function_calls>',
     "", [ToolCall("get_weather", '{"days": "three", "x": "NaN"}')]),
    # cut off inside a string value (max_tokens): the call is closed so its arguments parse
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par',
     "", [ToolCall("get_weather", '{"city": "Par"}')]),
    # cut off inside a JSON value, and between parameters
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">[1, 2',
     "", [ToolCall("get_weather", '{"days": "[1, 2"}')]),
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">2'
     f'</{D}parameter>\n', "", [ToolCall("get_weather", '{"days": 2}')]),
    # text where a tag must be; a repeated parameter: the call closes, the rest is content
    (f'<{D}function_calls>\n<{D}invoke name="get_time">\nhello</{D}invoke>', f"\nhello</{D}invoke>",
     [ToolCall("get_time", "{}")]),
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="days" string="false">1</{D}parameter>'
     f'<{D}parameter name="days" string="false">2</{D}parameter></{D}invoke>',
     f'<{D}parameter name="days" string="false">2</{D}parameter></{D}invoke>',
     [ToolCall("get_weather", '{"days": 1}')]),
    # a tag that never closes within the limit
    (f'<{D}function_calls>\n<{D}invoke name="' + "x" * 600, f'<{D}function_calls>\n<{D}invoke name="' + "x" * 600, []),
    # an answer after the block is content; so is a second, well-formed block's absence of "\n\n"
    (f'<{D}function_calls>\n<{D}invoke name="get_time">\n</{D}invoke>\n</{D}function_calls> Done.',
     " Done.", [ToolCall("get_time", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", HOSTILE)
def test_hostile_replies(text, content, calls):
    assert parse_tool_calls(text, [WEATHER, TIME]) == (content, calls)
    _, streamed_content, streamed_calls = stream(ToolCallParser([WEATHER, TIME]), list(text))
    assert (streamed_content, streamed_calls) == (content, calls)
    for c in calls:
        json.loads(c.arguments)


def test_parser_without_a_tool_list_takes_any_name_and_finishes_once():
    parser = ToolCallParser()
    assert parser.feed(f'<{D}function_calls>\n<{D}invoke name="anything">\n').tool_calls[0].name == "anything"
    assert parser.calls_emitted == 1
    parser.finish()
    assert parser.finish() == ParsedDelta()
    with pytest.raises(RuntimeError):
        parser.feed("more")
    assert parse_tool_calls(f'<{D}function_calls>\n<{D}invoke name="f">\n</{D}invoke>', []) == (
        f'<{D}function_calls>\n<{D}invoke name="f">\n</{D}invoke>', [])  # an empty tool list: nothing is a call


# --- forcing calls with llguidance ------------------------------------------------------------------


llguidance = pytest.importorskip("llguidance")
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "models" / "demo-v32" / "tokenizer.json"
SCHEMA_TOOLS = [
    ToolFunction("get_weather", "", {
        "type": "object", "required": ["city"], "$defs": {"tag": {"type": "string", "maxLength": 8}},
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                       "units": {"enum": ["c", "f"]}, "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
                       "id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}),
    ToolFunction("get_time"),
    ToolFunction("anything", "", {"type": "object"}),
]


@pytest.fixture(scope="module")
def tok():
    return llguidance.LLTokenizer(TOKENIZER_JSON.read_text())


def accepts(tok, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting() and m.consume_token(tok.eos_token)


def calls_text(*calls: ToolCall) -> str:
    return "\n\n" + render_tool_calls(calls)


def test_dsml_is_plain_text_for_the_tokenizer(tok):
    """The demo tokenizer has no DSML token: "｜" is three byte tokens, so the grammar spells the tags
    out as text (DeepSeek's tokenizer has no DSML special token either)."""
    ids = tok.tokenize_str(D)
    assert len(ids) > 2 and tok.decode_str(ids) == D


@pytest.mark.parametrize("required_name", [None, "get_weather", "get_time"])
def test_grammar_compiles(tok, required_name):
    assert llguidance.LLMatcher.validate_grammar(tool_call_grammar(SCHEMA_TOOLS, required_name), tok) == ""


def test_grammar_accepts_rendered_calls(tok):
    grammar = tool_call_grammar(SCHEMA_TOOLS)
    full = ToolCall("get_weather", json.dumps({"city": "Paris </x> \"q\"", "days": 3, "units": "c",
                                               "tags": ["a", "b"], "id": "x-1"}))
    calls = [full, ToolCall("get_time", "{}"), ToolCall("anything", json.dumps({"q": "x", "n": [1, {"a": None}]})),
             ToolCall("get_weather", '{"city": "Rome", "id": 7}')]
    for c in calls:
        assert accepts(tok, grammar, calls_text(c)), c
    text = calls_text(*calls)
    assert accepts(tok, grammar, text)
    assert parse_tool_calls(text, SCHEMA_TOOLS) == ("", [ToolCall(c.name, c.arguments) for c in calls])


@pytest.mark.parametrize("bad", [
    '{"days": 3}',  # the required city missing
    '{"city": "x", "days": 0}',  # below the minimum
    '{"city": "x", "days": "3"}',  # a string where the schema wants an integer
    '{"city": 5}',  # a number for a string parameter
    '{"city": "x", "units": "k"}',  # not in the enum
    '{"days": 3, "city": "x"}',  # out of the schema's order
    '{"city": "x", "extra": 1}',  # not a declared parameter
    '{"city": "x", "tags": ["much too long"]}',  # $defs carried into the parameter's schema
])
def test_grammar_rejects_invalid_arguments(tok, bad):
    assert not accepts(tok, tool_call_grammar(SCHEMA_TOOLS), calls_text(ToolCall("get_weather", bad)))


def test_grammar_rejects_other_output(tok):
    grammar = tool_call_grammar(SCHEMA_TOOLS)
    assert not accepts(tok, grammar, "Sure! " + calls_text(ToolCall("get_time", "{}")))  # text before the calls
    assert not accepts(tok, grammar, calls_text(ToolCall("rm_rf", "{}")))  # unknown function
    assert not accepts(tok, grammar, "\n\n" + render_tool_calls([ToolCall("get_time", "{}")])[:-5])  # unclosed
    spaced = calls_text(ToolCall("get_weather", '{"city": "x", "tags": ["a", "b"]}'))
    assert accepts(tok, grammar, spaced)  # JSON values with json.dumps's separators, as the encoder wrote them
    assert not accepts(tok, grammar, spaced.replace('["a", "b"]', '["a","b"]'))
    named = tool_call_grammar(SCHEMA_TOOLS, "get_time")
    assert accepts(tok, named, calls_text(ToolCall("get_time", "{}"), ToolCall("get_time", "{}")))
    assert not accepts(tok, named, calls_text(ToolCall("get_weather", '{"city": "x"}')))


def test_grammar_refuses_unusable_tools():
    with pytest.raises(ValueError, match="tools"):
        tool_call_grammar([])
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.name"):
        tool_call_grammar([TIME, TIME])
    with pytest.raises(ValueError, match="tool_choice.function.name"):
        tool_call_grammar([TIME], "nope")
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters\.properties"):
        tool_call_grammar([ToolFunction("f", "", {"properties": {'a"b': {}}})])
