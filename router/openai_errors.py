"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, on every route and status of the
HTTP API: the router's own refusals (HttpAbort, from a gRPC status), FastAPI's validation errors (malformed
JSON included), Starlette's routing errors (404 for an unknown route, 405 for a wrong method) and anything
unexpected (500). Every 429 carries Retry-After (the SLA refusal's own estimate, else RETRY_AFTER_S)."""

from __future__ import annotations

import re
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.hint import PairHint

RETRY_AFTER_S = 1  # the Retry-After of a 429 that has no estimate of its own (the router's concurrency limit)

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
# HTTP status → OpenAI error type, for errors that do not come from a gRPC status
HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable"}


def error_response(status: int, message: str, kind: str | None = None, param: str | None = None,
                   retry_after_s: float | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body with `status` (`code` is the HTTP status, as vLLM's); a 429 always says when to retry."""
    headers = dict(headers or {})
    if retry_after_s is None and status == 429:
        retry_after_s = RETRY_AFTER_S
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    kind = kind or HTTP_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers or None)


class HttpAbort(Exception):
    """A request that ends with an OpenAI error body."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None,
                 retry_after_s: float | None = None, status: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after_s = code, message, param, retry_after_s
        self.status = status  # an HTTP status of its own (413), else the gRPC code's

    def response(self) -> JSONResponse:
        status, kind = HTTP_STATUS.get(self.code, (500, "internal_error"))
        if self.status is not None:
            status, kind = self.status, HTTP_TYPES.get(self.status, kind)
        return error_response(status, self.message, kind, self.param, self.retry_after_s)


class HttpCall:
    """What the router's Generate path uses of a gRPC ServicerContext, for a call that came over HTTP:
    `abort` raises HttpAbort (with the Retry-After the SLA refusal set), `time_remaining` is the
    request's own timeout. An error about the output constraint names the field the request gave it in."""

    def __init__(self, timeout_s: float | None, constraint_field: str | None = None):
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.retry_after_s: float | None = None
        self.constraint_field = constraint_field
        self.hint: PairHint | None = None  # an endpoint picker's pair, from the request's headers (router.hint)

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



def install_error_handlers(app: FastAPI) -> None:
    """Every error `app` answers, in OpenAI's body."""

    @app.exception_handler(HttpAbort)
    async def aborted(_: Request, exc: HttpAbort) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", first["msg"])
            return error_response(400, f"the request body is not valid JSON ({detail})")
        name = ".".join(str(p) for p in first["loc"] if p != "body")
        if not name:
            return error_response(400, "the request body must be a JSON object (Content-Type: application/json)")
        return error_response(400, f"{name}: {first['msg']}", param=name)

    @app.exception_handler(StarletteHTTPException)
    async def routing(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, HttpAbort):  # raised while FastAPI read the body (BodyLimit's 413)
            return exc.__cause__.response()
        if exc.status_code == 404:
            message = f"no route {request.url.path!r} (routes: /v1/models, /v1/completions, /v1/chat/completions, " \
                      "/health)"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path!r}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)  # Starlette re-raises it after the response: uvicorn logs the traceback
    async def crashed(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
