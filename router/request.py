"""A client's request, validated once at the router's front into a frozen `GenerationRequest`: the prompt's
token ids, the sampling parameters (a forced tool call's grammar, thinking mode's `after_reasoning` and an
open-ended chat's max_tokens already applied), the priority, the latency targets and how the reply is parsed.
The client's message is never changed; what prefill and decode are sent is built from the dataclass. The gRPC
API's `GenerateRequest` and the HTTP API's requests (router.http builds the same message) take this one path,
so a bad field is refused in the same words (INVALID_ARGUMENT / HTTP 400, naming the field) by both."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import re
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from router.reply import ReplyShape
from shared.protocol.chat import ChatMessage, render_messages
from shared.protocol.limits import RequestLimits, check_cache_salt
from shared.protocol.sampling import SamplingParams
from shared.protocol.structured import ConstraintCompiler, ConstraintKind, StructuredOutput
from shared.protocol.tokenizer import Tokenizer
from shared.protocol.tools import ToolCall, ToolFunction, tool_call_grammar
from shared.rpc.convert import sampling_from_proto
from shared.rpc.pdserve.v1 import generation_pb2

MAX_REQUEST_ID = 128
REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:/-]*")
MAX_MESSAGES = 1024
MAX_TOOLS = 128


class Invalid(ValueError):
    """A request the router refuses before any work; the message names the field."""


class PromptSource(enum.Enum):
    """Which of a GenerateRequest's prompt fields carries the prompt (exactly one is set)."""

    PROMPT = "prompt"
    PROMPT_TOKEN_IDS = "prompt_token_ids"
    MESSAGES = "messages"


@dataclass(frozen=True)
class GenerationRequest:
    """A request that passed validation: everything the rest of the router's path reads of it."""

    request_id: str  # the client's (a label echoed in every response; internal ids are the router's)
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # as prefill and decode are sent it (read-only from here on)
    reply: ReplyShape  # how the reply text is parsed (thinking mode's reasoning, tool calls)
    priority: int = 0  # lower is more urgent
    ttft_ms: float = 0.0  # the request's own latency targets (0: the router's --ttft-slo-ms / --tpot-slo-ms)
    tpot_ms: float = 0.0
    cache_salt: str = ""  # the tenant's prefix-cache namespace (prefill's keys and the router's guess chain from it)


class Malformed:
    """What the lenient deserializer hands the handler for bytes that are no GenerateRequest."""

    def __init__(self, reason: str):
        self.reason = reason


def lenient(parse: Callable[[bytes], generation_pb2.GenerateRequest]
            ) -> Callable[[bytes], generation_pb2.GenerateRequest | Malformed]:
    """A request that does not parse (e.g. a string field that is not UTF-8) becomes INVALID_ARGUMENT
    in the handler instead of gRPC's INTERNAL."""
    def deserialize(data: bytes) -> generation_pb2.GenerateRequest | Malformed:
        try:
            return parse(data)
        except DecodeError as exc:
            return Malformed(str(exc) or "malformed request")
    return deserialize


class RequestParser:
    """GenerateRequest → GenerationRequest, or Invalid naming the field. Sizes are checked before any work
    (tokenizing included); prompts are tokenized and constraints compiled on `executor` (the tokenizer
    releases the GIL) so a long prompt delays no one."""

    def __init__(self, tokenizer: Tokenizer | None, limits: RequestLimits, constraints: ConstraintCompiler,
                 max_prompt_bytes: int, chat_max_tokens: int, executor: Executor):
        self.tokenizer, self.limits, self.constraints = tokenizer, limits, constraints
        self.max_prompt_bytes, self.chat_max_tokens, self.executor = max_prompt_bytes, chat_max_tokens, executor

    async def parse(self, request: generation_pb2.GenerateRequest | Malformed,
                    open_ended: bool = False) -> GenerationRequest:
        """`open_ended` (HTTP chat): without max_tokens the reply may run to --chat-max-tokens, never past
        the context."""
        if isinstance(request, Malformed):
            raise Invalid(f"request: not a valid GenerateRequest ({request.reason}); strings must be UTF-8")
        self._check_sizes(request)
        source = self._source(request)
        _check_sla(request.sla)
        try:
            params = sampling_from_proto(request.sampling_params)
            params.validate()
        except ValueError as exc:
            raise Invalid(f"sampling_params.{exc}") from exc
        tools, choice = _tools(request, source)
        params, reply = _reply(params, tools, choice, thinking=source is PromptSource.MESSAGES and request.thinking)
        if params.structured is not None:
            await self._compile(params.structured)
        ids = await self._prompt_ids(request, source, tools if choice != "none" else ())
        if open_ended and not request.sampling_params.HasField("max_tokens"):
            params = dataclasses.replace(
                params, max_tokens=max(1, min(self.chat_max_tokens, self.limits.context_tokens - len(ids))))
        try:
            self.limits.check_prompt_ids(ids, source.value)
            self.limits.check_length(len(ids), params.max_tokens, "sampling_params.max_tokens")
            self.limits.check_sampling(params)
        except ValueError as exc:
            raise Invalid(str(exc)) from exc
        return GenerationRequest(request.request_id, tuple(ids), params, reply, request.priority,
                                 request.sla.ttft_ms, request.sla.tpot_ms, request.cache_salt)

    def _check_sizes(self, request: generation_pb2.GenerateRequest) -> None:
        """The bounds read before anything else is: the id, the counts, the text's bytes, the token ids."""
        if len(request.request_id) > MAX_REQUEST_ID or not REQUEST_ID_CHARS.fullmatch(request.request_id):
            raise Invalid(f"request_id: at most {MAX_REQUEST_ID} characters of [A-Za-z0-9._:/-]")
        try:
            check_cache_salt(request.cache_salt)
        except ValueError as exc:
            raise Invalid(str(exc)) from exc
        if len(request.messages) > MAX_MESSAGES:
            raise Invalid(f"messages: at most {MAX_MESSAGES} messages, got {len(request.messages)}")
        if len(request.tools) > MAX_TOOLS:
            raise Invalid(f"tools: at most {MAX_TOOLS} tools, got {len(request.tools)}")
        size = len(request.prompt.encode()) + sum(
            len(m.content.encode()) + len(m.reasoning_content.encode())
            + sum(len(c.arguments.encode()) + len(c.name.encode()) for c in m.tool_calls) for m in request.messages
        ) + sum(len(t.name.encode()) + len(t.description.encode()) + len(t.parameters.encode()) for t in request.tools)
        if size > self.max_prompt_bytes:
            raise Invalid(f"prompt: {size} bytes of text exceed the limit of {self.max_prompt_bytes}")
        if len(request.prompt_token_ids) > self.limits.context_tokens:  # before the rest is read
            raise Invalid(f"prompt_token_ids: {len(request.prompt_token_ids)} tokens exceed the model's context "
                          f"of {self.limits.context_tokens}")

    def _source(self, request: generation_pb2.GenerateRequest) -> PromptSource:
        given = [source for source, present in ((PromptSource.PROMPT, bool(request.prompt)),
                                                (PromptSource.PROMPT_TOKEN_IDS, len(request.prompt_token_ids) > 0),
                                                (PromptSource.MESSAGES, len(request.messages) > 0)) if present]
        if len(given) != 1:
            names = " and ".join(s.value for s in given)
            raise Invalid("exactly one of prompt, prompt_token_ids and messages must be set"
                          + (f" ({names} were {'both' if len(given) == 2 else 'all'} set)" if given
                             else " (all are empty)"))
        if given[0] is not PromptSource.PROMPT_TOKEN_IDS and self.tokenizer is None:
            raise Invalid(f"{given[0].value}: this model has no tokenizer; send prompt_token_ids")
        return given[0]

    async def _compile(self, structured: StructuredOutput) -> None:
        """The constraint compiled before any work (cached: a schema compiles once), on the tokenizer threads."""
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.constraints.matcher, structured)
        except ValueError as exc:
            raise Invalid(str(exc) if str(exc).startswith("structured_output") else
                          f"sampling_params.structured_output: {exc}") from exc

    async def _prompt_ids(self, request: generation_pb2.GenerateRequest, source: PromptSource,
                          tools: list[ToolFunction] | tuple[()]) -> list[int]:
        """The prompt's token ids: given, or the text (chat messages rendered with `tools`) tokenized."""
        if source is PromptSource.PROMPT_TOKEN_IDS:
            return list(request.prompt_token_ids)
        if source is PromptSource.PROMPT:
            return await self._encode(request.prompt)
        try:
            text = render_messages([ChatMessage(m.role, m.content, m.reasoning_content,
                                                tuple(ToolCall(c.name, c.arguments, c.id) for c in m.tool_calls),
                                                m.tool_call_id) for m in request.messages],
                                   thinking=request.thinking, tools=tools)
        except ValueError as exc:
            raise Invalid(str(exc)) from exc
        return await self._encode(text)

    async def _encode(self, text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.tokenizer.encode, text)


def _check_sla(sla: generation_pb2.Sla) -> None:
    for name in ("ttft_ms", "tpot_ms"):
        value = getattr(sla, name)
        if not (value >= 0 and value < float("inf")):
            raise Invalid(f"sla.{name}: must be a finite number >= 0, got {value}")


def _tools(request: generation_pb2.GenerateRequest, source: PromptSource) -> tuple[list[ToolFunction], str]:
    """The request's tools and its tool_choice (default "auto" with tools), validated naming the field."""
    if request.tools and source is not PromptSource.MESSAGES:
        raise Invalid("tools: only with messages (the chat encoding renders them)")
    tools = []
    for i, t in enumerate(request.tools):
        try:
            parameters = json.loads(t.parameters) if t.parameters else {}
            if not isinstance(parameters, dict):
                raise ValueError("must be a JSON schema object")
            tool = ToolFunction(t.name, t.description, parameters)
            tool.validate(f"tools[{i}]")
        except ValueError as exc:
            raise Invalid(str(exc) if str(exc).startswith("tools[") else f"tools[{i}].parameters: {exc}") from exc
        tools.append(tool)
    if len({t.name for t in tools}) != len(tools):
        raise Invalid("tools: function names must be distinct")
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice not in ("auto", "none", "required") and choice not in {t.name for t in tools}:
        raise Invalid(f"tool_choice: expected auto, none, required or one of the tools' names, got {choice!r}")
    if choice != "none" and not tools:
        raise Invalid(f"tool_choice: {choice!r} needs tools")
    return tools, choice


def _reply(params: SamplingParams, tools: list[ToolFunction], choice: str, thinking: bool
           ) -> tuple[SamplingParams, ReplyShape]:
    """The sampling parameters the reply's shape asks for, and that shape: a forced call's grammar (it makes
    the call), special tokens kept when the reply is parsed (</think> and the end of the calls must reach the
    parser), a constraint that starts after the reasoning in thinking mode."""
    forced = choice == "required" or choice in {t.name for t in tools}
    if forced:
        if params.structured is not None:
            raise Invalid(f"tool_choice: a forced tool call ({choice!r}) cannot take structured_output too")
        grammar = tool_call_grammar(tools, None if choice == "required" else choice)
        params = dataclasses.replace(params, structured=StructuredOutput(ConstraintKind.GRAMMAR, grammar))
    reply = ReplyShape(thinking, tuple(tools) if tools and choice != "none" else None, forced=forced)
    if reply.parses:
        params = dataclasses.replace(params, skip_special_tokens=False)
    if params.structured is not None and thinking:  # the constraint is the answer's, after the reasoning
        params = dataclasses.replace(params, structured=dataclasses.replace(params.structured, after_reasoning=True))
    return params, reply


__all__ = ["GenerationRequest", "Invalid", "Malformed", "PromptSource", "RequestParser", "lenient"]
