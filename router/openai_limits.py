"""The HTTP API's bounds on one request, before any of it reaches the router's generate path: the body's
size (413), the number of prompts (400 naming `prompt`), and OpenAI's defaults for what a request leaves out.

The defaults are generous for 128k-token prompts: a prompt of 131,072 token ids is about 1 MiB of JSON, its
text about 512 KiB (the router's own --max-prompt-bytes, 8 MiB at most, bounds each text prompt again)."""

from __future__ import annotations

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import MAX_BODY_BYTES
from router.openai_errors import HttpAbort

COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's and vLLM's default
DRAIN_LIMIT = 4  # an oversized body of up to this many times the limit is read (and dropped) before the 413


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 with OpenAI's error body, by its
    Content-Length before any of it is read, or as soon as a body without one (chunked) passes the limit.
    The rest of an oversized body is read and dropped first (up to DRAIN_LIMIT times the limit), so a client
    that writes its whole body before reading (most HTTP clients) gets the 413 rather than a reset."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await _drain(receive, DRAIN_LIMIT * self.max_bytes)
            await self._too_large(int(length)).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # read where the route reads its body: the handlers answer
                    if message.get("more_body", False):
                        seen += await _drain(receive, DRAIN_LIMIT * self.max_bytes)
                    raise self._too_large(seen)
            return message

        await self.app(scope, counted, send)

    def _too_large(self, size: int) -> HttpAbort:
        return HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"the request body ({size} bytes) exceeds the limit "
                         f"of {self.max_bytes} bytes", status=413)


async def _drain(receive: Receive, limit: int) -> int:
    """Read and drop what is left of a request body (at most about `limit` bytes); the bytes read."""
    drained, more = 0, True
    while more and drained <= limit:
        message = await receive()
        more = message["type"] == "http.request" and message.get("more_body", False)
        drained += len(message.get("body", b""))
    return drained


def check_prompts(count: int, n: int, max_prompts: int, max_in_flight: int) -> None:
    """A request's prompts (each run `n` times): at most `max_prompts`, and no more requests than the router
    ever takes at once (such a request could never be served: 400, not a 429 to retry)."""
    if count > max_prompts:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: at most {max_prompts} prompts per request, "
                        f"got {count}", "prompt")
    if count * n > max_in_flight:
        field = "n" if count == 1 else "prompt"
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {count} prompt(s) × n={n} samples exceed the "
                        f"router's limit of {max_in_flight} requests in flight", field)
