"""The OpenAI request bodies the HTTP API takes (FastAPI validates them with pydantic: a bad field is a 400
naming it) and their translation into the gRPC API's fields: sampling parameters, the output constraint (from
OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_*`), latency targets, message
text. Fields OpenAI defines that this server does not implement are refused by name, never ignored."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.openai_choices import CallRules
from router.openai_errors import HttpAbort, HttpCall
from shared.protocol.chat import ROLES
from shared.rpc.pdserve.v1 import generation_pb2

# Integers that travel as proto int32 / int64 (generation.proto): out of range is a 400 naming the field, not a
# proto assignment error (a 500) after parsing.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# Fields OpenAI or vLLM define that this server does not implement, with the values that ask for nothing.
UNIMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (None, False), "suffix": (None, ""), "prompt_logprobs": (None,),
}


# -- request bodies (OpenAI's fields; the ones this server does not implement yet are refused by name) ----
class StreamOptions(BaseModel):
    include_usage: bool = False


class Sla(BaseModel):
    """pdserve's per-request latency targets (0: the router's --ttft-slo-ms / --tpot-slo-ms)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in a JSON value that is not Unicode text (a lone surrogate such as
    "\\ud800", which JSON allows and UTF-8 cannot carry), or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and lone_surrogate(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        if (where := lone_surrogate(item, f"{path}.{key}" if path else str(key))) is not None:
            return where
    return None


class SamplingFields(BaseModel):
    """The sampling fields both endpoints take."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's server and vLLM do

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data: Any) -> Any:
        """Every string of the body is text: a lone surrogate is a 400 naming its field, not a 500 when the
        proto or a hash meets it."""
        try:  # the whole body at C speed (a 128k-token prompt is a long list); the walk only names the field
            json.dumps(data, ensure_ascii=False).encode()
            return data
        except (UnicodeEncodeError, TypeError, ValueError):
            pass
        if (where := lone_surrogate(data)) is not None:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: not valid Unicode text (a lone surrogate)",
                            where)
        return data

    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None  # vLLM's extra
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None  # vLLM's extra
    ignore_eos: bool = False  # vLLM's extra
    skip_special_tokens: bool = True  # vLLM's extra
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    priority: Int32 = 0  # vLLM's extra: lower is more urgent
    cache_salt: str | None = None  # vLLM's extra: a tenant's prefix-cache namespace (GenerateRequest.cache_salt)
    sla: Sla | None = None  # pdserve's extra: this request's own latency targets
    timeout: float | None = Field(default=None, description="seconds; pdserve's extra (504 after it)")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    min_p: float = 0.0  # vLLM's extra
    min_tokens: Int32 = 0  # vLLM's extra
    top_logprobs: Int32 | None = None  # chat: alternatives per token, with logprobs: true
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extra
    guided_json: dict[str, Any] | str | None = None  # vLLM's older extras, still in wide use
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None  # the output always matches the schema here, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[Int32] | list[str] | list[list[Int32]]
    echo: bool = False
    logprobs: Int32 | None = None  # the legacy API's: this many alternatives per token (0..20)


class FunctionCallIn(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; some clients an object


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answered call


class FunctionIn(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always match when a call is forced (tool_choice required / named)


class ToolIn(BaseModel):
    type: Literal["function"]
    function: FunctionIn


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn]
    logprobs: bool = False
    max_completion_tokens: Int32 | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: the reply's first call only (as vLLM)


def refuse_unimplemented(body: SamplingFields) -> None:
    """Fields OpenAI defines that this server does not implement: refused naming the field, never
    silently ignored."""
    if isinstance(body, ChatCompletionRequest) and getattr(body, "echo", False):
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "echo: only /v1/completions echoes the prompt", "echo")
    extra = body.model_extra or {}
    asked = [name for name, off in UNIMPLEMENTED_FIELDS.items() if name in extra and extra[name] not in off]
    if asked:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{asked[0]}: not supported by this server", asked[0])


def _logprobs_asked(body: SamplingFields) -> int | None:
    """How many alternatives per token the request asks for (None: no logprobs)."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs: needs logprobs: true", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def sampling(body: SamplingFields, max_tokens: int | None) -> generation_pb2.SamplingParams:
    sp = generation_pb2.SamplingParams(ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens,
                                       stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
                                       stop_token_ids=list(body.stop_token_ids or []), top_k=body.top_k or 0)
    for name in ("temperature", "top_p", "seed", "repetition_penalty"):
        if getattr(body, name) is not None:
            setattr(sp, name, getattr(body, name))
    sp.presence_penalty, sp.frequency_penalty = body.presence_penalty, body.frequency_penalty
    sp.min_p, sp.min_tokens = body.min_p, body.min_tokens
    if (asked := _logprobs_asked(body)) is not None:
        sp.logprobs = asked
        if getattr(body, "echo", False):  # the echoed prompt's tokens come with theirs
            sp.prompt_logprobs = asked
    for token, bias in (body.logit_bias or {}).items():
        if not token.lstrip("-").isdigit() or not -(2**31) <= int(token) < 2**31:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"logit_bias: keys are token ids, got {token!r}",
                            "logit_bias")
        sp.logit_bias[int(token)] = bias
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    if (constraint := _constraint(body)) is not None:
        sp.structured_output.CopyFrom(constraint)
    return sp


def http_call(body: SamplingFields) -> HttpCall:
    asked = _constraints(body)
    return HttpCall(body.timeout, asked[0][0] if asked else None)


def _constraint(body: SamplingFields) -> generation_pb2.StructuredOutput | None:
    """The request's output constraint, from whichever of OpenAI's `response_format`, vLLM's
    `structured_outputs` or its older `guided_*` fields it uses (400 naming the field for two)."""
    asked = _constraints(body)
    if len(asked) > 1:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{asked[1][0]}: one output constraint per request "
                        f"({asked[0][0]} is given too)", asked[1][0])
    return asked[0][1] if asked else None


def _constraints(body: SamplingFields) -> list[tuple[str, generation_pb2.StructuredOutput]]:
    """(the field it came in, the constraint) of each constraint the request gives."""
    asked: list[tuple[str, generation_pb2.StructuredOutput]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", generation_pb2.StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "response_format.json_schema: needed with type "
                            "json_schema", "response_format.json_schema")
        schema = json.dumps(rf.json_schema.schema_)
        asked.append(("response_format", generation_pb2.StructuredOutput(json_schema=schema)))
    so = body.structured_outputs
    given = [] if so is None else [(name, value) for name, value in
                                   (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object or None))
                                   if value is not None]
    given += [(name.removeprefix("guided_"), getattr(body, name)) for name in
              ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(body, name) is not None]
    for name, value in given:
        if name == "json":
            msg = generation_pb2.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
        elif name == "choice":
            msg = generation_pb2.StructuredOutput(choice=generation_pb2.ChoiceList(choices=value))
        else:
            msg = generation_pb2.StructuredOutput(**{name: value})
        asked.append((f"structured_outputs.{name}" if so is not None else f"guided_{name}", msg))
    return asked



def sla(body: SamplingFields) -> generation_pb2.Sla:
    return generation_pb2.Sla(ttft_ms=body.sla.ttft_ms, tpot_ms=body.sla.tpot_ms) if body.sla else generation_pb2.Sla()


def message_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{index}].content: only text parts are "
                            f"supported, got {part.get('type')!r}", f"messages[{index}].content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)



def chat_request(body: ChatCompletionRequest) -> generation_pb2.GenerateRequest:
    """A chat request as the gRPC API's: OpenAI's `developer` role is the system prompt (as OpenAI treats
    it for models without a developer role); an unknown role is a 400 naming the message."""
    messages = []
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ROLES:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}].role: expected one of "
                            f"{', '.join((*ROLES, 'developer'))}, got {m.role!r}", f"messages[{i}].role")
        calls = [generation_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments
                                         if isinstance(c.function.arguments, str)
                                         else json.dumps(c.function.arguments, ensure_ascii=False))
                 for c in m.tool_calls or ()]
        messages.append(generation_pb2.ChatMessage(role=role, content=message_text(m.content, i),
                                                   reasoning_content=m.reasoning_content or "",
                                                   tool_calls=calls, tool_call_id=m.tool_call_id or ""))
    sp = sampling(body, body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens)
    tools = [generation_pb2.Tool(name=t.function.name, description=t.function.description or "",
                                 parameters=json.dumps(t.function.parameters) if t.function.parameters else "")
             for t in body.tools or ()]
    choice = body.tool_choice
    return generation_pb2.GenerateRequest(
        messages=messages, thinking=bool(body.chat_template_kwargs.get("thinking", False)), sampling_params=sp,
        priority=body.priority, sla=sla(body), tools=tools, cache_salt=body.cache_salt or "",
        tool_choice=choice.function.get("name", "") if isinstance(choice, NamedToolChoice) else choice or "")


def call_rules(body: ChatCompletionRequest) -> CallRules:
    """How the reply's tool calls are kept: the first only with parallel_tool_calls false; no content around a
    forced call (tool_choice required or naming a function)."""
    forced = bool(body.tools) and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice))
    return CallRules(single=body.parallel_tool_calls is False, forced=forced)
