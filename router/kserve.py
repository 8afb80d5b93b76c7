"""KServe v2 / the Open Inference Protocol over gRPC (`inference.GRPCInferenceService`), what KServe, Triton's
clients (`tritonclient`) and NVIDIA's perf tools speak, on the router's `--kserve-port`.

Text generation follows Triton's LLM convention (its vLLM backend's): inputs `text_input` (BYTES, the prompt),
`stream` (BOOL), `sampling_parameters` (BYTES: a JSON object of vLLM's sampling fields, the same names and
checks as the OpenAI API's), `exclude_input_in_output` (BOOL; by default a whole reply repeats the prompt before
the generated text, a streamed one never does) and the optional `return_finish_reason`,
`return_num_input_tokens`, `return_num_output_tokens` (BOOL); outputs `text_output` (BYTES) and those three.
`ModelInfer` answers with the whole reply; `ModelStreamInfer` streams each request's text as it is generated
(one response per step, its `triton_final_response` parameter true on the last). Every request runs through the
router's one request path (GenerationServicer.generate: admission, SLA targets, migration, metrics) as the gRPC
and HTTP APIs' do. A bad tensor (unknown or missing input, wrong datatype, a shape that is not one element,
malformed JSON parameters) is INVALID_ARGUMENT naming the input; other refusals keep the path's status codes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import grpc
from pydantic import ValidationError

from router import openai_models
from router.openai_errors import HttpAbort
from router.openai_models import SamplingFields, sampling, sla
from router.request import Malformed, lenient
from shared.rpc.pdserve.v1 import generation_pb2
from shared.rpc.pdserve.v1 import kserve_pb2 as pb

log = logging.getLogger("pdserve.router")
SERVICE = "inference.GRPCInferenceService"  # the protocol's service name, on the wire
VERSION = "1"  # the one version of the one model a router serves
INPUTS = {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL",
          "return_finish_reason": "BOOL", "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL"}
OUTPUTS = {"text_output": "BYTES", "finish_reason": "BYTES", "num_input_tokens": "UINT32",
           "num_output_tokens": "UINT32"}
# Request parameters that are Triton's own (its client sets them), not sampling fields
TRITON_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers"}
FINAL = "triton_final_response"  # the parameter that marks a stream's last response for a request
EMPTY_FINAL = "triton_enable_empty_final_response"  # the client asks for an empty last response


class Invalid(Exception):
    """A request the protocol layer refuses (INVALID_ARGUMENT, or NOT_FOUND for another model)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


class KServeSampling(SamplingFields):
    """`sampling_parameters`: the OpenAI API's sampling fields (vLLM's names), without its `model` field."""

    model: str = ""


KServeSampling.model_rebuild(_types_namespace=vars(openai_models))  # its fields' types live where they are declared


@dataclass(frozen=True)
class LlmRequest:
    """One inference request, read and checked: what to generate and what to answer with."""

    id: str
    prompt: str
    stream: bool
    prepend_input: bool  # the whole reply's text_output starts with the prompt
    outputs: tuple[str, ...]  # the output tensors to answer with, in order
    empty_final: bool  # streamed: an empty response ends it (the client asked for one)
    generate: generation_pb2.GenerateRequest
    timeout_s: float | None


class CallContext:
    """What the router's generate path uses of a gRPC context, for one request of a stream (or a unary call):
    `abort` raises Invalid-like RequestFailed with the status, its field named as this protocol names it."""

    def __init__(self, timeout_s: float | None):
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.retry_after_ms: str | None = None

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.retry_after_ms = dict(metadata).get("retry-after-ms", self.retry_after_ms)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RequestFailed(code, protocol_names(details), self.retry_after_ms)


class RequestFailed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: str | None = None):
        super().__init__(details)
        self.code, self.details, self.retry_after_ms = code, details, retry_after_ms


def protocol_names(details: str) -> str:
    """The generate path's field names as this protocol's inputs name them."""
    for field, name in (("sampling_params.", "sampling_parameters."), ("prompt:", "input 'text_input':")):
        if details.startswith(field):
            return name + details[len(field):]
    return details


def _bytes_elements(raw: bytes, name: str, most: int = 2) -> list[bytes]:
    """BYTES elements from raw contents (each a 4-byte little-endian length, then that many bytes), read up to
    `most` of them: one more than a request may carry already says it carries too many."""
    out, at = [], 0
    while at < len(raw) and len(out) < most:
        if at + 4 > len(raw):
            raise Invalid(f"input '{name}': raw BYTES contents end inside an element's length")
        (size,) = struct.unpack_from("<I", raw, at)
        if at + 4 + size > len(raw):
            raise Invalid(f"input '{name}': raw BYTES element of {size} bytes runs past the contents")
        out.append(raw[at + 4:at + 4 + size])
        at += 4 + size
    return out


def _tensor_values(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[Any]:
    """The tensor's values: one element (a request carries one prompt), of its declared datatype."""
    name, want = tensor.name, INPUTS.get(tensor.name)
    if want is None:
        raise Invalid(f"input '{name}': not an input of this model (inputs: {', '.join(INPUTS)})")
    if tensor.datatype != want:
        raise Invalid(f"input '{name}': datatype {tensor.datatype or '(none)'}, expected {want}")
    if any(d < 0 for d in tensor.shape) or math.prod(tensor.shape) != 1:
        raise Invalid(f"input '{name}': shape {list(tensor.shape)} is not one element (one request carries one "
                      "prompt; send several requests, or several on one ModelStreamInfer stream)")
    if raw is not None:
        values: list[Any] = _bytes_elements(raw, name) if want == "BYTES" else [b != 0 for b in raw]
    else:
        values = list(tensor.contents.bytes_contents if want == "BYTES" else tensor.contents.bool_contents)
    if len(values) != 1:
        raise Invalid(f"input '{name}': {len(values)} {want} values for shape {list(tensor.shape)}")
    return values


def _inputs(request: pb.ModelInferRequest) -> dict[str, Any]:
    """Each input's one value, by name; raw_input_contents (one entry per input) or each tensor's contents."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise Invalid(f"raw_input_contents: {len(raw)} entries for {len(request.inputs)} inputs")
    values: dict[str, Any] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in values:
            raise Invalid(f"input '{tensor.name}': given twice")
        values[tensor.name] = _tensor_values(tensor, raw[i] if raw else None)[0]
    if "text_input" not in values:
        raise Invalid("input 'text_input': missing (the prompt, a BYTES tensor of one element)")
    return values


def _parameter(value: pb.InferParameter) -> Any:
    return getattr(value, value.WhichOneof("parameter_choice") or "string_param")


def _sampling_fields(request: pb.ModelInferRequest, values: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields: the request's parameters (Triton's own left out), then `sampling_parameters` over
    them."""
    fields = {k: _parameter(v) for k, v in request.parameters.items()
              if k not in TRITON_PARAMETERS and not k.startswith("triton_")}
    if "sampling_parameters" in values:
        try:
            given = json.loads(values["sampling_parameters"].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise Invalid(f"input 'sampling_parameters': not valid JSON ({exc})") from None
        if not isinstance(given, dict):
            raise Invalid(f"input 'sampling_parameters': a JSON object is expected, got {type(given).__name__}")
        fields.update(given)
    return fields


def _generate_request(prompt: str, fields: dict[str, Any]) -> tuple[generation_pb2.GenerateRequest, float | None]:
    """The router's GenerateRequest for `prompt` under these sampling fields, and the request's timeout."""
    try:
        body = KServeSampling.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise Invalid(f"sampling_parameters.{where}: {first['msg']}") from None
    except HttpAbort as exc:
        raise Invalid(f"sampling_parameters.{exc.message}") from None
    if body.n != 1:
        raise Invalid("sampling_parameters.n: one sample per request here (send n requests)")
    try:
        params = sampling(body, body.max_tokens)
    except HttpAbort as exc:
        raise Invalid(f"sampling_parameters.{exc.message}") from None
    req = generation_pb2.GenerateRequest(prompt=prompt, sampling_params=params, sla=sla(body),
                                         priority=body.priority, cache_salt=body.cache_salt or "")
    return req, body.timeout


def read_request(request: pb.ModelInferRequest | Malformed, model_name: str) -> LlmRequest:
    """One ModelInferRequest, checked against this model's inputs and outputs."""
    if isinstance(request, Malformed):
        raise Invalid(f"request: not a ModelInferRequest ({request.reason})")
    if request.model_name != model_name:
        raise Invalid(f"model {request.model_name!r} is not served here; this server serves {model_name!r}",
                      grpc.StatusCode.NOT_FOUND)
    if request.model_version not in ("", VERSION):
        raise Invalid(f"model {model_name!r} has no version {request.model_version!r} (versions: {VERSION})",
                      grpc.StatusCode.NOT_FOUND)
    values = _inputs(request)
    try:
        prompt = values["text_input"].decode("utf-8")
    except UnicodeDecodeError:
        raise Invalid("input 'text_input': not UTF-8 text") from None
    stream = bool(values.get("stream", False))
    exclude = values.get("exclude_input_in_output")
    if stream and exclude is False:
        raise Invalid("input 'exclude_input_in_output': false is for whole replies; a stream sends only new text")
    asked = [o.name for o in request.outputs]
    for name in asked:
        if name not in OUTPUTS:
            raise Invalid(f"output '{name}': not an output of this model (outputs: {', '.join(OUTPUTS)})")
    extras = [name for name in OUTPUTS if values.get(f"return_{name}")]
    outputs = tuple(asked) if asked else ("text_output", *extras)
    generate, timeout_s = _generate_request(prompt, _sampling_fields(request, values))
    timeout_us = request.parameters["timeout"].int64_param if "timeout" in request.parameters else 0
    if timeout_us > 0:  # Triton's own request timeout, in microseconds
        timeout_s = min(timeout_s or math.inf, timeout_us / 1e6)
    empty_final = EMPTY_FINAL in request.parameters and bool(_parameter(request.parameters[EMPTY_FINAL]))
    return LlmRequest(request.id, prompt, stream, not stream and exclude is not True, outputs, empty_final, generate,
                      timeout_s)


@dataclass
class Reply:
    """What a request has generated so far (a stream's step, or a whole reply)."""

    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = ""

    def add(self, msg: generation_pb2.GenerateResponse) -> None:
        self.text += msg.text
        self.tokens += len(msg.token_ids)
        if msg.HasField("usage"):
            self.prompt_tokens = msg.usage.prompt_tokens
        self.finish_reason = msg.finish_reason or self.finish_reason


def _raw(datatype: str, value: Any) -> bytes:
    if datatype == "BYTES":
        data = value.encode("utf-8")
        return struct.pack("<I", len(data)) + data
    return struct.pack("<I", value)  # UINT32


def infer_response(req: LlmRequest, model_name: str, reply: Reply, final: bool | None,
                   with_outputs: bool = True) -> pb.ModelInferResponse:
    """A response with the request's outputs over `reply` (none for an empty final one); `final` (streams):
    the triton_final_response parameter."""
    out = pb.ModelInferResponse(model_name=model_name, model_version=VERSION, id=req.id)
    values = {"text_output": reply.text, "finish_reason": reply.finish_reason,
              "num_input_tokens": reply.prompt_tokens, "num_output_tokens": reply.tokens}
    for name in req.outputs if with_outputs else ():
        out.outputs.add(name=name, datatype=OUTPUTS[name], shape=[1])
        out.raw_output_contents.append(_raw(OUTPUTS[name], values[name]))
    if final is not None:
        out.parameters[FINAL].bool_param = final
    return out


class KServeServicer:
    """The protocol's methods over the router's GenerationServicer (router.servicer)."""

    def __init__(self, servicer: Any, model_name: str, model_type: str):
        self.servicer, self.model_name, self.model_type = servicer, model_name, model_type

    @property
    def ready(self) -> bool:
        s = self.servicer
        return not s.draining and any(i.view.up for i in s.prefill.instances) and \
            any(i.view.up for i in s.decode.instances)

    async def ServerLive(self, request, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.ready)

    async def ModelReady(self, request, context) -> pb.ModelReadyResponse:
        ours = request.name == self.model_name and request.version in ("", VERSION)
        return pb.ModelReadyResponse(ready=ours and self.ready)

    async def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        try:
            version = metadata.version("pdserve")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return pb.ServerMetadataResponse(name="pdserve", version=version, extensions=[])

    async def ModelMetadata(self, request, context) -> pb.ModelMetadataResponse:
        if request.name != self.model_name or request.version not in ("", VERSION):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name!r} version {request.version!r} is "
                                f"not served here; this server serves {self.model_name!r} version {VERSION}")
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model_name, versions=[VERSION], platform=f"pdserve/{self.model_type}",
            inputs=[tensor(name=n, datatype=d, shape=[1]) for n, d in INPUTS.items()],
            outputs=[tensor(name=n, datatype=d, shape=[1]) for n, d in OUTPUTS.items()])

    async def ModelInfer(self, request, context) -> pb.ModelInferResponse:
        """A whole reply (ModelStreamInfer streams)."""
        try:
            req = read_request(request, self.model_name)
            if req.stream:
                raise Invalid("input 'stream': true needs ModelStreamInfer (ModelInfer answers once)")
            remaining = context.time_remaining()
            timeout = min(t for t in (req.timeout_s, remaining) if t is not None) \
                if req.timeout_s is not None or remaining is not None else None
            reply = Reply()
            async for msg in self.servicer.generate(req.generate, CallContext(timeout)):
                reply.add(msg)
        except Invalid as exc:
            await context.abort(exc.code, str(exc))
        except RequestFailed as exc:
            if exc.retry_after_ms:
                context.set_trailing_metadata((("retry-after-ms", exc.retry_after_ms),))
            await context.abort(exc.code, exc.details)
        if req.prepend_input:
            reply.text = req.prompt + reply.text
        return infer_response(req, self.model_name, reply, None)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Every request of the stream runs at once; their responses interleave, each carrying its id. A
        request's failure is an error_message on the stream (the others go on); the client leaving cancels all."""
        out: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(self._one(request, out))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                out.put_nowait(None)  # the client's half ended (or broke): the responses end when its requests do

        reader = asyncio.ensure_future(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader
        finally:
            for task in [reader, *tasks]:
                task.cancel()

    async def _one(self, request: pb.ModelInferRequest, out: asyncio.Queue) -> None:
        """One request of a stream: its responses (or its error) onto `out`."""
        try:
            req = read_request(request, self.model_name)
            whole = Reply()
            async for msg in self.servicer.generate(req.generate, CallContext(req.timeout_s)):
                whole.add(msg)
                if req.stream:
                    step = Reply(prompt_tokens=whole.prompt_tokens)
                    step.add(msg)
                    last = bool(msg.finish_reason) and not req.empty_final
                    out.put_nowait(pb.ModelStreamInferResponse(
                        infer_response=infer_response(req, self.model_name, step, last)))
            if not req.stream:
                if req.prepend_input:
                    whole.text = req.prompt + whole.text
                out.put_nowait(pb.ModelStreamInferResponse(
                    infer_response=infer_response(req, self.model_name, whole, not req.empty_final)))
            if req.empty_final:
                out.put_nowait(pb.ModelStreamInferResponse(
                    infer_response=infer_response(req, self.model_name, Reply(), True, with_outputs=False)))
        except (Invalid, RequestFailed) as exc:
            out.put_nowait(_stream_error(request, self.model_name, f"{exc.code.name}: {exc}"))
        except Exception as exc:  # one request's failure is its own, never the stream's
            log.exception("KServe stream request failed")
            out.put_nowait(_stream_error(request, self.model_name, f"INTERNAL: {exc}"))


def _stream_error(request: pb.ModelInferRequest | Malformed, model_name: str, message: str
                  ) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(
        model_name=model_name, id=getattr(request, "id", "")))


def register_kserve(server: grpc.aio.Server, kserve: KServeServicer) -> None:
    """Serve `kserve` as the protocol's service on `server`."""
    def unary(method: str, request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(getattr(kserve, method),
                                                   request_deserializer=request_type.FromString,
                                                   response_serializer=response_type.SerializeToString)

    handlers = {name: unary(name, getattr(pb, f"{name}Request"), getattr(pb, f"{name}Response"))
                for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata")}
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        kserve.ModelInfer, request_deserializer=lenient(pb.ModelInferRequest.FromString),
        response_serializer=pb.ModelInferResponse.SerializeToString)
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        kserve.ModelStreamInfer, request_deserializer=lenient(pb.ModelInferRequest.FromString),
        response_serializer=pb.ModelStreamInferResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
