"""What a prefill instance does on each rank, driven by the one engine-core loop (shared.engine.core).

Every shape runs the same scheduler (chunked prefill, several prompts per step, prefix cache) and
the same step; the step policy says how the ranks share it:
* one rank (`Solo`): each scheduled chunk's layers are pushed to the decode lease right after the
  layer is computed (the push thread overlaps the next layer); a finished push commits on its own
  thread and hands its blocks back to the engine by command;
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
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shared import metrics
from shared.engine import LLMEngine, SamplingParams
from shared.engine.core import ALL, Command, EngineCore, RankReport
from shared.engine.scheduler import ScheduledChunk, Sequence
from shared.kvcache.pool import PrefixFilter
from shared.transfer import Destination, KVPush, KVSender, TransferError

log = logging.getLogger("pdserve.prefill")

# first token, rng state, seconds, prompt tokens from the prefix cache, KV bytes this rank pushed
Result = tuple[int, bytes, float, int, int]
PREFIX_FILTER_SECONDS = 0.5  # how often the prefix-cache summary for the router is rebuilt


@dataclass
class _Job:
    dest: Destination
    started: float
    push: KVPush | None = None
    error: str | None = None  # this rank's push could not open (mirrored ranks fail the request at the end)
    prefix_sent: bool = False  # the blocks it got from the prefix cache went out with its first chunk


class PrefillRank:
    """One rank's prefill engine and KV pushes (a RankDriver)."""

    gathers = False  # mirrored ranks agree inside the step; rank 0's own outcome is the instance's

    def __init__(self, engine: LLMEngine, make_sender: Callable[[str], KVSender]):
        self.engine, self.policy = engine, engine.policy
        self.rank = engine.parallel.rank
        self.jobs: dict[str, _Job] = {}
        self.senders: dict[str, KVSender] = {}
        self._make = make_sender
        # Rank 0's front: the request's outcome (a Result or an exception), and a way to run a
        # command on the engine thread from a push thread (freeing blocks after an async push).
        self.on_done: Callable[[str, Result | BaseException], None] = lambda rid, outcome: None
        self.later: Callable[[str, dict[str, Any]], None] | None = None
        self.batch_tokens = 0  # tokens the last step computed (0: no step)

    # -- commands ------------------------------------------------------------------------------
    def apply(self, cmd: Command) -> Any:
        a = cmd.args
        if cmd.kind == "add":
            self._add(a["request_id"], a["prompt"], a["params"], a["dest"], a.get("priority", 0))
        elif cmd.kind == "abort":
            self._fail(a["request_id"], a.get("error") or RuntimeError("cancelled"))
        elif cmd.kind == "free":
            self.engine.kv.allocator.free(a["blocks"])
        return None

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination,
             priority: int = 0) -> None:
        engine = self.engine
        try:
            seq = engine.make_sequence(prompt, params, request_id, priority)  # validates against the real params
        except ValueError as exc:
            self.on_done(request_id, exc)
            return
        seq.params = dataclasses.replace(params, max_tokens=1)  # prefill ends at the first token
        need = engine.kv.blocks_needed(len(prompt))
        if len(dest.block_ids) < need:  # the same on every rank: all of them skip it
            engine.abort(request_id)
            self.on_done(request_id, TransferError(f"destination lease holds {len(dest.block_ids)} blocks, "
                                                   f"the prompt needs {need}"))
            return
        job = _Job(dest, time.perf_counter())
        if self.policy.answers:  # the rank that answers opens at once: a bad destination fails fast
            try:
                job.push = self._open(dest)
            except Exception as exc:  # noqa: BLE001
                self.on_done(request_id, exc if isinstance(exc, TransferError) else TransferError(str(exc)))
                if not self.policy.mirror:
                    engine.abort(request_id)
                    return
                # Mirrored ranks keep identical schedulers: it is scheduled here as everywhere this
                # turn, and dropped on every rank by the abort command of the next.
                job.error = f"{type(exc).__name__}: {exc}"
                if self.later is not None:
                    self.later("abort", {"request_id": request_id})
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

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[Any]:
        engine = self.engine
        chunks = engine.scheduler.schedule() if engine.has_work else []
        self.batch_tokens = sum(c.num_tokens for c in chunks)
        if not chunks:
            return []
        plan = [(self.jobs[c.seq.request_id], *self._plan(c)) for c in chunks]

        def layer_done(layer: int) -> None:
            for job, push, src, first in plan:
                if push is None or not src or job.error:
                    continue
                try:
                    push.send_layer(layer, src, first)
                except Exception as exc:  # noqa: BLE001 - this request fails at its end; the batch goes on
                    job.error = f"{type(exc).__name__}: {exc}"

        if self.policy.mirror:  # a failure inside the group's collectives cannot be contained
            self._complete_together([c.seq for c in chunks if c.completes], self._forward(chunks, layer_done))
            return []
        try:
            tokens = self._forward(chunks, layer_done)
        except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
            log.exception("prefill step failed")
            for c in chunks:
                self._fail(c.seq.request_id, exc)
            return []
        for seq, tok in zip([c.seq for c in chunks if c.completes], tokens):
            job = self.jobs.pop(seq.request_id)
            blocks, state, cached = self._finish_seq(seq, tok)
            if job.error:
                job.push.abort()
                engine.kv.allocator.free(blocks)
                self._answer(seq.request_id, job, tok, state, cached, TransferError(job.error))
                continue
            job.push.finish_async(functools.partial(self._pushed, seq.request_id, job, blocks, tok, state, cached))
        return []

    def _forward(self, chunks: list[ScheduledChunk], layer_done: Callable[[int], None]) -> list[int]:
        """The step's forward (KV pushed layer by layer); the completing chunks' first tokens."""
        if self.engine.speculator is not None:
            return self._step_with_mtp(chunks, layer_done)
        return self.engine.sample(chunks, self.engine.run_chunks(chunks, layer_done))

    def _step_with_mtp(self, chunks: list[ScheduledChunk], layer_done: Callable[[int], None]) -> list[int]:
        """Decode drafts with MTP: the MTP layer's cache over the prompt is computed here (each position
        j from its h_j and t_{j+1}, the last one's t_{j+1} being the first token) and pushed as one more
        layer, so decode's MTP attends to the whole prompt. Decode's first step runs without drafts; its
        hidden state starts the chain (no hidden state travels)."""
        engine = self.engine
        starts = [c.seq.num_cached for c in chunks]
        logits, hidden = engine.run_chunks(chunks, layer_done, return_hidden=True)
        tokens = engine.sample(chunks, logits)
        firsts = iter(tokens)
        entries, offset = [], 0
        for c, start in zip(chunks, starts, strict=True):
            entries.append((c.seq, start, offset, next(firsts) if c.completes else None))
            offset += c.num_tokens
        engine.speculator.catch_up(entries, hidden, draft=False)
        layer_done(engine.model_config.num_hidden_layers)  # the MTP layer's rows for these blocks
        return tokens

    def _plan(self, c: ScheduledChunk) -> tuple[KVPush | None, list[int], int]:
        """(push, source blocks, lease index of the first) this rank sends for a chunk: the blocks the
        chunk fills (a request's first chunk also the blocks it found in the prefix cache), or this
        rank's contiguous share of them.

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
        first, last = self.policy.push_share(first, last)
        if first >= last:
            return None, [], 0
        if job.push is None and job.error is None:
            try:
                job.push = self._open(job.dest)
            except Exception as exc:  # noqa: BLE001 - reported when the ranks agree on the outcome
                job.error = f"{type(exc).__name__}: {exc}"
        return job.push, c.seq.block_table[first:last], first

    def _finish_seq(self, seq: Sequence, token: int) -> tuple[list[int], bytes, int]:
        """Record the first token (max_tokens=1 ends the request); its blocks are the caller's to
        free once the push has read them."""
        blocks, seq.block_table = seq.block_table, []
        state = bytes(seq.generator.get_state().numpy()) if seq.params.seed is not None else b""
        self.engine.append_token(seq, token)
        return blocks, state, seq.num_cached_prompt_tokens

    def _pushed(self, request_id: str, job: _Job, blocks: list[int], token: int, state: bytes, cached: int,
                error: BaseException | None) -> None:
        """One rank, on the push's thread once it committed (the engine stepped on meanwhile): hand
        the blocks back to the engine thread, answer the caller."""
        if self.later is not None:
            self.later("free", {"blocks": blocks})
        self._answer(request_id, job, token, state, cached, error)

    def _complete_together(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Mirrored ranks: every rank finishes its pushes of the completed prompts, the ranks agree on
        the outcome, rank 0 commits and answers; the blocks are freed on every rank in the same order."""
        if not seqs:
            return
        failed = torch.zeros(len(seqs), dtype=torch.int64)
        jobs = [self.jobs.pop(s.request_id) for s in seqs]
        for i, job in enumerate(jobs):
            try:
                if job.error:
                    raise TransferError(job.error)
                if job.push is not None:
                    job.push.finish(commit=False)
            except Exception as exc:  # noqa: BLE001 - this rank's part failed: the request fails everywhere
                log.warning("rank %d: KV push of %s failed: %s", self.rank, seqs[i].request_id, exc)
                failed[i] = 1
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.engine.parallel.world_group)
        for seq, tok, job, bad in zip(seqs, tokens, jobs, failed.tolist()):
            blocks, state, cached = self._finish_seq(seq, tok)
            self.engine.kv.allocator.free(blocks)
            error: BaseException | None = TransferError("a rank of the prefill group could not push its KV") \
                if bad else None
            if job.push is not None:
                if self.policy.answers and error is None:
                    try:
                        job.push.commit()
                    except TransferError as exc:
                        error = exc
                job.push.close()
            if self.policy.answers:
                self._answer(seq.request_id, job, tok, state, cached, error)

    def _answer(self, request_id: str, job: _Job, token: int, state: bytes, cached: int,
                error: BaseException | None) -> None:
        if error is not None:
            self.on_done(request_id, error if isinstance(error, TransferError) else TransferError(str(error)))
            return
        pushed = job.push.bytes_sent if job.push else 0
        self.on_done(request_id, (token, state, time.perf_counter() - job.started, cached, pushed))

    def load(self) -> dict[str, Any]:
        sched, kv = self.engine.scheduler, self.engine.kv
        queued = sum(s.num_uncached for s in [*sched.waiting, *sched.running] if s.is_prefilling)
        return {"rank": self.rank, "running": len(sched.running), "waiting": len(sched.waiting),
                "free_blocks": kv.allocator.num_free, "total_blocks": kv.num_blocks, "queued_prompt_tokens": queued}

    def close(self) -> None:
        for rid in list(self.jobs):
            self._fail(rid, TransferError("the prefill instance stopped"))
        for sender in self.senders.values():
            sender.close()


class PrefillCore(EngineCore):
    """Rank 0: prompts in, Results out, for every shape. Runs in the prefill engine-core process
    (prefill_service.core), or in-process."""

    def __init__(self, rank: PrefillRank):
        super().__init__(rank, rank.engine.parallel, "prefill-engine")
        self.rank = rank
        self._results: dict[str, Future] = {}
        self.latest_load = rank.load()
        self._filter_built, self._filter_stale = 0.0, False
        # after every turn: (this instance's load, tokens the step computed or 0)
        self.on_report: Callable[[dict[str, Any], int], None] = self._record
        rank.on_done = self._done
        self._to = ALL if rank.policy.mirror else 0  # mirrored ranks all apply every command
        rank.later = lambda kind, args: self.submit(kind, self._to, **args)
        self.start()

    def load(self) -> dict[str, Any]:
        return self.latest_load

    def after_turn(self, reports: list[RankReport], step_seconds: float) -> None:
        super().after_turn(reports, step_seconds)
        self._filter_stale = True
        self.on_report(self._with_filter(dict(reports[0].load)), self.rank.batch_tokens)  # rank 0's turn report

    def idle(self) -> None:
        if self._filter_stale:  # the last turns' cache changes reach the router while idle too
            load = self._with_filter(self.rank.load())
            if "prefix_filter" in load:
                self.on_report(load, 0)

    def _with_filter(self, load: dict[str, Any]) -> dict[str, Any]:
        """Add the prefix-cache summary the router matches prompts against, at most every 0.5 s."""
        if time.monotonic() - self._filter_built > PREFIX_FILTER_SECONDS:
            self._filter_built, self._filter_stale = time.monotonic(), False
            kv = self.rank.engine.kv
            load["prefix_filter"] = PrefixFilter.build(kv.allocator.cached_hashes(), kv.num_blocks).bits
        return load

    def _record(self, load: dict[str, Any], batch_tokens: int) -> None:
        self.latest_load = {**self.latest_load, **load}  # the prefix filter comes with some reports only
        if batch_tokens:
            metrics.BATCH_TOKENS.observe(batch_tokens)

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination,
                priority: int = 0) -> Future:
        """Queue a prompt whose KV goes to `dest` (ahead of less urgent ones: lower `priority` first); the
        Future yields a Result, or fails with ValueError (bad request) or TransferError (bad destination,
        failed push). Raises ValueError at once for what can be checked here."""
        self.rank.engine.validate(prompt, params)
        if request_id in self._results:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        done: Future = Future()
        self._results[request_id] = done
        self.submit("add", self._to, request_id=request_id, prompt=prompt, params=params, dest=dest,
                    priority=priority)
        return done

    def cancel(self, request_id: str, reason: BaseException) -> None:
        """Drop a prompt (the caller went away); its blocks and push are released on every rank."""
        self.submit("abort", self._to, request_id=request_id, error=reason)

    def _done(self, request_id: str, outcome: Result | BaseException) -> None:
        fut = self._results.pop(request_id, None)
        if fut is None or fut.done():
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def on_failure(self, exc: BaseException) -> None:
        for rid in list(self._results):
            self._done(rid, RuntimeError(f"prefill engine failed: {exc}"))
