"""The Gateway API Inference Extension's Endpoint Picker (EPP) on the router's `--epp-port`: the Envoy
`ext_proc` service (envoy.service.ext_proc.v3.ExternalProcessor) a Kubernetes Gateway (kgateway, Istio, Envoy
Gateway, GKE) asks, per HTTP request to an `InferencePool`, which endpoint serves it.

The pool's endpoints are pdserve routers (their OpenAI HTTP port): the router is what speaks HTTP. The EPP reads
the request body (an OpenAI completion or chat request), places it as a router would (the same policy, SLA
targets and KV index, over the same pools: GenerationServicer.plan) and answers, as the protocol says, with the
`x-gateway-destination-endpoint` header and the same value in the `envoy.lb` dynamic metadata: the routers to
try, in order (the proxy's `envoy.lb.subset_hint` subset when it sends one, else `--epp-endpoints`). The chosen
(prefill, decode) pair goes along in router.hint's headers; the router that gets the request places it there when
its own policy admits that pair. No pair can meet the request's targets: 429 with Retry-After; no endpoint or no
instance up: 503 (ImmediateResponse, OpenAI's error body). A body it cannot place (not JSON, another route, a
request the router will refuse) still gets an endpoint, with no pair: the router answers it, with its own error.

Bodies arrive as the gateway's ext_proc filter sends them (the ProtocolConfiguration of the first message; absent:
FULL_DUPLEX_STREAMED, the inference extension's): full-duplex streamed, the headers are answered once the body is
complete and the body is sent back as it came; buffered, the header mutation rides on the body's answer.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from pydantic import ValidationError

from router.hint import LOCAL, PairHint
from router.openai_choices import TokenText
from router.openai_completions import completion_requests
from router.openai_errors import HTTP_TYPES, HttpAbort
from router.openai_models import ChatCompletionRequest, CompletionRequest, chat_request
from router.policy import Rejected
from router.request import Invalid
from shared import metrics
from shared.rpc.pdserve.v1 import generation_pb2

log = logging.getLogger("pdserve.router")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION = "x-gateway-destination-endpoint"  # header and envoy.lb metadata key: the endpoints, best first
SUBSET = "x-gateway-destination-endpoint-subset"  # the proxy's envoy.lb.subset_hint key: pick only from these
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX, BUFFERED = Mode.FULL_DUPLEX_STREAMED, (Mode.BUFFERED, Mode.BUFFERED_PARTIAL)
ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


class Refusal(Exception):
    """The request is answered here, with this HTTP status (OpenAI's error body)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s


@dataclass
class Exchange:
    """One HTTP request's ext_proc stream: what has arrived of it."""

    request_mode: int = FULL_DUPLEX
    response_mode: int = FULL_DUPLEX
    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None
    body: bytearray = field(default_factory=bytearray)
    picked: bool = False
    answered: bool = False  # an immediate response ended the request: the rest of the stream is not read


def _header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    return {h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in headers.headers}


def _subset(request: ext.ProcessingRequest) -> list[str] | None:
    """The proxy's subset of endpoints to pick from (None: it sent none; empty: none is eligible)."""
    hint = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    items = value.list_value.values if value.HasField("list_value") else [value]
    return [x for v in items for x in v.string_value.split(",") if x.strip()]


def _common(headers: dict[str, str] | None = None, body: bytes | None = None, end: bool = True
            ) -> ext.CommonResponse:
    common = ext.CommonResponse()
    for key, value in (headers or {}).items():
        common.header_mutation.set_headers.add(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                               append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    if body is not None:
        common.body_mutation.streamed_response.body = body
        common.body_mutation.streamed_response.end_of_stream = end
    return common


def _immediate(refusal: Refusal) -> ext.ProcessingResponse:
    body = {"error": {"message": str(refusal), "type": HTTP_TYPES[refusal.status], "param": None,
                      "code": refusal.status}}  # OpenAI's error body, as the router's HTTP API answers
    response = ext.ImmediateResponse(status=http_status_pb2.HttpStatus(code=refusal.status),
                                     body=json.dumps(body).encode(), details=str(refusal))
    response.headers.set_headers.add(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))
    if refusal.retry_after_s is not None:
        response.headers.set_headers.add(header=base_pb2.HeaderValue(
            key="retry-after", raw_value=str(max(1, round(refusal.retry_after_s))).encode()))
    return ext.ProcessingResponse(immediate_response=response)


class EndpointPicker(ext_grpc.ExternalProcessorServicer):
    """ext_proc over a router's GenerationServicer (router.servicer: its pools, policy and KV index);
    `endpoints()` lists the routers (HTTP host:port) to pick from when the proxy names no subset."""

    def __init__(self, servicer: Any, endpoints: Callable[[], list[str]]):
        self.servicer, self.endpoints = servicer, endpoints
        self.max_body_bytes = servicer.cfg.http_max_body_bytes  # the router's limit: a larger body is refused
        self.tokens = TokenText(servicer.tokenizer)
        self._turn = itertools.count()  # round robin over the routers: any of them places alike

    async def Process(self, request_iterator: AsyncIterator[ext.ProcessingRequest], context
                      ) -> AsyncIterator[ext.ProcessingResponse]:
        state = Exchange()
        async for request in request_iterator:
            for response in [] if state.answered else await self._on(request, state):
                state.answered |= response.HasField("immediate_response")
                yield response

    async def _on(self, request: ext.ProcessingRequest, state: Exchange) -> list[ext.ProcessingResponse]:
        """The answers to one message of the stream (none while a full-duplex body is still arriving)."""
        if request.HasField("protocol_config"):
            state.request_mode = request.protocol_config.request_body_mode
            state.response_mode = request.protocol_config.response_body_mode
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            state.headers, state.subset = _header_map(request.request_headers.headers), _subset(request)
            if request.request_headers.end_of_stream or state.request_mode not in (FULL_DUPLEX, *BUFFERED):
                return [await self._pick(state, "request_headers")]  # no body comes (or none waits for us)
            return [] if state.request_mode == FULL_DUPLEX else \
                [ext.ProcessingResponse(request_headers=ext.HeadersResponse())]
        if kind == "request_body":
            state.body += request.request_body.body
            if len(state.body) > self.max_body_bytes and not state.picked:  # as the router would: 413
                state.picked = True
                metrics.EPP_PICKS.labels("refused_413").inc()
                return [_immediate(Refusal(413, f"the request body exceeds {self.max_body_bytes} bytes"))]
            if state.request_mode in BUFFERED:
                return [await self._pick(state, "request_body")]
            if state.picked:  # a full-duplex body goes on after the pick: sent back as it comes
                return [ext.ProcessingResponse(request_body=ext.BodyResponse(response=_common(
                    body=request.request_body.body, end=request.request_body.end_of_stream)))]
            if not request.request_body.end_of_stream:
                return []
            return await self._full_duplex_pick(state, end=True)
        if kind == "request_trailers":
            answers = [] if state.picked else await self._full_duplex_pick(state, end=False)
            return [*answers, ext.ProcessingResponse(request_trailers=ext.TrailersResponse())]
        return [self._pass_response(request, kind, state)]

    async def _full_duplex_pick(self, state: Exchange, end: bool) -> list[ext.ProcessingResponse]:
        """The headers' answer (the pick), then the whole body sent back, unchanged."""
        picked = await self._pick(state, "request_headers")
        if picked.HasField("immediate_response"):
            return [picked]
        body = ext.ProcessingResponse(request_body=ext.BodyResponse(response=_common(body=bytes(state.body),
                                                                                     end=end)))
        return [picked, body]

    @staticmethod
    def _pass_response(request: ext.ProcessingRequest, kind: str, state: Exchange) -> ext.ProcessingResponse:
        """The response phase passes through (a full-duplex body sent back chunk by chunk)."""
        if kind == "response_headers":
            return ext.ProcessingResponse(response_headers=ext.HeadersResponse())
        if kind == "response_body":
            if state.response_mode == FULL_DUPLEX:
                chunk = request.response_body
                return ext.ProcessingResponse(response_body=ext.BodyResponse(response=_common(
                    body=chunk.body, end=chunk.end_of_stream)))
            return ext.ProcessingResponse(response_body=ext.BodyResponse())
        return ext.ProcessingResponse(response_trailers=ext.TrailersResponse())

    async def _pick(self, state: Exchange, phase: str) -> ext.ProcessingResponse:
        """The answer that carries the pick, on `phase` (request_headers or request_body), or the refusal."""
        state.picked = True
        try:
            endpoints, hint = self._eligible(state.subset), await self._place(state)
        except Refusal as refusal:
            metrics.EPP_PICKS.labels(f"refused_{refusal.status}").inc()
            return _immediate(refusal)
        metrics.EPP_PICKS.labels("picked" if hint else "unplaced").inc()
        start = next(self._turn) % len(endpoints)
        destination = ",".join(endpoints[start:] + endpoints[:start])
        lb = struct_pb2.Struct()
        lb.update({LB_NAMESPACE: {DESTINATION: destination}})
        common = _common({DESTINATION: destination, **(hint.headers() if hint else {})})
        answer = ext.HeadersResponse(response=common) if phase == "request_headers" else \
            ext.BodyResponse(response=common)
        return ext.ProcessingResponse(dynamic_metadata=lb, **{phase: answer})

    def _eligible(self, subset: list[str] | None) -> list[str]:
        endpoints = self.endpoints() if subset is None else subset
        if not endpoints:
            raise Refusal(503, "no ready endpoint: the subset the proxy sent is empty" if subset is not None
                          else "no router endpoint is known (--epp-endpoints)")
        return endpoints

    async def _place(self, state: Exchange) -> PairHint | None:
        """The pair the router's policy chooses for the request in the body (None: nothing to place)."""
        s = self.servicer
        prefills, decodes = list(s.prefill.instances), list(s.decode.instances)
        if not any(i.view.up for i in prefills) or not any(i.view.up for i in decodes):
            raise Refusal(503, "no prefill or no decode instance is reachable", 1.0)
        req = self._request(state.headers.get(":path", ""), bytes(state.body))
        if req is None:
            return None
        try:
            parsed = await s.requests.parse(req, open_ended=bool(req.messages))
            ids = list(parsed.prompt_token_ids)
            place = await s.plan(parsed, ids, parsed.sampling.max_tokens, prefills, decodes, time.perf_counter())
        except Invalid:
            return None  # the router answers it (400 naming the field)
        except Rejected as exc:
            raise Refusal(429, f"{exc}; retry after {exc.retry_after_s:.1f} s", exc.retry_after_s) from None
        best = place.best
        return PairHint(LOCAL if best.local else prefills[best.prefill].address, decodes[best.decode].address)

    def _request(self, path: str, body: bytes) -> generation_pb2.GenerateRequest | None:
        """The router's GenerateRequest for an OpenAI body on `path` (its first prompt), or None."""
        route = ROUTES.get(path.partition("?")[0])
        if route is None or not body:
            return None
        try:
            parsed = route.model_validate(json.loads(body))
            if isinstance(parsed, ChatCompletionRequest):
                return chat_request(parsed)
            return completion_requests(parsed, self.tokens, len(_as_list(parsed.prompt)), 1 << 30)[0][0]
        except (ValueError, ValidationError, HttpAbort):  # json's errors are ValueErrors
            return None


def _as_list(prompt: object) -> list:
    return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]


def register_epp(server: Any, picker: EndpointPicker) -> None:
    ext_grpc.add_ExternalProcessorServicer_to_server(picker, server)
