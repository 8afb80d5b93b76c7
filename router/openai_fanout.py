"""One OpenAI request as the router's generate calls: `n` samples of each prompt, in OpenAI's choice order
(prompt-major: choice `index` = prompt index × n + sample index), run all-or-nothing.

* The samples of a prompt share one prefill: sample 0 goes first; once it has its first token its prefill
  is done and the prefill instance's prefix cache holds the prompt's full blocks, and only then do samples
  1..n-1 start: the router places them on the instance that holds the prefix, and each computes only the
  prompt's tail past its last full block. With several prefill instances up, they first wait for the
  router's view of the prefix caches to change (a load report after sample 0's prefill), at most as long
  as sample 0's own first token took (what recomputing the prompt elsewhere would cost) and PREFIX_VIEW_WAIT_S.
  (Not with prompt logprobs: those are computed over the whole prompt, never from the cache.)
* When one sample or prompt fails, its siblings are cancelled (their KV freed), not left to run unread.
* `usage.prompt_tokens` counts each prompt once, not once per sample.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from router.openai_errors import HttpAbort
from shared.rpc.pdserve.v1 import generation_pb2

MAX_N = 16  # samples per prompt in one request
PREFIX_VIEW_WAIT_S = 1.0  # longest samples 1..n-1 wait for the router's view of sample 0's prefix (>1 prefill)
T = TypeVar("T")


def check_n(n: int) -> None:
    if n < 1 or n > MAX_N:
        raise HttpAbort(grpc.StatusCode.INVALID_ARGUMENT, f"n: expected 1..{MAX_N}, got {n}", "n")


def samples(reqs: list[generation_pb2.GenerateRequest], n: int) -> list[generation_pb2.GenerateRequest]:
    """`n` samples of each prompt, prompt-major. With a seed, sample i draws with seed + i, so the whole
    response replays."""
    check_n(n)
    out = []
    for req in reqs:
        for i in range(n):
            copy = generation_pb2.GenerateRequest()
            copy.CopyFrom(req)
            if i and copy.sampling_params.HasField("seed"):
                copy.sampling_params.seed = (copy.sampling_params.seed + i) % 2**63
            out.append(copy)
    return out


class PrefixWatch:
    """The router's view of the prefill instances' prefix caches (the last KvEvents sequence number its index
    took from each), taken when a prompt's sample 0 starts; `settled` waits until it changes."""

    def __init__(self, instances: Callable[[], Sequence[Any]]):  # router.server.Instance
        self.instances = instances
        self.before = self._filters()

    def _filters(self) -> list[int]:
        return [inst.view.kv_seq for inst in self.instances() if inst.view.up]

    async def settled(self, worth_s: float) -> None:
        """With more than one prefill instance up: until the view changes, at most `worth_s` (and
        PREFIX_VIEW_WAIT_S). With one, at once: every sample goes to it anyway."""
        if len(self.before) < 2:
            return
        end = time.monotonic() + min(worth_s, PREFIX_VIEW_WAIT_S)
        while time.monotonic() < end and self._filters() == self.before:
            await asyncio.sleep(0.02)


class Gate:
    """Where samples 1..n-1 of one prompt wait for its sample 0's first token (and the view's change)."""

    def __init__(self, watch: PrefixWatch | None):
        self.watch = watch
        self.t0 = time.monotonic()
        self.ttft = 0.0
        self.opened = asyncio.Event()
        self._settling: asyncio.Future | None = None

    def open(self) -> None:
        if not self.opened.is_set():
            self.ttft = time.monotonic() - self.t0
            self.opened.set()

    async def wait(self) -> None:
        await self.opened.wait()
        if self.watch is not None:
            if self._settling is None:
                self._settling = asyncio.ensure_future(self.watch.settled(self.ttft))
            await asyncio.shield(self._settling)

    def close(self) -> None:
        if self._settling is not None:
            self._settling.cancel()


async def fan_out(count: int, n: int, run: Callable[[int, Callable[[], None]], Awaitable[T]],
                  watch: Callable[[], PrefixWatch] | None = None, shared: bool = True) -> list[T]:
    """run(i, first) for each of `count` samples (n per prompt, prompt-major), where `run` calls `first()`
    when sample i has its first message: with `shared`, samples 1..n-1 of a prompt start after its sample
    0's first (else all at once). All or nothing: the first failure cancels the rest and is raised."""
    gates: list[Gate] = []

    async def one(i: int) -> T:
        p, s = divmod(i, n)
        gate = gates[p]
        if s == 0 or not shared:
            try:
                return await run(i, gate.open)
            finally:
                gate.open()  # never leave the siblings waiting
        await gate.wait()
        return await run(i, lambda: None)

    for _ in range(count // n):
        gates.append(Gate(watch() if watch is not None and n > 1 and shared else None))
    try:
        return await all_or_none([one(i) for i in range(count)])
    finally:
        for gate in gates:
            gate.close()


async def all_or_none(coros: list[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first exception cancels the others (awaited) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def prompt_usage(prompt_tokens: list[int], cached_tokens: list[int], completion_tokens: list[int],
                 n: int) -> dict[str, Any]:
    """OpenAI's usage over per-sample counts (prompt-major): each prompt counted once (its sample 0's: the
    sample that computed it), every sample's completion."""
    prompt = sum(prompt_tokens[::n])
    completion = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached_tokens[::n])}}
