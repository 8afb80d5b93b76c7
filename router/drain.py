"""The router's drain on SIGTERM (a rolling update of the router Deployment, `pdserve up` stopping it): readiness
goes off, new requests are refused with a retry hint (HTTP 503 + Retry-After, gRPC UNAVAILABLE), the streams in
flight on both APIs run to their end within --drain-seconds, and only then does the process exit.

Kubernetes stops routing to a pod once its readiness fails, but requests already on their way still arrive for
a moment: they are refused with the hint to retry (the OpenAI SDK retries a 503 on its own, after Retry-After),
never accepted and then cut."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Receive, Scope, Send

RETRY_AFTER_S = 1  # a draining router's hint: another replica (or this one, restarted) takes the retry at once
DRAINING_MESSAGE = "the router is draining (shutting down); retry the request"


class DrainGate:
    """ASGI middleware outermost on the HTTP API: counts the HTTP requests in flight (a streamed response is in
    flight until its last chunk is sent) and, once `draining` is set, answers new requests 503 with Retry-After
    and OpenAI's error body (/health included: readiness off)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _refuse(send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drained(self, deadline: float) -> bool:
        """Wait (until the monotonic `deadline`) for every HTTP request in flight to end; True if they did."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True


async def _refuse(send: Send) -> None:
    body = json.dumps({"error": {"message": DRAINING_MESSAGE, "type": "service_unavailable", "param": None,
                                 "code": 503}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
