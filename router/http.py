"""The OpenAI-compatible HTTP front door: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (streamed as server-sent events or whole), `GET /health`.

One request path behind both APIs: an HTTP request becomes the gRPC API's `GenerateRequest` and runs
through the same `GenerationServicer` generator, so admission, SLA targets, priority, fail-over,
cancellation and metrics are the gRPC path's. `HttpCall` is what that generator uses of a gRPC
ServicerContext (abort, deadline, trailing metadata); its aborts become OpenAI error bodies with
the matching HTTP status (router.openai_errors: every route and status answers OpenAI's body). FastAPI
(on Starlette) parses and validates the JSON (router.openai_models) and uvicorn serves it: no
hand-written HTTP. A request's prompts and samples fan out through router.openai_fanout (one prefill per
prompt, all or nothing); router.openai_limits bounds the body and the prompts. Each endpoint family renders
its own choices: router.openai_completions (prompts, echo, the legacy logprobs) and router.openai_chat.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import fastapi.routing
import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import MAX_BODY_BYTES, MAX_PROMPTS
from router.hint import PairHint
from router.openai_chat import ChatFormat
from router.openai_choices import CallRules, Choice, OpenStream, TokenText, merged, spent, usage
from router.openai_completions import CompletionFormat, completion_requests
from router.openai_errors import HTTP_STATUS, HttpAbort, HttpCall, install_error_handlers
from router.openai_fanout import PrefixWatch, check_n, fan_out, samples
from router.openai_limits import BodyLimit, check_prompts
from router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    call_rules,
    chat_request,
    http_call,
    refuse_unimplemented,
)
from shared import metrics
from shared.rpc.pdserve.v1 import generation_pb2

__all__ = ["HTTP_STATUS", "HttpAbort", "HttpCall", "OpenAIFrontDoor", "read_api_keys", "start_http"]
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health")
ChoiceFormat = CompletionFormat | ChatFormat  # an endpoint family's choices, whole or streamed


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
    """The HTTP routes over a GenerationServicer (router.server). `max_body_bytes` and `max_prompts` bound one
    request (413 / 400 beyond)."""

    def __init__(self, servicer: Any, model_name: str, api_keys: list[str],  # router.server.GenerationServicer
                 max_body_bytes: int = MAX_BODY_BYTES, max_prompts: int = MAX_PROMPTS):
        self.servicer, self.model_name, self.api_keys = servicer, model_name, api_keys
        self.max_body_bytes, self.max_prompts = max_body_bytes, max_prompts
        self.tokens = TokenText(servicer.tokenizer)
        self.created = int(time.time())
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)
        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        app.add_middleware(AuthAndCount, api_keys=self.api_keys)  # outermost: a 413 is counted too

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
            refuse_unimplemented(body)
            check_n(body.n)
            reqs, echoes = completion_requests(body, self.tokens, self.max_prompts,
                                               self.servicer.cfg.max_concurrent_requests)
            per_sample = [echoes[i // body.n] if echoes else None for i in range(len(reqs) * body.n)]
            return await self._respond(body, reqs, request, CompletionFormat(self.tokens, per_sample))

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            self._check_model(body.model)
            refuse_unimplemented(body)
            check_n(body.n)
            check_prompts(1, body.n, self.max_prompts, self.servicer.cfg.max_concurrent_requests)
            return await self._respond(body, [chat_request(body)], request, ChatFormat(self.tokens),
                                       rules=call_rules(body))

        return app

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": self.servicer.limits.context_tokens}

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise HttpAbort(grpc.StatusCode.NOT_FOUND, f"model {name!r} does not exist; this server serves "
                            f"{self.model_name!r}", "model")

    async def _respond(self, body: SamplingFields, reqs: list[generation_pb2.GenerateRequest], request: Request,
                       fmt: ChoiceFormat, rules: CallRules | None = None) -> Response:
        """`n` samples of each prompt (router.openai_fanout: one prefill per prompt, all or nothing), streamed
        (every sample's first message, or its refusal, before the 200: admission errors keep their status) or
        whole (a client that disconnects first cancels them: their KV is freed)."""
        rid = fmt.id_prefix + uuid.uuid4().hex
        todo = samples(reqs, body.n)
        calls = [http_call(body) for _ in todo]  # made together: the request's timeout runs from now for all
        hint = PairHint.from_headers(request.headers)  # the endpoint picker's pair (router.epp), if it named one
        for call in calls:
            call.hint = hint
        gens = [self._generate(req, call, rules) for req, call in zip(todo, calls, strict=True)]
        # a prompt's logprobs are computed over the whole prompt (no prefix-cache hit): then nothing to share
        shared = not reqs[0].sampling_params.HasField("prompt_logprobs")

        def watch() -> PrefixWatch:
            return PrefixWatch(lambda: self.servicer.prefill.instances)

        if body.stream:
            async def first(i: int, opened: Callable[[], None]) -> generation_pb2.GenerateResponse | None:
                msg = await anext(gens[i], None)
                opened()
                return msg

            try:
                firsts = await fan_out(len(todo), body.n, first, watch, shared)
            except BaseException:
                for g in gens:
                    await g.aclose()
                raise
            streams = [OpenStream(f, g) for f, g in zip(firsts, gens, strict=True)]
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(rid, fmt, streams, include_usage, body.n),
                                     media_type="text/event-stream")

        async def whole(i: int, opened: Callable[[], None]) -> Choice:
            choice = Choice()
            try:
                async for msg in gens[i]:
                    opened()
                    choice.add(msg)
            finally:
                await gens[i].aclose()
            return choice

        work = asyncio.ensure_future(fan_out(len(todo), body.n, whole, watch, shared))
        while not work.done():
            await asyncio.wait([work], timeout=0.5)
            if not work.done() and await request.is_disconnected():
                work.cancel()
        return JSONResponse(self._whole(rid, fmt, work.result(), body.n))

    def _generate(self, req: generation_pb2.GenerateRequest, call: HttpCall, rules: CallRules | None
                  ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """One sample's messages from the router's generate path, its tool calls kept as `rules` say."""
        gen = self.servicer.generate(req, call, open_ended=True)
        return gen if rules is None or not rules.active else _ruled(gen, rules)

    def _whole(self, rid: str, fmt: ChoiceFormat, choices: list[Choice], n: int) -> dict[str, Any]:
        shown = fmt.whole(choices)  # first: an echo-only choice's usage counts no completion
        return {"id": rid, "object": fmt.kind, "created": int(time.time()), "model": self.model_name,
                "usage": usage(choices, n), "choices": shown}

    async def _sse(self, rid: str, fmt: ChoiceFormat, streams: list[OpenStream], include_usage: bool,
                   n: int) -> AsyncIterator[str]:
        """Server-sent events: one chunk per step of each sample (`index` tells them apart), then usage
        (when asked) and `data: [DONE]`; an echoed prompt leads a sample's first chunk. A client that
        disconnects closes this generator, which cancels every sample's request (their KV is freed)."""
        created = int(time.time())
        used = [Choice() for _ in streams]  # each sample's usage

        def event(body: dict[str, Any]) -> str:
            return "data: " + json.dumps(body) + "\n\n"

        def chunk(choice: dict[str, Any]) -> str:
            return event({"id": rid, "object": fmt.chunk_kind, "created": created, "model": self.model_name,
                          "choices": [choice]})

        for opening in fmt.opening(len(streams)):
            yield chunk(opening)
        events = merged(streams)
        try:
            async for index, msg in events:
                if isinstance(msg, HttpAbort):  # after the 200: the error travels as an event, as OpenAI's do
                    yield event(json.loads(msg.response().body))
                    continue
                yield chunk(fmt.chunk(index, msg))
                if msg.finish_reason:
                    used[index] = spent(msg, fmt.prompt_only(index))
        finally:  # the client left (or all ended): stop every sample's request
            await events.aclose()
        if include_usage:
            yield event({"id": rid, "object": fmt.chunk_kind, "created": created, "model": self.model_name,
                         "choices": [], "usage": usage(used, n)})
        yield "data: [DONE]\n\n"


async def _ruled(gen: AsyncGenerator[generation_pb2.GenerateResponse, None], rules: CallRules
                 ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    try:
        async for msg in gen:
            rules.apply(msg)
            yield msg
    finally:
        await gen.aclose()  # closed early (a client that left, a failed sibling): the request is cancelled


LAZY_ANYIO = ("connect_tcp", "create_memory_object_stream")  # a streamed reply's first use loads these modules


async def load_first_request_costs(app: ASGIApp) -> None:
    """What the first request would otherwise pay, paid before the server accepts one (the first completion
    through `pdserve up` took 58-75 ms against 20-30 ms warm): anyio (4.x) imports its modules and its asyncio
    backend on first use (~12 + ~12 ms), and FastAPI reads each endpoint's source on the endpoint's first call
    to name it in error messages (inspect.getsourcelines: ~14 ms, tokenizing this file), cached by endpoint."""
    for name in LAZY_ANYIO:
        getattr(anyio, name)
    await anyio.sleep(0)  # loads the running loop's backend
    extract = getattr(fastapi.routing, "_extract_endpoint_context", None)  # FastAPI's cache, where it has one
    while not isinstance(app, FastAPI) and hasattr(app, "app"):  # under our gates (router.drain.DrainGate)
        app = app.app
    if extract is not None and isinstance(app, FastAPI):
        for route in app.routes:
            if isinstance(route, APIRoute):
                extract(route.dependant.call)


def read_api_keys(path: str | None) -> list[str]:
    """One key per line of --api-key-file (empty: no keys, no authentication)."""
    if not path:
        return []
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


async def start_http(app: FastAPI, host: str, port: int, tls_cert: str | None = None,
                     tls_key: str | None = None) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Serve `app` with uvicorn on the running event loop (the gRPC server's); port 0 picks a free one.
    Returns the server, its task and the bound port once it accepts connections."""
    await load_first_request_costs(app)
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
