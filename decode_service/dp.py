"""Attention-DP decode: one DecodeRank per rank, stepped in lock-step by the coordinator on rank 0.

Each loop iteration rank 0 broadcasts the pending commands (reserve / admit / abort / release, each
addressed to one rank), every rank applies its own, then every rank runs one `dp_step` (its batch,
or a dummy batch while any other rank has work, so the EP collectives are always entered by all),
and rank 0 gathers the replies, the token events and each rank's load. With one rank there are no
collectives and this is a plain engine loop.

With local TP (`--tp N`, dp 1) the ranks mirror one batch: every command applies on every rank
in the same order (same lease ids, so the same blocks), the pushed KV lands on rank 0 and is
broadcast to the other ranks at admission, lease expiry is an ordered release command for all
ranks, and only rank 0's replies and events are used.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shared import metrics
from shared.engine import LLMEngine, SamplingParams
from shared.engine.llm import dp_step
from shared.kvcache import OutOfBlocks
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.parallel import ParallelState
from shared.rpc.service import LoopQueue
from shared.transfer import TcpReceiver
from shared.transfer.base import cache_kinds

log = logging.getLogger("pdserve.decode")
STOP = "stop"
FATAL = object()  # put in every stream when the engine loop dies: the handlers end with UNAVAILABLE
ALL = -1  # Command.rank for a command every rank applies (TP mirror mode)


class CommandError(Exception):
    """A command failed on its rank; `code` names the gRPC status the front should return."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Command:
    kind: str  # reserve | admit | abort | release
    rank: int
    cid: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Event:
    request_id: str
    token_id: int
    finished: bool
    finish_reason: str | None
    error: str = ""  # finish_reason "error": the engine failed this request (no token)


class DecodeRank:
    """One rank's engine, KV pool, leases and KV receiver."""

    def __init__(self, cfg, rank: int, state: ParallelState):  # noqa: ANN001 - DecodeConfig
        self.rank, self.state = rank, state
        self.mirror = state.config.tp > 1
        self.admitted = 0
        self.applied_cid = -1  # the newest command applied here (load reports say what they include)
        self.engine = LLMEngine(cfg.engine_config(enable_prefix_caching=False), state)  # KV arrives pushed
        kv = self.engine.kv
        self.leases = LeaseTable(kv.allocator, cfg.block_size, kv.layout.num_layers, cache_kinds(kv.layout),
                                 cfg.lease_seconds)
        self.tcp = TcpReceiver(kv, self.leases, cfg.host, cfg.kv_port + rank if cfg.kv_port else 0,
                               advertise_host=cfg.public_host, tls=cfg.credentials().ssl_context(server=True))
        self.receiver = self.tcp
        if cfg.kv_transport == "mooncake":
            from shared.transfer.mooncake import MooncakeReceiver

            self.receiver = MooncakeReceiver(kv, self.tcp, cfg.public_host)

    def apply(self, cmd: Command) -> Any:
        self.applied_cid = max(self.applied_cid, cmd.cid)
        a = cmd.args
        if cmd.kind == "reserve":
            try:
                lease = self.leases.reserve(a["request_id"], a["num_tokens"], a.get("lease_id"), a.get("token"),
                                            a.get("prompt_tokens"))
            except OutOfBlocks as exc:
                return CommandError("RESOURCE_EXHAUSTED", f"decode rank {self.rank} KV pool full: {exc}")
            return self.receiver.destination(lease)
        if cmd.kind == "admit":
            return self._admit(a)
        if cmd.kind == "abort":
            self.engine.abort(a["request_id"])
            return None
        if cmd.kind == "release":
            return self.leases.release(a["lease_id"])
        return CommandError("INTERNAL", f"unknown command {cmd.kind}")

    def _admit(self, a: dict[str, Any]) -> list[Event] | CommandError:
        try:
            lease = self.leases.claim(a["lease_id"], require_complete=not (self.mirror and self.rank))
        except LeaseError as exc:
            return CommandError("FAILED_PRECONDITION", str(exc))
        if self.mirror:
            self._copy_kv_from_rank0(lease.blocks)
        try:
            seq = self.engine.make_sequence(a["prompt"], SamplingParams(**a["params"]), a["request_id"])
        except ValueError as exc:
            self.engine.kv.allocator.free(lease.blocks)
            return CommandError("INVALID_ARGUMENT", str(exc))
        seq.block_table = list(lease.blocks)
        self.admitted += 1
        if a.get("rng_state") and seq.params.seed is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(a["rng_state"]), dtype=torch.uint8))
        return [_event(ev) for ev in self.engine.add_prefilled(seq, a["first_token"])]

    def _copy_kv_from_rank0(self, blocks: list[int]) -> None:
        """TP mirror: the prefill pushed into rank 0's blocks; every rank gets the same rows."""
        index = torch.tensor(blocks, dtype=torch.long)
        for pool in (self.engine.kv.mla, self.engine.kv.index):
            if pool is None:
                continue
            rows = pool[:, index].contiguous()  # [layers, blocks, block_size, dim]
            dist.broadcast(rows, src=0, group=self.state.world_group)
            pool[:, index] = rows

    def step(self) -> list[Event]:
        if not self.mirror:  # mirrors release expired leases by command, in the same order everywhere
            self.leases.expire()
        if self.state.is_parallel:  # a failure inside the group's collectives cannot be contained
            events, _ = dp_step(self.engine)
            return [_event(ev) for ev in events]
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the loop goes on
            log.exception("decode step failed; failing the requests of this batch")
            failed = list(self.engine.scheduler.running)
            for seq in failed:
                self.engine.abort(seq.request_id, "error")
            return [Event(seq.request_id, -1, True, "error", f"decode step failed: {exc}") for seq in failed]
        return [_event(ev) for ev in events]

    def load(self) -> dict[str, int]:
        sched, kv = self.engine.scheduler, self.engine.kv
        reserved = self.leases.reserved_blocks() * kv.layout.block_size
        return {"rank": self.rank, "running": len(sched.running), "waiting": len(sched.waiting),
                "free_blocks": kv.allocator.num_free, "total_blocks": self.engine.usable_blocks,
                "active_leases": len(self.leases), "has_work": int(self.engine.has_work), "admitted": self.admitted,
                "tokens": sum(s.num_tokens for s in sched.running) + reserved, "applied_cid": self.applied_cid,
                "expired": self.leases.drain_expired(), "kv_bytes_received": self.tcp.bytes_received}

    def close(self) -> None:
        self.receiver.close()
        if self.receiver is not self.tcp:
            self.tcp.close()


def _event(ev) -> Event:  # noqa: ANN001 - StepEvent
    return Event(ev.seq.request_id, ev.token_id, ev.finished, ev.seq.finish_reason)


def follower_loop(me: DecodeRank) -> None:
    """Ranks 1..N-1: apply broadcast commands, step, report to rank 0, until STOP."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] == STOP:
            break
        replies = [(cmd.cid, me.apply(cmd)) for cmd in box[0] if cmd.rank in (me.rank, ALL)]
        events = me.step()
        dist.gather_object((replies, events, me.load()), None, dst=0)
    me.close()


class Streams:
    """Request id → event sink (anything with a thread-safe `put`) of the streams being served."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, Any] = {}

    def open(self, request_id: str, q: Any = None) -> Any:
        """Register the sink of a new stream (a queue.Queue by default) and return it; a request id
        already streaming is refused (KeyError), and the stream that has it is not touched."""
        q = queue.Queue() if q is None else q
        with self._lock:
            if request_id in self._sinks:
                raise KeyError(request_id)
            self._sinks[request_id] = q
        return q

    def close(self, request_id: str, q: Any = None) -> None:
        """End a stream (only `q` when given: a refused duplicate never closes the stream it collided with)."""
        with self._lock:
            if q is not None and self._sinks.get(request_id) is not q:
                return
            q = self._sinks.pop(request_id, None)
        if q is not None:
            q.put(None)

    def dispatch(self, events: list[Event]) -> None:
        """A step's events to their streams, in one hand-over to the serving event loop."""
        out = []
        with self._lock:
            for ev in events:
                q = self._sinks.get(ev.request_id)
                if q is not None:
                    out.append((q, ev))
                    if ev.finished:
                        del self._sinks[ev.request_id]
                        out.append((q, None))
        LoopQueue.put_all(out)

    def fail_all(self) -> None:
        """The engine died: every stream ends with UNAVAILABLE."""
        with self._lock:
            sinks, self._sinks = list(self._sinks.values()), {}
        for q in sinks:
            q.put(FATAL)


class Coordinator:
    """Rank 0: owns the lock-step loop; gRPC handlers submit commands and read event streams.
    Runs in the decode engine-core process (decode_service.core), or in-process."""

    def __init__(self, me: DecodeRank, world: int):
        self.me, self.world = me, world
        self.mirror = me.mirror
        self.loads: list[dict[str, Any]] = [me.load()] + [
            {"rank": r, "running": 0, "waiting": 0, "free_blocks": me.engine.kv.num_blocks,
             "total_blocks": me.engine.kv.num_blocks, "active_leases": 0, "has_work": 0, "tokens": 0, "admitted": 0,
             "applied_cid": -1, "kv_bytes_received": 0}
            for r in range(1, world)]
        self.lease_rank: dict[str, int] = {}
        self._unreported: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # (cid, tokens)
        self._place_lock = threading.Lock()
        self._pending: queue.Queue[tuple[Command, Future]] = queue.Queue()
        self._futures: dict[int, Future] = {}
        self.streams = Streams()
        self.sink: Callable[[list[Event]], None] = self.streams.dispatch  # where a step's events go
        # after every loop turn: (loads, lease ids that expired, step seconds or None when idle)
        self.on_report: Callable[[list[dict[str, Any]], list[str], float | None], None] | None = None
        self._ids = itertools.count()
        self._stop = False
        self.on_fatal: Callable[[str], None] | None = None  # set by the server: NOT_SERVING, then exit
        engine = me.engine
        self.max_model_len, self.block_size = engine.max_model_len, engine.layout.block_size
        self.usable_blocks = engine.usable_blocks
        self.output_processor = engine.output_processor
        self._thread = threading.Thread(target=self._loop, name="dp-coordinator", daemon=True)
        self._thread.start()

    # -- API for gRPC handlers ---------------------------------------------------------------------
    def submit(self, kind: str, rank: int, **args: Any) -> Future:
        fut: Future = Future()
        cid = next(self._ids)
        fut.cid = cid  # type: ignore[attr-defined] - lets reserve() match load reports to it
        if self.mirror:
            rank = ALL
            if kind == "reserve":  # one lease id and token for every mirror rank
                args = {**args, "lease_id": uuid.uuid4().hex, "token": secrets.token_bytes(16)}
            elif kind == "admit" and not self.me.leases.is_complete(args["lease_id"]):
                fut.set_exception(CommandError("FAILED_PRECONDITION",
                                               f"lease {args['lease_id']!r} is unknown, expired or incomplete"))
                return fut
        self._pending.put((Command(kind, rank, cid, args), fut))
        return fut

    def reserve(self, request_id: str, tokens: int, prompt_tokens: int | None = None) -> Future:
        """Place a reservation on the least loaded DP rank by tokens (running contexts + leases);
        the Future yields (rank, destination). Reservations not yet visible in a rank's load report
        are counted too, so a burst of them spreads over the ranks."""
        with self._place_lock:
            if self.mirror:
                rank = 0
            else:
                def load(r: int) -> tuple[int, int, int]:
                    pending = sum(t for _, t in self._unreported[r])
                    return self.loads[r]["tokens"] + pending, self.loads[r]["running"], r

                rank = min(range(self.world), key=load)
            fut = self.submit("reserve", rank, request_id=request_id, num_tokens=tokens, prompt_tokens=prompt_tokens)
            self._unreported[rank].append((fut.cid, tokens))
        return _then(fut, lambda dest: (rank, dest))

    def open_stream(self, request_id: str, q: Any = None) -> Any:
        return self.streams.open(request_id, q)

    def close_stream(self, request_id: str, q: Any = None) -> None:
        self.streams.close(request_id, q)

    def stop(self) -> None:
        self._stop = True
        self._thread.join(10)

    # -- loop ----------------------------------------------------------------------------------------
    def _drain(self, block: bool) -> list[Command]:
        """Pending commands; when idle, wait briefly for the first one (this is also the tick)."""
        cmds = []
        while True:
            try:
                cmd, fut = self._pending.get(timeout=0.05) if block and not cmds else self._pending.get_nowait()
            except queue.Empty:
                return cmds
            self._futures[cmd.cid] = fut
            cmds.append(cmd)

    def _loop(self) -> None:
        try:
            while not self._stop:
                idle = not any(load["has_work"] for load in self.loads)
                cmds = self._drain(block=idle)
                if self.mirror:
                    cmds += self._expiry_commands()
                if idle and not cmds and self.world == 1:
                    self.me.leases.expire()
                    self._report([self._absorb(0, self.me.load())], None)
                    continue
                if self.world > 1:
                    dist.broadcast_object_list([cmds], src=0)
                for cmd in cmds:  # rank 0's own replies (an admit's first token) go out before the step
                    if cmd.rank in (0, ALL):
                        self._resolve(cmd.cid, self.me.apply(cmd))
                t_step = time.perf_counter()
                events = self.me.step()
                reports = [([], events, self.me.load())]
                if self.world > 1:
                    gathered: list[Any] = [None] * self.world
                    dist.gather_object(reports[0], gathered, dst=0)
                    reports = gathered
                expired = []
                for rank, (rank_replies, rank_events, load) in enumerate(reports):
                    if self.mirror and rank:  # mirrors repeat rank 0: their replies and events are dropped
                        load.pop("expired")
                        self.loads[rank] = load
                        continue
                    expired.append(self._absorb(rank, load))
                    for cid, reply in rank_replies:
                        self._resolve(cid, reply)
                    self.sink(rank_events)
                self._report(expired, time.perf_counter() - t_step)
        except Exception as exc:  # noqa: BLE001
            log.exception("decode coordinator loop failed")
            self.streams.fail_all()
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(CommandError("UNAVAILABLE", f"decode engine failed: {exc}"))
            if self.on_fatal is not None:
                self.on_fatal(f"{type(exc).__name__}: {exc}")
        finally:
            if self.world > 1:
                dist.broadcast_object_list([STOP], src=0)
            self.me.close()

    def _absorb(self, rank: int, load: dict[str, Any]) -> list[str]:
        """Take a rank's load report; forget the routing of its expired leases (returned)."""
        expired = load.pop("expired")
        for lease_id in expired:
            self.lease_rank.pop(lease_id, None)
        with self._place_lock:
            self._unreported[rank] = [(c, t) for c, t in self._unreported[rank] if c > load["applied_cid"]]
        self.loads[rank] = load
        return expired

    def _report(self, expired_per_rank: list[list[str]], step_seconds: float | None) -> None:
        expired = [lease for per_rank in expired_per_rank for lease in per_rank]
        if self.on_report is not None:
            self.on_report(self.loads, expired, step_seconds)
            return
        metrics.EXPIRED_LEASES.inc(len(expired))
        if step_seconds is not None:
            metrics.STEP_SECONDS.observe(step_seconds)

    def _expiry_commands(self) -> list[Command]:
        """TP mirror: overdue leases become release commands applied by every rank in order."""
        out = []
        for lease_id in self.me.leases.overdue():
            self.lease_rank.pop(lease_id, None)
            out.append(Command("release", ALL, next(self._ids), {"lease_id": lease_id}))
        return out

    def _resolve(self, cid: int, reply: Any) -> None:
        fut = self._futures.pop(cid, None)
        if fut is None or fut.done():  # nobody may cancel it, but a dead waiter must not stop the loop
            return
        if isinstance(reply, CommandError):
            fut.set_exception(reply)
        else:
            if isinstance(reply, list):  # admit: deliver the first token before the caller streams
                self.sink(reply)
            fut.set_result(reply)



def _then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A Future of fn(fut's result) (its exception passes through)."""
    out: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(fn(f.result()))

    fut.add_done_callback(done)
    return out


def params_dict(p: SamplingParams) -> dict[str, Any]:
    return asdict(p)
