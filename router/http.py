"""The OpenAI-compatible HTTP front door: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (streamed as server-sent events or whole), `GET /health`.

One request path behind both APIs: an HTTP request becomes the gRPC API's `GenerateRequest` and runs
through the same `GenerationServicer` generator, so admission, SLA targets, priority, fail-over,
cancellation and metrics are the gRPC path's. `HttpCall` is what that generator uses of a gRPC
ServicerContext (abort, deadline, trailing metadata); its aborts become OpenAI error bodies with
the matching HTTP status. FastAPI (on Starlette) parses and validates the JSON and uvicorn serves it:
no hand-written HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared import metrics
from shared.protocol.chat import ROLES
from shared.rpc.pdserve.v1 import generation_pb2

MAX_N = 16  # samples per prompt in one request
# Integers that travel as proto int32 / int64 (generation.proto): out of range is a 400 naming the field, not a
# proto assignment error (a 500) after parsing.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# Fields OpenAI or vLLM define that this server does not implement, with the values that ask for nothing.
UNIMPLEMENTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (None, False), "suffix": (None, ""), "prompt_logprobs": (None,),
}
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health")

# gRPC status → (HTTP status, OpenAI error type)
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class HttpAbort(Exception):
    """A request that ends with an OpenAI error body."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after_s = code, message, param, retry_after_s

    def response(self) -> JSONResponse:
        status, kind = HTTP_STATUS.get(self.code, (500, "internal_error"))
        headers = {"Retry-After": str(max(1, round(self.retry_after_s)))} if self.retry_after_s is not None else None
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": status}}
        return JSONResponse(body, status_code=status, headers=headers)


class HttpCall:
    """What the router's Generate path uses of a gRPC ServicerContext, for a call that came over HTTP:
    `abort` raises HttpAbort (with the Retry-After the SLA refusal set), `time_remaining` is the
    request's own timeout. An error about the output constraint names the field the request gave it in."""

    def __init__(self, timeout_s: float | None, constraint_field: str | None = None):
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.retry_after_s: float | None = None
        self.constraint_field = constraint_field

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        for key, value in metadata:
            if key == "retry-after-ms":
                self.retry_after_s = int(value) / 1e3

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        details = details.removeprefix("sampling_params.")  # the gRPC message's nesting; HTTP fields are flat
        if self.constraint_field and details.startswith("structured_output"):
            details = self.constraint_field + details.partition(":")[1] + details.partition(":")[2]
        named = re.match(r"([A-Za-z_][\w.\[\]]*)[: ]", details) if code == grpc.StatusCode.INVALID_ARGUMENT else None
        raise HttpAbort(code, details, named.group(1) if named else None, self.retry_after_s)


# -- request bodies (OpenAI's fields; the ones this server does not implement yet are refused by name) ----
class StreamOptions(BaseModel):
    include_usage: bool = False


class Sla(BaseModel):
    """pdserve's per-request latency targets (0: the router's --ttft-slo-ms / --tpot-slo-ms)."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0


class SamplingFields(BaseModel):
    """The sampling fields both endpoints take."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI's server and vLLM do

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
    parallel_tool_calls: bool | None = None  # the model decides how many calls it makes


def _refuse_unimplemented(body: SamplingFields) -> None:
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


def _sampling(body: SamplingFields, max_tokens: int | None) -> generation_pb2.SamplingParams:
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


def _call(body: SamplingFields) -> HttpCall:
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
    """One prompt's output, gathered from the generator."""

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

    def add_calls(self, deltas: Sequence[generation_pb2.ToolCallDelta]) -> None:
        for d in deltas:
            if d.index == len(self.tool_calls):
                self.tool_calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            self.tool_calls[d.index]["function"]["arguments"] += d.arguments_delta


def _call_deltas(deltas: Sequence[generation_pb2.ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed tool-call pieces as OpenAI's delta.tool_calls (id, type and name on a call's first piece)."""
    out = []
    for d in deltas:
        entry: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments_delta}}
        if d.id:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        out.append(entry)
    return out


def _usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)}}


class AuthAndCount:
    """API keys on /v1/ and the per-route, per-status count, as plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would relay every streamed chunk through an extra task and memory stream."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app, self.api_keys = app, [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else "other"  # bounded label values
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.api_keys and path.startswith("/v1/"):
                given = dict(scope["headers"]).get(b"authorization", b"").removeprefix(b"Bearer ").strip()
                if not any(secrets.compare_digest(given, key) for key in self.api_keys):
                    response = HttpAbort(grpc.StatusCode.UNAUTHENTICATED,
                                         "a valid API key is needed (Authorization: Bearer KEY)").response()
                    await response(scope, receive, counted)
                    return
            await self.app(scope, receive, counted)
        finally:
            metrics.HTTP_REQUESTS.labels(route, str(status)).inc()


class OpenAIFrontDoor:
    """The HTTP routes over a GenerationServicer (router.server)."""

    def __init__(self, servicer: Any, model_name: str, api_keys: list[str]):  # router.server.GenerationServicer
        self.servicer, self.model_name, self.api_keys = servicer, model_name, api_keys
        self.created = int(time.time())
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HttpAbort)
        async def aborted(_: Request, exc: HttpAbort) -> JSONResponse:
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid request"}
            name = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
            return HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {first['msg']}", name).response()

        app.add_middleware(AuthAndCount, api_keys=self.api_keys)

        @app.get("/health")
        async def health() -> Response:
            up = any(i.view.up for i in self.servicer.prefill.instances) and \
                any(i.view.up for i in self.servicer.decode.instances)
            return Response(status_code=200 if up else 503)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str) -> dict[str, Any]:
            self._check_model(name)
            return self._model_card()

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            self._check_model(body.model)
            _refuse_unimplemented(body)
            prompts = self._prompts(body.prompt)
            if body.stream and len(prompts) > 1:
                raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: one prompt per streamed request", "prompt")
            prompt_only = body.max_tokens == 0
            if prompt_only and not body.echo:
                raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be > 0 (0 only with echo)",
                                "max_tokens")
            sp = _sampling(body, 1 if prompt_only else body.max_tokens)
            reqs = [generation_pb2.GenerateRequest(sampling_params=sp, priority=body.priority, sla=_sla(body), **p)
                    for p in prompts]
            echoes = [Echo(r.prompt or self._detokenize(list(r.prompt_token_ids)), prompt_only) for r in reqs] \
                if body.echo else None
            return await self._respond(body, reqs, request, "text_completion", echoes=echoes)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            self._check_model(body.model)
            _refuse_unimplemented(body)
            thinking = bool(body.chat_template_kwargs.get("thinking", False))
            messages = []
            for i, m in enumerate(body.messages):
                if m.role not in ROLES:
                    raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}].role: expected one of "
                                    f"{', '.join(ROLES)}, got {m.role!r}", f"messages[{i}].role")
                calls = [generation_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments
                                                 if isinstance(c.function.arguments, str)
                                                 else json.dumps(c.function.arguments, ensure_ascii=False))
                         for c in m.tool_calls or ()]
                messages.append(generation_pb2.ChatMessage(role=m.role, content=_text(m.content, i),
                                                           reasoning_content=m.reasoning_content or "",
                                                           tool_calls=calls, tool_call_id=m.tool_call_id or ""))
            sp = _sampling(body, body.max_completion_tokens if body.max_completion_tokens is not None
                           else body.max_tokens)
            tools = [generation_pb2.Tool(name=t.function.name, description=t.function.description or "",
                                         parameters=json.dumps(t.function.parameters) if t.function.parameters
                                         else "") for t in body.tools or ()]
            choice = body.tool_choice
            req = generation_pb2.GenerateRequest(
                messages=messages, thinking=thinking, sampling_params=sp, priority=body.priority, sla=_sla(body),
                tools=tools, tool_choice=choice.function.get("name", "") if isinstance(choice, NamedToolChoice)
                else choice or "")
            return await self._respond(body, [req], request, "chat.completion")

        return app

    def _token(self, token_id: int) -> str:
        tok = self.servicer.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def _detokenize(self, ids: list[int]) -> str:
        """An echoed prompt given as token ids, as text (empty for a model without a tokenizer)."""
        tok = self.servicer.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None and ids else ""

    def _completion_logprobs(self, lps: list[generation_pb2.TokenLogprob], prompt_ids: list[int] | None = None,
                             prompt_lps: list[generation_pb2.TokenLogprob] | None = None) -> dict[str, Any] | None:
        """The completions API's logprobs object (tokens, token_logprobs, top_logprobs, text_offset); an
        echoed prompt's tokens first, its first token's logprob null (nothing comes before it)."""
        entries: list[tuple[int, generation_pb2.TokenLogprob | None]] = [(prompt_ids[0], None)] if prompt_ids else []
        entries += [(lp.token_id, lp) for lp in (*(prompt_lps or ()), *lps)]
        if not entries:
            return None
        tokens = [self._token(t) for t, _ in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        return {"tokens": tokens, "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
                "text_offset": offsets,
                "top_logprobs": [{self._token(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)} if lp else None
                                 for _, lp in entries]}

    def _chat_logprobs(self, lps: list[generation_pb2.TokenLogprob]) -> dict[str, Any] | None:
        """The chat API's logprobs object: content, one entry per token with its top alternatives."""
        if not lps:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}
                            for lp in lps]}

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": self.servicer.limits.context_tokens}

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise HttpAbort(grpc.StatusCode.NOT_FOUND, f"model {name!r} does not exist; this server serves "
                            f"{self.model_name!r}", "model")

    @staticmethod
    def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[dict[str, Any]]:
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if not prompt:
            raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty", "prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]

    async def _respond(self, body: SamplingFields, reqs: list[generation_pb2.GenerateRequest], request: Request,
                       kind: Literal["text_completion", "chat.completion"],
                       echoes: list[Echo] | None = None) -> Response:
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        samples = _samples(reqs, body.n)
        per_sample = [echoes[i // body.n] if echoes else None for i in range(len(samples))]
        if body.stream:
            gens = [self._generate(req, _call(body)) for req in samples]
            # every sample's first message (or its refusal) before the 200, the samples started together:
            # admission errors keep their status
            firsts = await asyncio.gather(*(anext(g, None) for g in gens), return_exceptions=True)
            failed = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failed is not None:
                for g in gens:
                    await g.aclose()
                raise failed
            streams = [OpenStream(first, g) for first, g in zip(firsts, gens, strict=True)]
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(rid, kind, streams, include_usage, per_sample),
                                     media_type="text/event-stream")
        choices = await self._gather(samples, body, request)
        for choice, echo in zip(choices, per_sample, strict=True):
            if echo is not None:
                _echo(choice, echo)
        return JSONResponse(self._whole(rid, kind, choices))

    def _generate(self, req: generation_pb2.GenerateRequest, call: HttpCall
                  ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        return self.servicer.generate(req, call, open_ended=True)

    async def _gather(self, reqs: list[generation_pb2.GenerateRequest], body: SamplingFields, request: Request
                      ) -> list[Choice]:
        """Every prompt's whole output; a client that disconnects first cancels them (their KV is freed)."""
        async def one(req: generation_pb2.GenerateRequest) -> Choice:
            choice = Choice()
            async for msg in self._generate(req, _call(body)):
                choice.reasoning += msg.reasoning_text
                choice.text += msg.text
                choice.add_calls(msg.tool_calls)
                choice.token_ids += msg.token_ids
                choice.logprobs += msg.logprobs
                choice.prompt_token_ids += msg.prompt_token_ids
                choice.prompt_logprobs += msg.prompt_logprobs
                if msg.finish_reason:
                    choice.finish_reason = msg.finish_reason
                    usage = msg.usage
                    choice.prompt_tokens, choice.completion_tokens = usage.prompt_tokens, usage.completion_tokens
                    choice.cached_tokens = usage.cached_prompt_tokens
            return choice

        work = asyncio.ensure_future(asyncio.gather(*(one(r) for r in reqs)))
        while not work.done():
            await asyncio.wait([work], timeout=0.5)
            if not work.done() and await request.is_disconnected():
                work.cancel()
        return work.result()

    def _whole(self, rid: str, kind: str, choices: list[Choice]) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                               "usage": _usage(choices)}
        if kind == "text_completion":
            out["choices"] = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                               "logprobs": self._completion_logprobs(c.logprobs, c.prompt_token_ids,
                                                                     c.prompt_logprobs)}
                              for i, c in enumerate(choices)]
        else:
            out["choices"] = [{"index": i, "finish_reason": c.finish_reason,
                               "logprobs": self._chat_logprobs(c.logprobs),
                               "message": {"role": "assistant", "content": c.text or None if c.tool_calls else c.text,
                                           "reasoning_content": c.reasoning or None,
                                           **({"tool_calls": c.tool_calls} if c.tool_calls else {})}}
                              for i, c in enumerate(choices)]
        return out

    async def _sse(self, rid: str, kind: str, streams: list[OpenStream], include_usage: bool,
                   echoes: list[Echo | None]) -> AsyncIterator[str]:
        """Server-sent events: one chunk per step of each sample (`index` tells them apart), then usage
        (when asked) and `data: [DONE]`; an echoed prompt leads a sample's first chunk. A client that
        disconnects closes this generator, which cancels every sample's request (their KV is freed)."""
        chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        created = int(time.time())
        usage = [Choice() for _ in streams]

        def chunk(choice: dict[str, Any]) -> str:
            return "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created,
                                          "model": self.model_name, "choices": [choice]}) + "\n\n"

        if kind != "text_completion":
            for i in range(len(streams)):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        events = _merged(streams)
        try:
            async for index, msg in events:
                if isinstance(msg, HttpAbort):  # after the 200: the error travels as an event, as OpenAI's do
                    yield "data: " + json.dumps(json.loads(msg.response().body)) + "\n\n"
                else:
                    finish = msg.finish_reason or None
                    if kind == "text_completion":
                        piece = Choice(msg.text, finish_reason=finish, completion_tokens=msg.usage.completion_tokens,
                                       logprobs=list(msg.logprobs), prompt_token_ids=list(msg.prompt_token_ids),
                                       prompt_logprobs=list(msg.prompt_logprobs))
                        if (echo := echoes[index]) is not None:
                            _echo(piece, echo)
                            echoes[index] = Echo("", echo.prompt_only)  # the prompt leads the first chunk only
                        yield chunk({"index": index, "text": piece.text, "finish_reason": piece.finish_reason,
                                     "logprobs": self._completion_logprobs(piece.logprobs, piece.prompt_token_ids,
                                                                           piece.prompt_logprobs)})
                    else:
                        delta: dict[str, Any] = {k: v for k, v in (("reasoning_content", msg.reasoning_text),
                                                                   ("content", msg.text)) if v}
                        if msg.tool_calls:
                            delta["tool_calls"] = _call_deltas(msg.tool_calls)
                        yield chunk({"index": index, "delta": delta, "finish_reason": finish,
                                     "logprobs": self._chat_logprobs(list(msg.logprobs))})
                    if finish:
                        prompt_only = echoes[index] is not None and echoes[index].prompt_only
                        usage[index] = Choice(prompt_tokens=msg.usage.prompt_tokens,
                                              cached_tokens=msg.usage.cached_prompt_tokens,
                                              completion_tokens=0 if prompt_only else msg.usage.completion_tokens)
        finally:  # the client left (or all ended): stop every sample's request
            await events.aclose()
        if include_usage:
            yield "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created,
                                         "model": self.model_name, "choices": [], "usage": _usage(usage)}) + "\n\n"
        yield "data: [DONE]\n\n"


async def _merged(streams: list[OpenStream]
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


def _echo(choice: Choice, echo: Echo) -> None:
    """The prompt before the completion (max_tokens 0: instead of it, the one token generated dropped)."""
    if echo.prompt_only:
        choice.text, choice.token_ids, choice.logprobs, choice.completion_tokens = "", [], [], 0
        if choice.finish_reason:
            choice.finish_reason = "length"
    choice.text = echo.text + choice.text


def _samples(reqs: list[generation_pb2.GenerateRequest], n: int) -> list[generation_pb2.GenerateRequest]:
    """`n` samples of each prompt, in OpenAI's choice order (prompt-major). They run as `n` requests: the
    prefill's prefix cache computes the shared prompt once (its last block excepted). With a seed,
    sample i draws with seed + i, so the whole response replays."""
    if n < 1 or n > MAX_N:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"n: expected 1..{MAX_N}, got {n}", "n")
    out = []
    for req in reqs:
        for i in range(n):
            copy = generation_pb2.GenerateRequest()
            copy.CopyFrom(req)
            if i and copy.sampling_params.HasField("seed"):
                copy.sampling_params.seed = (copy.sampling_params.seed + i) % 2**63
            out.append(copy)
    return out


def _sla(body: SamplingFields) -> generation_pb2.Sla:
    return generation_pb2.Sla(ttft_ms=body.sla.ttft_ms, tpot_ms=body.sla.tpot_ms) if body.sla else generation_pb2.Sla()


def _text(content: str | list[dict[str, Any]] | None, index: int) -> str:
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


def read_api_keys(path: str | None) -> list[str]:
    """One key per line of --api-key-file (empty: no keys, no authentication)."""
    if not path:
        return []
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


async def start_http(app: FastAPI, host: str, port: int, tls_cert: str | None = None,
                     tls_key: str | None = None) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Serve `app` with uvicorn on the running event loop (the gRPC server's); port 0 picks a free one.
    Returns the server, its task and the bound port once it accepts connections."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", ssl_certfile=tls_cert, ssl_keyfile=tls_key, http="httptools",
                            timeout_graceful_shutdown=5, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises the reason it could not start
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]
