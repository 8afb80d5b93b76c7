"""Forcing calls: an llguidance (Lark) grammar for tool_choice "required" or a named function, its JSON
values written as DeepSeek's encoder writes them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shared.protocol.tools.dsml import (
    BAD_NAME_CHARS,
    DSML,
    FUNCTION_CALLS_CLOSE,
    FUNCTION_CALLS_OPEN,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    QUOTE,
    ToolFunction,
    to_json,
)

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
        rules.append(f"call{k}: {_lit(f'{INVOKE_OPEN}{fn.name}{QUOTE}>')} NL args{k} NL {_lit(INVOKE_CLOSE)}")
        rules += _args_rules(f"args{k}", fn, f"tools[{i}].function.parameters")
    return "\n".join(rules) + "\n"


def _json_form(schema: Any, defs: Mapping) -> str:
    schema = dict(schema) if isinstance(schema, Mapping) else {}
    for k, v in defs.items():
        schema.setdefault(k, v)
    schema["x-guidance"] = _JSON_OPTIONS
    return f"%json {to_json(schema)} {_lit(PARAMETER_CLOSE)}"


def _param_rule(name: str | None, schema: Any, defs: Mapping) -> str:
    """One parameter: open tag (`name`, or any name when None), value, closing tag."""
    raw_ok, json_ok = _schema_kinds(schema)

    def open_tag(string: str) -> str:
        if name is None:
            return f"{_lit(PARAMETER_OPEN)} PNAME {_lit(f'{QUOTE} string={QUOTE}{string}{QUOTE}>')}"
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
        if not name or BAD_NAME_CHARS.search(name):
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
