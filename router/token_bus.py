"""The router's end of the decode instances' token buses (decode_service.token_bus): one Tokens stream per
instance carries every request's messages, a step's in one batch, instead of one gRPC stream message per token
per request (~40 µs of CPU each on each side). Each request's own Decode call stays open for control: the
router cancels it when the client leaves, and its error status (a drain, a failed engine, a deadline) ends the
request's messages as it ended the per-call stream. An instance that does not hold the named bus (an older
one, a bus just lost) streams on the call itself, which the same reader takes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from time import monotonic

import grpc

from router.pools import Instance, Pool
from shared.rpc.pdserve.v1 import internal_pb2

log = logging.getLogger("pdserve.router")
BUS_RETRY_S = 1.0  # a lost bus is reopened at most this often; one that never opened, twice as late each time,
MAX_RETRY_S = 60.0  # up to this (an older instance without Tokens, a refused subscription)
LATE_MESSAGES_S = 5.0  # after a call that ended well, how long its last messages may take on the bus
_LOST = object()  # the bus ended under its requests
_CALL_ENDED = object()  # a request's Decode call ended well (its messages on the bus may still be on the way)


class BusLost(grpc.RpcError):
    """The bus ended under a request: UNAVAILABLE, as a decode instance lost mid-stream (the request migrates)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the token bus to the decode instance closed"

    def trailing_metadata(self) -> tuple:
        return ()


class TokenBus:
    """One decode instance's Tokens stream: each message into the queue of the request it names."""

    def __init__(self, inst: Instance, metadata: tuple, unheld: int = 0):
        self.name, self.channel = uuid.uuid4().hex, inst.channel
        self.ready = self.ended = self.held = False
        self.unheld = unheld  # buses to this instance before this one that ended without ever being held
        self.reopen_at = 0.0  # once ended: when the next one may be opened
        self.queues: dict[str, asyncio.Queue] = {}
        self._task = asyncio.create_task(self._read(inst, metadata))

    async def _read(self, inst: Instance, metadata: tuple) -> None:
        try:
            async for batch in inst.stub.Tokens(internal_pb2.TokensRequest(token_bus=self.name), metadata=metadata):
                self.ready = self.held = True  # held there from its first (empty) batch on
                for msg in batch.messages:
                    queue = self.queues.get(msg.request_id)
                    if queue is not None:  # else a request that ended here already (cancelled, failed)
                        queue.put_nowait(msg)
        except grpc.RpcError as exc:
            if self.held or not self.unheld:  # a loss, or a first refusal: said once, not at every retry
                log.info("%s: token bus ended (%s): requests stream on their own calls until it is back",
                         inst.address, exc.code().name)
        finally:
            self.ready, self.ended = False, True
            delay = BUS_RETRY_S if self.held else min(MAX_RETRY_S, BUS_RETRY_S * 2 ** self.unheld)
            self.reopen_at = monotonic() + delay
            for queue in self.queues.values():
                queue.put_nowait(_LOST)

    def stream(self, request_id: str, call) -> BusStream:
        """The messages of the request whose Decode call (naming this bus) was just made."""
        return BusStream(self, request_id, call)


class BusStream:
    """A request's messages from its instance's bus until the one that ends it, its call's error status raised as
    it comes; `cancel` (always, once the request is done with) lets the call and the bus's queue go."""

    def __init__(self, bus: TokenBus, request_id: str, call):
        self._bus, self._request_id, self._call = bus, request_id, call
        self._queue: asyncio.Queue = asyncio.Queue()
        bus.queues[request_id] = self._queue  # before any of its messages can come
        self._control = asyncio.ensure_future(_follow_call(call, self._queue))
        self._call_ended = self._done = False

    def __aiter__(self) -> BusStream:
        return self

    async def __anext__(self) -> internal_pb2.DecodeResponse:
        while not self._done:
            if self._queue.qsize():
                item = self._queue.get_nowait()
            elif not self._call_ended:
                item = await self._queue.get()
            else:  # the call ended well: its last messages may still be on the bus, not for ever
                try:
                    item = await asyncio.wait_for(self._queue.get(), LATE_MESSAGES_S)
                except TimeoutError:
                    break  # the stream ends as the call's own would have
            if item is _CALL_ENDED:
                self._call_ended = True
            elif item is _LOST:
                raise BusLost()
            elif isinstance(item, grpc.RpcError):
                raise item
            else:
                self._done = bool(item.finish_reason)
                return item
        raise StopAsyncIteration

    def cancel(self) -> None:
        """The call cancelled (a no-op once it ended; else decode lets the request go) and the queue dropped."""
        self._call.cancel()
        self._bus.queues.pop(self._request_id, None)
        self._control.cancel()


async def _follow_call(call, queue: asyncio.Queue) -> None:
    """A request's Decode call: messages it carries (an instance streaming on the call) and how it ended."""
    try:
        async for msg in call:
            queue.put_nowait(msg)
    except grpc.RpcError as exc:
        queue.put_nowait(exc)
    else:
        queue.put_nowait(_CALL_ENDED)


class TokenBuses:
    """A bus per decode instance, opened once the instance is reachable (keep_open) or on its first request, and
    again (at most every BUS_RETRY_S) after it ends; a request goes on its instance's bus once the bus is held
    there, on its own call before."""

    def __init__(self, metadata: tuple, enabled: bool = True):
        self.metadata, self.enabled = metadata, enabled
        self._buses: dict[str, TokenBus] = {}

    def decode(self, inst: Instance, request: internal_pb2.DecodeRequest, timeout: float):
        """The request's Decode call made, naming the instance's bus where it holds one of this router's: its
        messages (a BusStream, or the call itself), each with `cancel`."""
        bus = self.ready(inst)
        request.token_bus = bus.name if bus else ""
        call = inst.stub.Decode(request, timeout=timeout, metadata=self.metadata)
        return bus.stream(request.request_id or request.lease_id, call) if bus else call

    async def keep_open(self, pool: Pool, period: float) -> None:
        """Open the bus of each decode instance as soon as it is reachable, so that its first requests ride it
        too (a cold start's first streams cost what warm ones do)."""
        while True:
            for inst in list(pool.instances):
                if inst.view.up:
                    self.ready(inst)
            await asyncio.sleep(period)

    def ready(self, inst: Instance) -> TokenBus | None:
        """The instance's bus if it is held there; else None, and a new one opened where it is due."""
        if not self.enabled:
            return None
        bus = self._buses.get(inst.address)
        if bus is not None and bus.ready and bus.channel is inst.channel:
            return bus
        if bus is None or bus.channel is not inst.channel:
            self._buses[inst.address] = TokenBus(inst, self.metadata)
        elif bus.ended and monotonic() >= bus.reopen_at:
            self._buses[inst.address] = TokenBus(inst, self.metadata, 0 if bus.held else bus.unheld + 1)
        return None
