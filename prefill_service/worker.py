"""What a prefill instance does on each rank (`PrefillWorker`, a RankDriver of the one engine-core loop,
shared.engine.core), and the commands and reports that cross its seams.

The worker plugs into the engine's one step body (shared.engine.llm.LLMEngine.step_chunks) as its
StepObserver: it plans each scheduled chunk's push, pushes every layer right after the layer is
computed (the push thread overlaps the next layer; under MTP the MTP layer's rows follow), and answers
when a prompt completes. The step policy says how the ranks share it:
* one rank (`Solo`): a finished push commits on its own thread and hands its blocks back to the engine
  by command; a prompt that makes the step raise fails alone, the others' chunks are computed again
  without it (shared.engine.isolation; their planned pushes are retracted and planned again);
* local TP (`Mirror`): every rank schedules and computes the same chunks; rank 0 pushes and answers;
* context parallel (`ContextSplit`): every rank schedules the same chunks and computes its zigzag
  pieces of each; the layers all-gather the new KV, so each rank pushes a contiguous share of the
  chunk's blocks; when a prompt completes, every rank finishes its pushes, the ranks agree on the
  outcome (one all-reduce) and rank 0 commits and answers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from prefill_service.fetch import FETCH_COMMANDS, FetchEndpoint, FetchEnds
from shared.config import PrefillConfig
from shared.engine import LLMEngine, SamplingParams
from shared.engine.core import EngineCommand, RankCommand
from shared.engine.scheduler import ScheduledChunk, Sequence
from shared.kvcache import Holder
from shared.kvcache.tier import totals as tier_totals
from shared.protocol.load import RankLoad
from shared.protocol.sampling import TokenLogprob
from shared.rpc.service import Credentials
from shared.transfer import Destination, KVPush, KVSender, TransferError, make_sender

log = logging.getLogger("pdserve.prefill")


# -- commands -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddPrompt(EngineCommand):
    """Prefill a prompt whose KV goes to `dest` (lower `priority` first)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    dest: Destination
    priority: int = 0
    num_resumed: int = 0  # a migrated request's earlier outputs end the prompt (LLMEngine.make_sequence)
    cache_salt: str = ""  # the tenant's prefix-cache namespace (the Sequence's keys chain from it)


@dataclass(frozen=True)
class DropPrompt(EngineCommand):
    """Drop a prompt (the caller went away, or its push could not open): its blocks and push are released."""

    request_id: str
    error: BaseException | None = None


@dataclass(frozen=True)
class FreeBlocks(EngineCommand):
    """Hand back the blocks a finished push read: pushes commit on their own threads, the engine thread
    gives their blocks back (shared.kvcache.ledger)."""

    hold: Holder  # the push's hold on its blocks


# -- what the worker reports ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillResult:
    """A prompt prefilled and its KV pushed: what the gRPC answer carries."""

    first_token: int
    rng_state: bytes  # the seeded generator's state after the first token (decode continues from it)
    seconds: float
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache
    pushed_bytes: int  # KV bytes this rank pushed
    first_logprob: TokenLogprob | None = None  # with params.logprobs
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., with params.prompt_logprobs
    host_cached_prompt_tokens: int = 0  # of cached_prompt_tokens, read back from the second KV tier


# what /metrics exports of a prefill rank's load (shared.metrics.LoadCollector): a prefill holds no leases;
# its second KV tier's totals are counters
PREFILL_GAUGES = ("rank", "running", "waiting", "free_blocks", "total_blocks", "queued_prompt_tokens",
                  "tier_written_bytes", "tier_read_bytes", "tier_dropped_corrupt", "tier_dropped_full")


def prefill_gauges(load: RankLoad) -> dict[str, int]:
    return {name: getattr(load, name) for name in PREFILL_GAUGES}


PrefillOutcome = PrefillResult | BaseException  # what a prompt's caller gets: a result, or why not


# -- the worker's own bookkeeping -----------------------------------------------------------------------
@dataclass
class _Job:
    dest: Destination
    started: float
    push: KVPush | None = None
    error: str | None = None  # this rank's push could not open (mirrored ranks fail the request at the end)
    prefix_sent: bool = False  # the blocks it got from the prefix cache went out with its first chunk


@dataclass
class ChunkPush:
    """What this rank sends of one scheduled chunk: `src_blocks` to the lease's blocks from index `first`."""

    job: _Job
    push: KVPush | None
    src_blocks: list[int]
    first: int


@dataclass
class Completion:
    """A prompt the step completed: its first token, and its blocks, now held by its push (`hold`) until
    the push ends."""

    seq: Sequence
    job: _Job
    token: int
    hold: Holder
    rng_state: bytes
    cached_prompt_tokens: int


def sender_factory(cfg: PrefillConfig, engine: LLMEngine) -> Callable[[str], KVSender]:
    """How this instance opens KV pushes (TLS and the advertised host from its flags)."""
    tls = Credentials.of(cfg).ssl_context(server=False)
    return lambda transport: make_sender(transport, engine.kv, cfg.public_host, cfg.mooncake_protocol, tls,
                                         cfg.kv_stall_seconds, cfg.mooncake_devices)


class PrefillWorker:
    """One rank's prefill engine and KV pushes (a RankDriver, and its engine's StepObserver).

    `on_done` (rank 0) gets each prompt's outcome; `later` (rank 0) queues a command for the engine
    thread from a push thread (freeing blocks after an async push)."""

    gathers = False  # mirrored ranks agree inside the step; rank 0's own outcome is the instance's

    def __init__(self, engine: LLMEngine, make_sender: Callable[[str], KVSender],
                 on_done: Callable[[str, PrefillOutcome], None] = lambda rid, outcome: None,
                 later: Callable[[EngineCommand], None] | None = None, fetch: FetchEndpoint | None = None):
        self.engine, self.policy = engine, engine.policy
        self.rank = engine.parallel.rank
        self.jobs: dict[str, _Job] = {}
        self.senders: dict[str, KVSender] = {}
        self._make = make_sender
        self.on_done = on_done
        self.later = later
        self.batch_tokens = 0  # tokens the last step computed (0: no step)
        self._scheduled: dict[str, ScheduledChunk] = {}  # this step's chunks by request id
        self._prefix_planned: dict[str, bool] = {}  # the last planned chunks' jobs' prefix_sent before planning
        self._pushes: list[ChunkPush] = []
        # cross-instance fetch (prefill_service.fetch): a one-rank instance's pool only
        self.fetch = FetchEnds(engine, fetch if not engine.parallel.is_parallel else None, self._open, later, on_done)

    # -- commands ------------------------------------------------------------------------------
    def apply(self, cmd: RankCommand) -> object:
        c = cmd.command
        if isinstance(c, FETCH_COMMANDS):
            return self.fetch.apply(c)
        if isinstance(c, AddPrompt):
            self._add(c)
        elif isinstance(c, DropPrompt):
            self._fail(c.request_id, c.error or RuntimeError("cancelled"))
        elif isinstance(c, FreeBlocks):
            self.engine.kv.ledger.end_push(c.hold)
        return None

    def _add(self, c: AddPrompt) -> None:
        engine, request_id = self.engine, c.request_id
        try:
            seq = engine.make_sequence(c.prompt, c.params, request_id, c.priority, c.num_resumed,
                                       c.cache_salt)  # the front validated
        except ValueError as exc:
            self.on_done(request_id, exc)
            return
        seq.params = dataclasses.replace(c.params, max_tokens=1)  # prefill ends at the first token
        need = engine.kv.blocks_needed(len(c.prompt))
        if len(c.dest.block_ids) < need:  # the same on every rank: all of them skip it
            engine.abort(request_id)
            self.on_done(request_id, TransferError(f"destination lease holds {len(c.dest.block_ids)} blocks, "
                                                   f"the prompt needs {need}"))
            return
        job = _Job(c.dest, time.perf_counter())
        if self.policy.answers:  # the rank that answers opens at once: a bad destination fails fast
            try:
                job.push = self._open(c.dest)
            except Exception as exc:  # this request fails at its end; the batch goes on
                self.on_done(request_id, exc if isinstance(exc, TransferError) else TransferError(str(exc)))
                if not self.policy.mirror:
                    engine.abort(request_id)
                    return
                # Mirrored ranks keep identical schedulers: it is scheduled here as everywhere this
                # turn, and dropped on every rank by the drop command of the next.
                job.error = f"{type(exc).__name__}: {exc}"
                if self.later is not None:
                    self.later(DropPrompt(request_id))
        self.jobs[request_id] = job
        engine.scheduler.add(seq)

    def _open(self, dest: Destination) -> KVPush:
        if dest.transport not in self.senders:
            self.senders[dest.transport] = self._make(dest.transport)
        return self.senders[dest.transport].open(dest)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        job = self.jobs.pop(request_id, None)
        self.engine.abort(request_id)
        if job is not None:
            if job.push is not None:
                job.push.abort()  # does not wait: the push thread lets go by itself
            self.on_done(request_id, exc)

    # -- the step: the engine's, observed ---------------------------------------------------------
    def step(self) -> list[Any]:
        self.engine.kv.ledger.settle()  # every step, busy or idle (a parallel rank's dummy one too)
        self.fetch.expire()
        self.batch_tokens, self._scheduled = 0, {}
        if self.policy.mirror:  # a failure inside the group's collectives cannot be contained
            self.engine.step(self)
            return []
        try:  # a prompt that makes the step raise fails alone (shared.engine.isolation)
            done = self.engine.step_isolated(self)
        except Exception as exc:  # a commit that raised: fail these requests, keep serving
            log.exception("prefill step failed")
            for rid in list(self._scheduled):
                self._fail(rid, exc)
            return []
        for fault in done.faults:  # aborted by the engine: their pushes and callers are let go here
            self._fail(fault.seq.request_id, fault.error)
        return []

    def scheduled(self, chunks: list[ScheduledChunk]) -> None:
        """Plan the chunks' pushes (a retried step plans a part of its chunks again: `retracted`)."""
        self._scheduled.update((c.seq.request_id, c) for c in chunks)
        self.batch_tokens += sum(c.num_tokens for c in chunks)
        self._prefix_planned = {c.seq.request_id: self.jobs[c.seq.request_id].prefix_sent for c in chunks}
        self._pushes = [self._plan(c) for c in chunks]

    def retracted(self, chunks: list[ScheduledChunk]) -> None:
        """Their compute raised: a retry sends their layers again, prefix blocks included."""
        self.batch_tokens -= sum(c.num_tokens for c in chunks)
        for rid, sent in self._prefix_planned.items():
            if rid in self.jobs:
                self.jobs[rid].prefix_sent = sent
        self._pushes = []

    def layer_done(self, layer: int) -> None:
        for p in self._pushes:
            if p.push is None or not p.src_blocks or p.job.error:
                continue
            try:
                p.push.send_layer(layer, p.src_blocks, p.first)
            except Exception as exc:  # this request fails at its end; the batch goes on
                p.job.error = f"{type(exc).__name__}: {exc}"

    def finished(self, seqs: list[Sequence]) -> None:
        """Prompts completed (max_tokens=1 ends each at its first token): finish their pushes and answer."""
        done = [self._take(seq) for seq in seqs]
        if self.policy.mirror:
            self._complete_together(done)
            return
        for d in done:
            if d.job.error:
                d.job.push.abort()
                self.engine.kv.ledger.end_push(d.hold)
                self._answer(d, TransferError(d.job.error))
                continue
            d.job.push.finish_async(functools.partial(self._pushed, d))

    def _plan(self, c: ScheduledChunk) -> ChunkPush:
        """What this rank sends for a chunk: the blocks the chunk fills (a request's first chunk also the
        blocks it found in the prefix cache), or this rank's contiguous share of them.

        A block travels once, when all its rows are final: a chunk that ends inside a block leaves it
        to the chunk that fills it (the prompt's last chunk sends its partial last block). Sending it
        twice would be a race under CP, where consecutive chunks may give the block to different
        ranks: their connections do not order their writes, so the early copy (rows not yet
        computed) could land after the full one."""
        job = self.jobs[c.seq.request_id]
        bs = self.engine.layout.block_size
        start, end = c.seq.num_cached, c.seq.num_cached + c.num_tokens
        first, last = start // bs, (-(-end // bs) if c.completes else end // bs)
        if not job.prefix_sent:
            first, job.prefix_sent = 0, True
        first = max(first, job.dest.reused_blocks)  # decode holds those already (its prefix cache)
        first, last = self.policy.push_share(first, last)
        if first >= last:
            return ChunkPush(job, None, [], 0)
        if job.push is None and job.error is None:
            try:
                job.push = self._open(job.dest)
            except Exception as exc:  # this request fails at its end; the batch goes on
                job.error = f"{type(exc).__name__}: {exc}"
        return ChunkPush(job, job.push, c.seq.block_table[first:last], first)

    def _take(self, seq: Sequence) -> Completion:
        """A completed prompt's first token, and its blocks handed to its push (the engine frees none of
        them: the push's end gives them back)."""
        hold = self.engine.kv.ledger.hand_to_push(seq)
        state = bytes(seq.generator.get_state().numpy()) if seq.params.seed is not None else b""
        return Completion(seq, self.jobs.pop(seq.request_id), seq.output_token_ids[-1], hold, state,
                          seq.num_cached_prompt_tokens)

    def _pushed(self, done: Completion, error: BaseException | None) -> None:
        """One rank, on the push's thread once it committed (the engine stepped on meanwhile): hand
        the blocks back to the engine thread, answer the caller."""
        if self.later is not None:
            self.later(FreeBlocks(done.hold))
        self._answer(done, error)

    def _complete_together(self, done: list[Completion]) -> None:
        """Mirrored ranks: every rank finishes its pushes of the completed prompts, the ranks agree on
        the outcome, rank 0 commits and answers; the blocks are freed on every rank in the same order."""
        failed = torch.zeros(len(done), dtype=torch.int64)
        for i, d in enumerate(done):
            try:
                if d.job.error:
                    raise TransferError(d.job.error)
                if d.job.push is not None:
                    d.job.push.finish(commit=False)
            except Exception as exc:  # this request fails at its end; the batch goes on
                log.warning("rank %d: KV push of %s failed: %s", self.rank, d.seq.request_id, exc)
                failed[i] = 1
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.engine.parallel.world_group)
        for d, bad in zip(done, failed.tolist()):
            self.engine.kv.ledger.end_push(d.hold)
            error: BaseException | None = TransferError("a rank of the prefill group could not push its KV") \
                if bad else None
            if d.job.push is not None:
                if self.policy.answers and error is None:
                    try:
                        d.job.push.commit()
                    except TransferError as exc:
                        error = exc
                d.job.push.close()
            if self.policy.answers:
                self._answer(d, error)

    def _answer(self, done: Completion, error: BaseException | None) -> None:
        rid = done.seq.request_id
        if error is not None:
            self.on_done(rid, error if isinstance(error, TransferError) else TransferError(str(error)))
            return
        pushed = done.job.push.bytes_sent if done.job.push else 0
        self.on_done(rid, PrefillResult(done.token, done.rng_state, time.perf_counter() - done.job.started,
                                        done.cached_prompt_tokens, pushed,
                                        done.seq.logprobs[0] if done.seq.logprobs else None,
                                        done.seq.prompt_logprobs,
                                        host_cached_prompt_tokens=done.seq.num_host_cached_prompt_tokens))

    def load(self) -> RankLoad:
        sched, kv = self.engine.scheduler, self.engine.kv
        queued = sum(s.num_uncached for s in [*sched.waiting, *sched.running] if s.is_prefilling)
        tier = tier_totals(kv.tier)  # exported by the front (shared.metrics.LoadCollector)
        return RankLoad(self.rank, len(sched.running), len(sched.waiting), kv.allocator.num_free,
                        self.engine.usable_blocks, queued_prompt_tokens=queued, tier_written_bytes=tier.written_bytes,
                        tier_read_bytes=tier.read_bytes, tier_dropped_corrupt=tier.dropped_corrupt,
                        tier_dropped_full=tier.dropped_full)

    def close(self) -> None:
        self.fetch.close()
        for rid in list(self.jobs):
            self._fail(rid, TransferError("the prefill instance stopped"))
        for sender in self.senders.values():
            sender.close()
