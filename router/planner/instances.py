"""The trace replay's simulated request and instances: a prefill instance's FIFO and LRU prefix cache, a
decode instance's DP ranks stepping in lock-step, each reporting the load the router's policy would see."""

from __future__ import annotations

import math
from enum import IntEnum

from router.perf import PerfModel
from router.planner.trace import TraceRequest
from router.policy import DecodeView, RankView


class State(IntEnum):
    """Where a simulated instance is in its life: booting, serving, finishing its queue, removed."""

    STARTING = 0
    UP = 1
    DRAINING = 2
    GONE = 3


class ReplayRequest:
    __slots__ = ("i", "arrival", "isl", "osl", "blocks", "dec", "rank", "first", "last", "done", "ticket", "join_k",
                 "migrations")

    def __init__(self, i: int, r: TraceRequest):
        self.i, self.arrival, self.isl, self.osl, self.blocks = i, r.arrival, r.prompt_tokens, r.output_tokens, r.blocks
        self.dec: ReplayDecode | None = None
        self.rank = 0  # the DP rank of `dec` it decodes on
        self.first = self.last = math.inf
        self.done = 0  # tokens generated (the first comes with the prefill)
        self.ticket = 0  # invalidates a decode instance's completion entry when the request moves
        self.join_k = 0
        self.migrations = 0


class ReplayPrefill:
    """A prefill instance: a FIFO of prompts computed one at a time, and an LRU prefix cache of blocks."""

    def __init__(self, name: str, state: State, capacity_blocks: int):
        self.name, self.state = name, state
        self.queue: list[tuple[ReplayRequest, int, int]] = []  # (request, prompt tokens, uncached tokens as placed)
        self.head = 0  # index of the prompt in service (the queue's consumed prefix is trimmed lazily)
        self.waiting_tokens = 0  # uncached tokens of the prompts waiting (not the one in service)
        self.busy_until = 0.0
        self.busy_from = 0.0
        self.busy_tokens = 0
        self.cache: dict[int, None] = {}  # insertion order = recency (LRU at the front)
        self.capacity = capacity_blocks

    def cached_prefix(self, blocks: tuple[int, ...], touch: bool = False) -> int:
        n = 0
        for h in blocks:
            if h not in self.cache:
                break
            if touch:
                self.cache[h] = self.cache.pop(h)
            n += 1
        return n

    def insert(self, blocks: tuple[int, ...]) -> None:
        for h in blocks:
            self.cache.pop(h, None)
            self.cache[h] = None
        while len(self.cache) > self.capacity:
            del self.cache[next(iter(self.cache))]

    def queued_tokens(self, now: float) -> int:
        """What its load report would say: uncached prompt tokens waiting, plus the rest of the one in service."""
        rest = 0
        if self.busy_until > now and self.busy_until > self.busy_from:
            rest = int(self.busy_tokens * (self.busy_until - now) / (self.busy_until - self.busy_from))
        return self.waiting_tokens + rest

    @property
    def idle(self) -> bool:
        return self.head >= len(self.queue)


class ReplayDecode:
    """A decode instance of `ranks` DP ranks stepping in lock-step (one step counter, each step as long as its
    busiest rank's): a request joining at step k with r tokens to go finishes at step k + r (a heap by
    finishing step), so a step costs O(log batch), not O(batch). Batches, context and reservations per rank."""

    def __init__(self, name: str, state: State, ranks: int = 1):
        self.name, self.state = name, state
        self.k = 0  # steps taken
        self.batch = [0] * ranks
        self.ctx = [0] * ranks  # context tokens of each rank's running batch
        self.heap: list[tuple[int, int, int, ReplayRequest]] = []  # (finishing step, request index, ticket, request)
        self.pending: list[ReplayRequest] = []  # admitted, joining at the next step
        self.stepping = False
        self.reserved = [0] * ranks  # placed, still in prefill or transfer
        self.reserved_tokens = [0] * ranks
        self.epoch = 0  # a removed instance's step event is ignored

    def running(self) -> list[ReplayRequest]:
        return [r for _, _, t, r in self.heap if r.ticket == t and r.dec is self]

    def rank_loads(self) -> list[tuple[int, int]]:
        """Per rank, what its load report would say: (requests, context tokens), reservations and requests
        joining at the next step included."""
        running = [b + r for b, r in zip(self.batch, self.reserved)]
        used = [c + t for c, t in zip(self.ctx, self.reserved_tokens)]
        for r in self.pending:
            running[r.rank] += 1
            used[r.rank] += r.isl + r.done
        return list(zip(running, used))

    def view(self, decode_kv_tokens: int, loads: list[tuple[int, int]] | None = None) -> DecodeView:
        """The view the router's policy gets of it (free blocks: its fullest rank's, as the router takes them)."""
        loads = loads or self.rank_loads()
        return DecodeView(self.name, [RankView(b, u) for b, u in loads],
                          free_blocks=max(0, (decode_kv_tokens - max(u for _, u in loads)) // 64))

    def step_seconds(self, perf: PerfModel) -> float:
        return max(perf.decode_step_seconds(b, c) for b, c in zip(self.batch, self.ctx))

