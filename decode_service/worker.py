"""What a decode instance does on each rank (`DecodeWorker`, a RankDriver of the one engine-core loop,
shared.engine.core), and the commands, events and load reports that cross its seams.

Attention DP: every rank has its own requests and the ranks step in lock-step (an idle rank runs a
dummy batch while any other has work, so the EP collectives are always entered by all); each turn
every rank's report travels to rank 0 as a fixed-size row (load integers, cache and token events), objects
only when there are replies or rare events. Local TP (`--tp N`, dp 1): the ranks mirror one batch:
every command applies on every rank in the same order (same lease ids, so the same blocks), the pushed
KV lands on rank 0 and is broadcast to the other ranks at admission, lease expiry is an ordered
release command for all ranks, and only rank 0's replies and events are used.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shared.config import DecodeConfig
from shared.engine import LLMEngine, SamplingParams, StepEvent
from shared.engine.core import CommandError, EncodedReport, EngineCommand, RankCommand, RankReport
from shared.engine.graphs import GraphStats
from shared.engine.scheduler import Sequence
from shared.engine.speculative import MAX_SPECULATIVE_TOKENS
from shared.kvcache import CacheEvent, OutOfBlocks, event_log
from shared.kvcache.event_log import listen_to
from shared.kvcache.lease import Lease, LeaseError, LeaseTable
from shared.kvcache.tier import totals as tier_totals
from shared.parallel import ParallelState
from shared.protocol.finish import FinishReason
from shared.protocol.load import RankLoad
from shared.protocol.sampling import TokenLogprob
from shared.rpc.service import Credentials
from shared.transfer import Destination, TcpReceiver
from shared.transfer.base import cache_kinds
from shared.transfer.mooncake import MooncakeReceiver

log = logging.getLogger("pdserve.decode")
FINISH_CODES: tuple[FinishReason | None, ...] = (None, *FinishReason)  # an event's finish reason in the row


# -- commands -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reserve(EngineCommand):
    """Hold blocks for a request's KV (a lease the prefill pushes into); replies with its Destination.
    Mirrored ranks get the lease id and token from rank 0, so every rank holds the same lease."""

    request_id: str
    num_tokens: int
    prompt_tokens: int | None = None
    lease_id: str | None = None
    token: bytes | None = None
    prefix: tuple[bytes, ...] = ()  # the prompt's leading block keys: the lease starts on those this rank caches


@dataclass(frozen=True)
class Admit(EngineCommand):
    """Start decoding a request in its lease's blocks: its prompt's KV pushed (and the prefill's first
    token), or with `local`, a prompt this engine prefills itself. Replies with the first events."""

    request_id: str
    lease_id: str
    prompt: list[int]
    params: SamplingParams
    first_token: int = 0
    rng_state: bytes = b""
    local: bool = False
    first_logprob: TokenLogprob | None = None  # the prefill's, with params.logprobs
    num_resumed: int = 0  # a migrated request's earlier outputs end the prompt (LLMEngine.make_sequence)
    cache_salt: str = ""  # the tenant's prefix-cache namespace (a local prefill's keys; a later decode cache's)


@dataclass(frozen=True)
class Abort(EngineCommand):
    """Stop a request: its stream ended or its caller left, or (`stop_string`) the front found one of
    its stop strings in its text. Replies with the FinishReason the engine ended it with (None: it had
    ended already)."""

    request_id: str
    stop_string: bool = False


@dataclass(frozen=True)
class Release(EngineCommand):
    """Give a lease's blocks back (unused reservation); replies whether it was still held."""

    lease_id: str


# -- what the worker reports ----------------------------------------------------------------------------
@dataclass
class Event:
    """A token of a request's stream, as the decode front sees it."""

    request_id: str
    token_id: int
    finished: bool
    finish_reason: FinishReason | None
    error: str = ""  # finish_reason ERROR: the engine failed this request (no token)
    logprob: TokenLogprob | None = None  # with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # a local prefill's, on its first token (prompt_logprobs)


PROMPT_ENDS_KEPT = 1 << 16  # prompts whose end a decode rank remembers (32 B each)

# the integers of a rank's report that travel in the fixed per-turn row, in order: its RankLoad's, then these
RANK_FIELDS = tuple(f.name for f in dataclasses.fields(RankLoad))
EXTRA_FIELDS = ("has_work", "applied_cid", "kv_bytes_received")
ROW_WIDTH = len(RANK_FIELDS) + len(EXTRA_FIELDS) + 2 * MAX_SPECULATIVE_TOKENS  # the report's part of the row
TOKENS_AT = ROW_WIDTH + event_log.ROW_WIDTH  # then the turn's prefix-cache events; its token events from here


@dataclass
class DecodeRankReport:
    """One decode rank's report after a turn: `load`, the numbers the router sees (rank 0 places
    reservations by them too), and what only the engine core uses."""

    load: RankLoad
    has_work: int = 0
    applied_cid: int = -1  # the newest command applied (the report includes it)
    kv_bytes_received: int = 0
    spec_drafted: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)  # MTP, per draft position
    spec_accepted: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)
    expired: list[str] = field(default_factory=list)  # lease ids that expired since the last report
    kv_events: list[CacheEvent] = field(default_factory=list)  # the rank's prefix-cache events since the last one

    def to_row(self) -> list[int]:
        return ([getattr(self.load, k) for k in RANK_FIELDS] + [getattr(self, k) for k in EXTRA_FIELDS]
                + self.spec_drafted + self.spec_accepted)

    @classmethod
    def from_row(cls, values: list[int], expired: list[str], kv_events: list[CacheEvent] | None = None
                 ) -> DecodeRankReport:
        r, e, n = len(RANK_FIELDS), len(EXTRA_FIELDS), MAX_SPECULATIVE_TOKENS
        spec = values[r + e :]
        return cls(RankLoad(*values[:r]), *values[r : r + e], spec_drafted=spec[:n], spec_accepted=spec[n : 2 * n],
                   expired=expired, kv_events=kv_events or [])

    def gauges(self) -> dict[str, int]:
        """The numbers /metrics exports (shared.metrics.LoadCollector)."""
        out = {k: getattr(self.load, k) for k in RANK_FIELDS} | {k: getattr(self, k) for k in EXTRA_FIELDS}
        for kind, counts in (("drafted", self.spec_drafted), ("accepted", self.spec_accepted)):
            out.update({f"spec_{kind}_{i}": c for i, c in enumerate(counts)})
        return out


class DecodeWorker:
    """One rank's engine, KV pool, leases and KV receiver (a RankDriver of the engine core).

    `names` maps admit command ids to request ids: events travel as those ids (ints) in the fixed
    row; rank 0's engine core fills it as it queues admits, so rank 0 names every rank's events."""

    gathers = True  # rank 0 places reservations by every rank's load

    def __init__(self, cfg: DecodeConfig, rank: int, state: ParallelState):
        self.rank, self.state = rank, state
        self.admitted = 0
        self.handles: dict[str, int] = {}  # request id → its admit command's id (events travel as ints)
        self._ended: dict[str, int] = {}  # the handles of the requests the last step finished
        self.names: dict[int, str] = {}  # rank 0: admit command id → request id
        self.applied_cid = -1  # the newest command applied here (load reports say what they include)
        self.engine = LLMEngine(cfg.engine_config(enable_prefix_caching=not cfg.no_prefix_cache), state)
        # the prefix cache keeps the prompt blocks prefill pushed (or a local prefill computed); the rows of
        # generated tokens come from the decode kernels, which a later prompt's prefill would not reproduce
        self.engine.scheduler.cache_prompt_only = True
        self.mirror = self.engine.policy.mirror
        kv = self.engine.kv
        self.kv_events = listen_to(kv, rank)  # this rank's prefix-cache events, drained into each report
        self.leases = LeaseTable(kv.ledger, cfg.block_size, kv.layout.num_layers, cache_kinds(kv.layout),
                                 cfg.lease_seconds)
        # the key of the last full block of prompts admitted here (bounded, oldest out): a reservation that reuses
        # one extends that prompt, a follow-up turn (what metrics.KV_FOLLOW_UP_BLOCKS counts)
        self.prompt_ends: OrderedDict[bytes, None] = OrderedDict()
        self.tcp = TcpReceiver(kv, self.leases, cfg.host, cfg.kv_port + rank if cfg.kv_port else 0,
                               advertise_host=cfg.public_host, tls=Credentials.of(cfg).ssl_context(server=True),
                               stall_seconds=cfg.kv_stall_seconds)
        self.receiver = self.tcp
        if cfg.kv_transport == "mooncake":
            self.receiver = MooncakeReceiver(kv, self.tcp, cfg.public_host, cfg.mooncake_protocol,
                                             cfg.mooncake_devices)

    def apply(self, cmd: RankCommand) -> Destination | list[Event] | bool | FinishReason | CommandError | None:
        self.applied_cid = max(self.applied_cid, cmd.cid)
        c = cmd.command
        if isinstance(c, Reserve):
            try:
                lease = self.leases.reserve(c.request_id, c.num_tokens, c.lease_id, c.token, c.prompt_tokens,
                                            c.prefix if self.engine.scheduler.prefix_caching else ())
            except OutOfBlocks as exc:
                return CommandError("RESOURCE_EXHAUSTED", f"decode rank {self.rank} KV pool full: {exc}")
            # how many of its reused blocks came back from the second tier: the front counts their hits as host's;
            # whether they hold an earlier prompt whole (a follow-up turn whose context this rank kept)
            follow_up = any(k in self.prompt_ends for k in lease.reused_hashes)
            return dataclasses.replace(self.receiver.destination(lease), restored_blocks=lease.restored,
                                       follow_up=follow_up)
        if isinstance(c, Admit):
            return self._admit(c, cmd.cid)
        if isinstance(c, Abort):
            self.handles.pop(c.request_id, None)
            return self.engine.stop_string_found(c.request_id) if c.stop_string else self.engine.abort(c.request_id)
        if isinstance(c, Release):
            return self.leases.release(c.lease_id)
        return CommandError("INTERNAL", f"unknown command {type(c).__name__}")

    def _admit(self, c: Admit, handle: int) -> list[Event] | CommandError:
        """Start decoding a request in its lease's blocks: pushed KV (the prefill's first token given),
        or, with `local`, a prompt this engine prefills itself (selective disaggregation: queued like
        any prompt, chunked within the step's token budget beside the running decodes)."""
        try:
            lease = self.leases.claim(c.lease_id, require_complete=not (c.local or (self.mirror and self.rank)))
        except LeaseError as exc:
            return CommandError("FAILED_PRECONDITION", str(exc))
        if self.mirror and not c.local:
            self._copy_kv_from_rank0(lease.blocks[lease.reused:])  # the reused ones are every rank's already
        try:  # validated by the front; a copy of the params: the request's own, whoever else holds the command
            seq = self.engine.make_sequence(c.prompt, dataclasses.replace(c.params), c.request_id,
                                            num_resumed=c.num_resumed, cache_salt=c.cache_salt)
        except ValueError as exc:
            self.engine.kv.ledger.drop_claimed(lease.blocks)
            return CommandError("INVALID_ARGUMENT", str(exc))
        if refused := self._reuse_refusal(seq, lease, c.local):
            self.engine.abort(seq.request_id)
            self.engine.kv.ledger.drop_claimed(lease.blocks)
            return CommandError("INVALID_ARGUMENT", refused)
        most = len(seq.prompt_token_ids) + seq.params.max_tokens  # a migrated request's outputs count in max_tokens
        if c.local and self.engine.kv.blocks_needed(most) > len(lease.blocks):
            self.engine.abort(seq.request_id)
            self.engine.kv.ledger.drop_claimed(lease.blocks)
            return CommandError("INVALID_ARGUMENT", f"prompt_token_ids: {seq.num_tokens} tokens + max_tokens "
                                                    f"{seq.params.max_tokens} do not fit the lease's "
                                                    f"{len(lease.blocks)} blocks")
        self.engine.kv.ledger.seat(seq, lease.blocks)
        self._remember_prompt_end(seq)
        if c.local:  # its own prefill starts after the cached blocks
            seq.num_cached, seq.num_registered = lease.reused * self.engine.kv.layout.block_size, lease.reused
        self.admitted += 1
        if c.local:
            self.engine.scheduler.add(seq)  # its blocks are the lease's: the scheduler only adds if it grows
            self.handles[seq.request_id] = handle
            return []
        if c.rng_state and seq.params.seed is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(c.rng_state), dtype=torch.uint8))
        events = [_event(ev) for ev in self.engine.add_prefilled(seq, c.first_token, c.first_logprob)]
        if not events[-1].finished:
            self.handles[seq.request_id] = handle
        return events

    def _remember_prompt_end(self, seq: Sequence) -> None:
        """A prompt of two full blocks or more (one block is what a shared system prompt alone fills)."""
        full = len(seq.prompt_token_ids) // self.engine.kv.layout.block_size
        if self.engine.scheduler.prefix_caching and full >= 2:
            self.prompt_ends[self.engine.scheduler.block_keys(seq, full)[-1]] = None
            if len(self.prompt_ends) > PROMPT_ENDS_KEPT:
                self.prompt_ends.popitem(last=False)

    def _reuse_refusal(self, seq: Sequence, lease: Lease, local: bool) -> str | None:
        """A lease that starts on cached blocks serves only the prompt they were cached for (its keys, under
        its salt): any other would read another prompt's KV. Why not, or None."""
        if not lease.reused:
            return None
        if tuple(self.engine.scheduler.block_keys(seq, lease.reused)) != lease.reused_hashes:
            return (f"prompt_token_ids: the first {lease.reused} blocks differ from the prompt lease "
                    f"{lease.lease_id!r} was reserved for")
        if local and seq.params.prompt_logprobs is not None:
            return ("prompt_logprobs: a local prefill with prompt logprobs computes every prompt block; reserve "
                    "it without prompt_token_ids")
        return None

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
        self.engine.kv.ledger.settle()  # every step, busy or idle (a DP rank's dummy one too)
        events = self._step()
        self._ended = {ev.request_id: self.handles.pop(ev.request_id) for ev in events
                       if ev.finished and ev.request_id in self.handles}  # encode() still names them
        return events

    def _step(self) -> list[Event]:
        if not self.mirror:  # mirrors release expired leases by command, in the same order everywhere
            self.leases.expire()
        if self.state.is_parallel:  # a failure inside the group's collectives cannot be contained
            return [_event(ev) for ev in self.engine.step()]
        try:  # a request that makes the step raise fails alone (shared.engine.isolation)
            done = self.engine.step_isolated()
        except Exception as exc:  # a commit that raised: the batch's requests fail, the loop goes on
            log.exception("decode step failed; failing the requests of this batch")
            failed = list(self.engine.scheduler.running)
            for seq in failed:
                self.engine.fail(seq.request_id)
            return [Event(seq.request_id, -1, True, FinishReason.ERROR, f"decode step failed: {exc}") for seq in failed]
        return [_event(ev) for ev in done.events] + [
            Event(f.seq.request_id, -1, True, FinishReason.ERROR,
                  str(f.error) if f.alone else f"decode step failed: {f.error}")
            for f in done.faults]

    def encode(self, report: RankReport) -> EncodedReport:
        """The turn's report as a fixed row (load integers, up to 64 prefix-cache events, then up to
        `event_capacity` token events as (handle, token, finish reason)) and, only when there is any, an
        object part: replies to commands, expired lease ids, or events the row cannot carry (an error, an
        overflow)."""
        cap = self.event_capacity
        load: DecodeRankReport = report.load
        events = report.events

        def handle(rid: str) -> int | None:
            return self.handles.get(rid, self._ended.get(rid))

        plain = len(events) <= cap and all(not ev.error and ev.logprob is None and ev.prompt_logprobs is None
                                           and handle(ev.request_id) is not None
                                           for ev in events)  # else the events travel as objects
        row = torch.zeros(TOKENS_AT + 1 + 3 * cap, dtype=torch.int64)
        row[:ROW_WIDTH] = torch.tensor(load.to_row())
        kv_row = event_log.events_to_row(load.kv_events) if load.kv_events else None
        if kv_row is not None:
            row[ROW_WIDTH:TOKENS_AT] = torch.tensor(kv_row)
        if plain and events:
            row[TOKENS_AT] = len(events)
            codes = [(handle(ev.request_id), ev.token_id, FINISH_CODES.index(ev.finish_reason))
                     for ev in events]
            row[TOKENS_AT + 1: TOKENS_AT + 1 + 3 * len(events)] = torch.tensor(codes).view(-1)
        extra = None
        kv_objects = load.kv_events if load.kv_events and kv_row is None else None
        if report.replies or load.expired or kv_objects or not plain:
            extra = _ReportObjects(report.replies, load.expired, None if plain else events, kv_objects)
        return EncodedReport(row, extra)

    @property
    def event_capacity(self) -> int:
        """Token events one step can make: a token per running request, K + 1 under MTP."""
        return self.engine.config.max_num_seqs * self.engine.scheduler.decode_width

    def decode(self, encoded: EncodedReport) -> RankReport:
        """Rank 0: a rank's report back from `encode`."""
        values = encoded.row.tolist()
        objects: _ReportObjects = encoded.extra if encoded.extra is not None else _ReportObjects()
        events = objects.events
        if events is None:
            n, base = values[TOKENS_AT], TOKENS_AT + 1
            events = []
            for i in range(n):
                handle, token, reason = values[base + 3 * i: base + 3 * i + 3]
                events.append(Event(self.names.get(handle) or "", token, reason != 0, FINISH_CODES[reason]))
        kv_events = objects.kv_events if objects.kv_events is not None else event_log.events_from_row(
            values[ROW_WIDTH:TOKENS_AT])
        return RankReport(objects.replies, events,
                          DecodeRankReport.from_row(values[:ROW_WIDTH], objects.expired, kv_events))

    def load(self) -> DecodeRankReport:
        sched, kv = self.engine.scheduler, self.engine.kv
        reserved = self.leases.reserved_blocks() * kv.layout.block_size
        spec = self.engine.speculator
        requests = [*sched.running, *sched.waiting]
        tier = tier_totals(kv.tier)  # exported by the front (shared.metrics.LoadCollector)
        graphs = self.engine.graphs.stats if self.engine.graphs is not None else GraphStats()
        return DecodeRankReport(
            RankLoad(rank=self.rank, running=len(sched.running), waiting=len(sched.waiting),
                     free_blocks=kv.allocator.num_free, total_blocks=self.engine.usable_blocks,
                     active_leases=len(self.leases), admitted=self.admitted,
                     tokens=sum(s.num_tokens for s in requests) + reserved,
                     queued_prompt_tokens=sum(s.num_uncached for s in requests if s.is_prefilling),
                     tier_written_bytes=tier.written_bytes, tier_read_bytes=tier.read_bytes,
                     tier_dropped_corrupt=tier.dropped_corrupt, tier_dropped_full=tier.dropped_full,
                     graph_replayed=graphs.replays, graph_recorded=graphs.captures, graph_eager=graphs.eager),
            has_work=int(self.engine.has_work), applied_cid=self.applied_cid, kv_bytes_received=self.tcp.bytes_received,
            spec_drafted=list(spec.stats.drafted) if spec else [0] * MAX_SPECULATIVE_TOKENS,
            spec_accepted=list(spec.stats.accepted) if spec else [0] * MAX_SPECULATIVE_TOKENS,
            expired=self.leases.drain_expired(), kv_events=self._new_kv_events())

    def _new_kv_events(self) -> list[CacheEvent]:
        """The rank's cache events since its last report (a TP mirror's other ranks cache what rank 0 does:
        theirs stay here, so no object part travels for them)."""
        new = self.kv_events.drain()
        return new.events if new is not None and not (self.mirror and self.rank) else []

    def close(self) -> None:
        self.receiver.close()
        if self.receiver is not self.tcp:
            self.tcp.close()


@dataclass
class _ReportObjects:
    """The object part of a report: replies, expired lease ids, and token or prefix-cache events when the
    row cannot carry them."""

    replies: list = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    events: list[Event] | None = None
    kv_events: list[CacheEvent] | None = None  # when the row cannot carry them (more than 64)


def _event(ev: StepEvent) -> Event:
    """A step event as the decode front sees it. The finish reason rides only on the request's last
    event: an MTP step that accepted drafts emits several tokens of one request after the request
    finished, and the row encoding reads a non-empty reason as "finished" (so an earlier event
    carrying it would end the stream and lose the accepted tail)."""
    seq = ev.seq
    prompt_logprobs = seq.prompt_logprobs if seq.prompt_logprobs and len(seq.output_token_ids) == 1 else None
    return Event(seq.request_id, ev.token_id, ev.finished, seq.finish_reason if ev.finished else None,
                 logprob=ev.logprob, prompt_logprobs=prompt_logprobs)
