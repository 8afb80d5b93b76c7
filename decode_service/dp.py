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

import logging
import queue
import secrets
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from shared import metrics
from shared.engine import LLMEngine, SamplingParams
from shared.engine.core import ALL, Command, CommandError, EngineCore, RankReport, follow
from shared.engine.speculative import MAX_SPECULATIVE_TOKENS
from shared.kvcache import OutOfBlocks
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.parallel import ParallelState
from shared.rpc.service import LoopQueue
from shared.transfer import TcpReceiver
from shared.transfer.base import cache_kinds

log = logging.getLogger("pdserve.decode")
FATAL = object()  # put in every stream when the engine loop dies: the handlers end with UNAVAILABLE
# A rank's load report: these integers travel in the fixed per-turn row (expired lease ids do not).
SPEC_FIELDS = tuple(f"spec_{kind}_{i}" for kind in ("drafted", "accepted") for i in range(MAX_SPECULATIVE_TOKENS))
LOAD_FIELDS = ("rank", "running", "waiting", "free_blocks", "total_blocks", "active_leases", "has_work", "admitted",
               "tokens", "queued_prompt_tokens", "applied_cid", "kv_bytes_received", *SPEC_FIELDS)
FINISH_REASONS = (None, "stop", "length", "abort", "error")
__all__ = ["ALL", "FATAL", "Command", "CommandError", "Coordinator", "DecodeRank", "Event", "Streams", "follower_loop"]


@dataclass
class Event:
    request_id: str
    token_id: int
    finished: bool
    finish_reason: str | None
    error: str = ""  # finish_reason "error": the engine failed this request (no token)


class DecodeRank:
    """One rank's engine, KV pool, leases and KV receiver (a RankDriver of the engine core)."""

    gathers = True  # rank 0 places reservations by every rank's load

    def __init__(self, cfg, rank: int, state: ParallelState):  # noqa: ANN001 - DecodeConfig
        self.rank, self.state = rank, state
        self.mirror = state.config.tp > 1
        self.admitted = 0
        self.handles: dict[str, int] = {}  # request id → its admit command's id (events travel as ints)
        self._ended: dict[str, int] = {}  # the handles of the requests the last step finished
        self.name_of: Callable[[int], str | None] = lambda handle: None  # rank 0: set by the Coordinator
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

            self.receiver = MooncakeReceiver(kv, self.tcp, cfg.public_host, cfg.mooncake_protocol,
                                             cfg.mooncake_devices)

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
            return self._admit(a, cmd.cid)
        if cmd.kind == "abort":
            self.engine.abort(a["request_id"])
            self.handles.pop(a["request_id"], None)
            return None
        if cmd.kind == "release":
            return self.leases.release(a["lease_id"])
        return CommandError("INTERNAL", f"unknown command {cmd.kind}")

    def _admit(self, a: dict[str, Any], handle: int) -> list[Event] | CommandError:
        """Start decoding a request in its lease's blocks: pushed KV (the prefill's first token given),
        or, with `local`, a prompt this engine prefills itself (selective disaggregation: queued like
        any prompt, chunked within the step's token budget beside the running decodes)."""
        local = bool(a.get("local"))
        try:
            lease = self.leases.claim(a["lease_id"], require_complete=not (local or (self.mirror and self.rank)))
        except LeaseError as exc:
            return CommandError("FAILED_PRECONDITION", str(exc))
        if self.mirror and not local:
            self._copy_kv_from_rank0(lease.blocks)
        try:
            seq = self.engine.make_sequence(a["prompt"], SamplingParams(**a["params"]), a["request_id"])
        except ValueError as exc:
            self.engine.kv.allocator.free(lease.blocks)
            return CommandError("INVALID_ARGUMENT", str(exc))
        if local and self.engine.kv.blocks_needed(seq.num_tokens + seq.params.max_tokens) > len(lease.blocks):
            self.engine.abort(seq.request_id)
            self.engine.kv.allocator.free(lease.blocks)
            return CommandError("INVALID_ARGUMENT", f"prompt_token_ids: {seq.num_tokens} tokens + max_tokens "
                                                    f"{seq.params.max_tokens} do not fit the lease's "
                                                    f"{len(lease.blocks)} blocks")
        seq.block_table = list(lease.blocks)
        self.admitted += 1
        if local:
            self.engine.scheduler.add(seq)  # its blocks are the lease's: the scheduler only adds if it grows
            self.handles[seq.request_id] = handle
            return []
        if a.get("rng_state") and seq.params.seed is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(a["rng_state"]), dtype=torch.uint8))
        events = [_event(ev) for ev in self.engine.add_prefilled(seq, a["first_token"])]
        if not events[-1].finished:
            self.handles[seq.request_id] = handle
        return events

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
        events = self._step()
        self._ended = {ev.request_id: self.handles.pop(ev.request_id) for ev in events
                       if ev.finished and ev.request_id in self.handles}  # encode() still names them
        return events

    def _step(self) -> list[Event]:
        if not self.mirror:  # mirrors release expired leases by command, in the same order everywhere
            self.leases.expire()
        if self.state.is_parallel:  # a failure inside the group's collectives cannot be contained
            return [_event(ev) for ev in self.engine.step()]
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the loop goes on
            log.exception("decode step failed; failing the requests of this batch")
            failed = list(self.engine.scheduler.running)
            for seq in failed:
                self.engine.abort(seq.request_id, "error")
            return [Event(seq.request_id, -1, True, "error", f"decode step failed: {exc}") for seq in failed]
        return [_event(ev) for ev in events]

    def encode(self, report: RankReport) -> tuple[torch.Tensor, Any]:
        """The turn's report as a fixed row (load integers, then up to `event_capacity` events as
        (handle, token, finish reason)) and, only when there is any, an object part: replies to
        commands, expired lease ids, or events the row cannot carry (an error, an overflow)."""
        cap = self.event_capacity
        load = dict(report.load)
        expired = load.pop("expired")
        events = report.events

        def handle(rid: str) -> int | None:
            return self.handles.get(rid, self._ended.get(rid))

        plain = len(events) <= cap and all(not ev.error and handle(ev.request_id) is not None for ev in events)
        row = torch.zeros(len(LOAD_FIELDS) + 1 + 3 * cap, dtype=torch.int64)
        row[: len(LOAD_FIELDS)] = torch.tensor([load[k] for k in LOAD_FIELDS])
        if plain and events:
            row[len(LOAD_FIELDS)] = len(events)
            codes = [(handle(ev.request_id), ev.token_id, FINISH_REASONS.index(ev.finish_reason))
                     for ev in events]
            row[len(LOAD_FIELDS) + 1: len(LOAD_FIELDS) + 1 + 3 * len(events)] = torch.tensor(codes).view(-1)
        extra = None
        if report.replies or expired or not plain:
            extra = (report.replies, expired, None if plain else events)
        return row, extra

    @property
    def event_capacity(self) -> int:
        """Token events one step can make: a token per running request, K + 1 under MTP."""
        return self.engine.config.max_num_seqs * self.engine.scheduler.decode_width

    def decode(self, row: torch.Tensor, extra: Any) -> RankReport:
        """Rank 0: a rank's report back from `encode`."""
        values = row.tolist()
        load: dict[str, Any] = dict(zip(LOAD_FIELDS, values[: len(LOAD_FIELDS)]))
        replies, load["expired"], events = extra if extra is not None else ([], [], None)
        if events is None:
            n, base = values[len(LOAD_FIELDS)], len(LOAD_FIELDS) + 1
            events = []
            for i in range(n):
                handle, token, reason = values[base + 3 * i: base + 3 * i + 3]
                events.append(Event(self.name_of(handle) or "", token, reason != 0, FINISH_REASONS[reason]))
        return RankReport(replies, events, load)

    def load(self) -> dict[str, int]:
        sched, kv = self.engine.scheduler, self.engine.kv
        reserved = self.leases.reserved_blocks() * kv.layout.block_size
        return {"rank": self.rank, "running": len(sched.running), "waiting": len(sched.waiting),
                "free_blocks": kv.allocator.num_free, "total_blocks": self.engine.usable_blocks,
                "active_leases": len(self.leases), "has_work": int(self.engine.has_work), "admitted": self.admitted,
                "tokens": sum(s.num_tokens for s in [*sched.running, *sched.waiting]) + reserved,
                "queued_prompt_tokens": sum(s.num_uncached for s in [*sched.running, *sched.waiting]
                                            if s.is_prefilling),
                "applied_cid": self.applied_cid,
                "expired": self.leases.drain_expired(), "kv_bytes_received": self.tcp.bytes_received,
                **self._spec_counts()}

    def _spec_counts(self) -> dict[str, int]:
        """MTP drafted / accepted totals per draft position (zeros without speculative decoding)."""
        spec = self.engine.speculator
        counts = (spec.stats.drafted + spec.stats.accepted) if spec is not None else [0] * len(SPEC_FIELDS)
        return dict(zip(SPEC_FIELDS, counts, strict=True))

    def close(self) -> None:
        self.receiver.close()
        if self.receiver is not self.tcp:
            self.tcp.close()


def _event(ev) -> Event:  # noqa: ANN001 - StepEvent
    """A step event as the decode front sees it. The finish reason rides only on the request's last
    event: an MTP step that accepted drafts emits several tokens of one request after the request
    finished, and the row encoding reads a non-empty reason as "finished" (so an earlier event
    carrying it would end the stream and lose the accepted tail)."""
    return Event(ev.seq.request_id, ev.token_id, ev.finished, ev.seq.finish_reason if ev.finished else None)


def follower_loop(me: DecodeRank) -> None:
    """Ranks 1..N-1: the engine-core loop's follower side, until rank 0 stops the instance."""
    follow(me, me.state)


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


class Coordinator(EngineCore):
    """Rank 0's engine core: places reservations, keeps every rank's load, streams the events.
    Runs in the decode engine-core process (decode_service.core), or in-process."""

    def __init__(self, me: DecodeRank, world: int):
        super().__init__(me, me.state, "dp-coordinator")
        self.me, self.mirror = me, me.mirror
        self.loads: list[dict[str, Any]] = [me.load()] + [
            {"rank": r, "running": 0, "waiting": 0, "free_blocks": me.engine.kv.num_blocks,
             "total_blocks": me.engine.kv.num_blocks, "active_leases": 0, "has_work": 0, "tokens": 0, "admitted": 0,
             "queued_prompt_tokens": 0,
             "applied_cid": -1, "kv_bytes_received": 0}
            for r in range(1, world)]
        self.lease_rank: dict[str, int] = {}
        self._unreported: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # (cid, tokens)
        self._place_lock = threading.Lock()
        self._admitted: dict[int, str] = {}  # admit command id → request id (events travel as ints)
        self._admit_cid: dict[str, int] = {}
        me.name_of = self._admitted.get
        self.streams = Streams()
        self.sink: Callable[[list[Event]], None] = self.streams.dispatch  # where a step's events go
        # after every loop turn: (loads, lease ids that expired, step seconds or None when idle)
        self.on_report: Callable[[list[dict[str, Any]], list[str], float | None], None] | None = None
        engine = me.engine
        self.max_model_len, self.block_size = engine.max_model_len, engine.layout.block_size
        self.usable_blocks = engine.usable_blocks
        self.output_processor = engine.output_processor
        self.start()

    # -- API for gRPC handlers ---------------------------------------------------------------------
    def submit(self, kind: str, rank: int = 0, **args: Any) -> Future:
        if self.mirror:
            rank = ALL
            if kind == "reserve":  # one lease id and token for every mirror rank
                args = {**args, "lease_id": uuid.uuid4().hex, "token": secrets.token_bytes(16)}
            elif kind == "admit" and not args.get("local") and not self.me.leases.is_complete(args["lease_id"]):
                fut: Future = Future()
                fut.set_exception(CommandError("FAILED_PRECONDITION",
                                               f"lease {args['lease_id']!r} is unknown, expired or incomplete"))
                return fut
        return super().submit(kind, rank, **args)

    def queued(self, cmd: Command) -> None:
        """Name an admit's events before any rank can step it; forget an aborted one's name."""
        rid = cmd.args.get("request_id")
        if cmd.kind == "admit":
            self._admitted[cmd.cid], self._admit_cid[rid] = rid, cmd.cid
        elif cmd.kind == "abort":  # events of an aborted request may be dropped from here on
            self._admitted.pop(self._admit_cid.pop(rid, -1), None)

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

    # -- the engine core's hooks -----------------------------------------------------------------------
    def busy(self) -> bool:
        return any(load["has_work"] for load in self.loads)

    def turn_commands(self, cmds: list[Command]) -> list[Command]:
        """TP mirror: overdue leases become release commands applied by every rank in order."""
        if not self.mirror:
            return cmds
        for lease_id in self.me.leases.overdue():
            self.lease_rank.pop(lease_id, None)
            cmds.append(Command("release", ALL, next(self._ids), {"lease_id": lease_id}))
        return cmds

    def idle(self) -> None:
        self.me.leases.expire()
        self._report([self._absorb(0, self.me.load())], None)

    def after_turn(self, reports: list[RankReport], step_seconds: float) -> None:
        expired = []
        for rank, report in enumerate(reports):
            if self.mirror and rank:  # mirrors repeat rank 0: their replies and events are dropped
                report.load.pop("expired")
                self.loads[rank] = report.load
                continue
            expired.append(self._absorb(rank, report.load))
            for cid, reply in report.replies:
                self.resolve(cid, reply)
            self._forget_finished(report.events)
            self.sink(report.events)
        self._report(expired, step_seconds)

    def resolve(self, cid: int, reply: Any) -> None:
        if isinstance(reply, list):  # admit: deliver the first token before the caller streams
            self._forget_finished(reply)
            self.sink(reply)
        elif isinstance(reply, CommandError):
            self._admit_cid.pop(self._admitted.pop(cid, ""), None)
        super().resolve(cid, reply)

    def on_failure(self, exc: BaseException) -> None:
        log.error("decode coordinator loop failed: %s", exc)
        self.streams.fail_all()

    # -- bookkeeping -----------------------------------------------------------------------------------
    def _forget_finished(self, events: list[Event]) -> None:
        for ev in events:
            if ev.finished:
                self._admitted.pop(self._admit_cid.pop(ev.request_id, -1), None)

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
