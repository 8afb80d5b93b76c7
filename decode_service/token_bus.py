"""Token buses: a router's one Tokens stream carrying the messages of every request it sends here.

With one gRPC stream per request, every token is a message of its own on both sides (~40 µs of CPU each on a
2-core host, the decode front's and the router's, beside the engine's step); a bus carries one batch per step
for all of a router's requests instead. The request's own Decode call stays open for control (cancellation,
deadline, its error status) and ends once the request has.
"""

from __future__ import annotations

import asyncio

import grpc

from shared import metrics
from shared.rpc.pdserve.v1 import internal_pb2

MAX_BUS_NAME = 64  # characters of a TokensRequest.token_bus
MAX_BUSES = 256  # open buses an instance holds (one per router process): more is a client gone wrong
BATCH_MESSAGES = 1024  # messages a TokenBatch carries at most (a 1,024-request step's in one)


class Bus:
    """One subscription's messages, in order, batched as they wait for the stream's writer."""

    def __init__(self) -> None:
        self.closed = False
        self._items: list[internal_pb2.DecodeResponse] = []
        self._wakeup: asyncio.Future | None = None

    def put(self, request_id: str, msg: internal_pb2.DecodeResponse) -> bool:
        """Queue a request's message; False when the subscription has ended (the message cannot travel)."""
        if self.closed:
            return False
        msg.request_id = request_id
        self._items.append(msg)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        return True

    async def take(self) -> list[internal_pb2.DecodeResponse]:
        """Every message queued (at least one), at most BATCH_MESSAGES."""
        while not self._items:
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
        taken, self._items = self._items[:BATCH_MESSAGES], self._items[BATCH_MESSAGES:]
        return taken


class TokenBuses:
    """The buses an instance holds, by their subscribers' names."""

    def __init__(self) -> None:
        self._buses: dict[str, Bus] = {}

    def get(self, name: str) -> Bus | None:
        return self._buses.get(name) if name else None

    async def serve(self, request, context):
        """The Tokens handler: an empty first batch once the bus is held (the subscriber may name it from
        then on), then each batch as it gathers; the bus goes when the stream ends (the subscriber left)."""
        name = request.token_bus
        if not 0 < len(name) <= MAX_BUS_NAME or not name.isprintable():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_bus: 1-{MAX_BUS_NAME} printable characters, got {len(name)}")
        if name in self._buses:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "token_bus: a subscription of that name is open")
        if len(self._buses) >= MAX_BUSES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"token_bus: {MAX_BUSES} subscriptions open")
        bus = self._buses[name] = Bus()
        metrics.TOKEN_BUSES.inc()
        try:
            yield internal_pb2.TokenBatch()
            while True:
                messages = await bus.take()
                metrics.TOKEN_BUS_BATCHES.inc()
                metrics.TOKEN_BUS_MESSAGES.inc(len(messages))
                yield internal_pb2.TokenBatch(messages=messages)
        finally:
            bus.closed = True
            del self._buses[name]
            metrics.TOKEN_BUSES.dec()
