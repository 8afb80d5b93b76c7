"""Prefill across the ranks of one parallel prefill instance (context parallel, or local TP).

Rank 0 (the gRPC front) broadcasts one request at a time. Under CP every rank computes its zigzag
share of the prompt, the layers all-gather the new KV so attention and the indexer see the whole
prefix, and each rank pushes the blocks whose first token it computed, layer by layer, straight to
the decode lease. Under local TP every rank computes the whole prompt with its shards of o_proj /
lm_head / embedding and rank 0 alone pushes (the KV is identical on all ranks). When every rank's
writes are done (an all-gather of their outcomes), rank 0 commits; the rank holding the last prompt
token samples the first token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shared.engine import LLMEngine, SamplingParams
from shared.engine.sampler import sample
from shared.model import ForwardBatch, SeqChunk
from shared.parallel.cp import build_cp_batch, owned_blocks
from shared.transfer import Destination, KVSender, TransferError
from shared.transfer import make_sender as make_sender_

log = logging.getLogger("pdserve.prefill")
STOP = "stop"


@dataclass
class CPJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    dest: Destination


def _runs(blocks: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][-1] + 1 == b:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


class CPRank:
    """What every CP rank does for one request."""

    def __init__(self, engine: LLMEngine, make_sender: Callable[[str], KVSender] | None = None):
        self.engine = engine
        self.state = engine.parallel
        self.senders: dict[str, KVSender] = {}
        self._make = make_sender or (lambda transport: make_sender_(transport, engine.kv))
        self.scratch = engine.scratch_blocks[0] if engine.scratch_blocks else engine.kv.allocator.allocate(1)[0]

    def run(self, job: CPJob) -> tuple[int | None, bytes, str | None, Any]:
        """Returns (first token or None, rng state, error or None, the open push)."""
        engine, state = self.engine, self.state
        kv, bs, rank, cp = engine.kv, engine.layout.block_size, state.rank, state.config.cp
        table = kv.allocator.allocate(kv.blocks_needed(len(job.prompt)))
        push, token, rng, error = None, None, b"", None
        try:
            if cp > 1:
                runs = _runs(owned_blocks(len(job.prompt), rank, cp, bs))
                fb = build_cp_batch(job.prompt, table, rank, cp, bs, engine.device, state.world_group, self.scratch)
                fb.workspace_bytes = engine.workspace_bytes
            else:  # local TP: identical KV everywhere, rank 0 pushes it all
                runs = [list(range(len(table)))] if rank == 0 else []
                fb = ForwardBatch.build([SeqChunk(job.prompt, 0, table)], bs, engine.device, engine.workspace_bytes)
            if runs:
                if job.dest.transport not in self.senders:
                    self.senders[job.dest.transport] = self._make(job.dest.transport)
                push = self.senders[job.dest.transport].open(job.dest)

            def layer_done(layer: int) -> None:
                for run in runs:
                    push.send_layer(layer, [table[b] for b in run], run[0])

            logits = engine.model(fb, kv, layer_done)
            if logits.shape[0]:  # this rank computed the last prompt token
                gen = (torch.Generator().manual_seed(job.params.seed) if job.params.seed is not None
                       else engine.default_generator)
                token = sample(logits, [job.params], [gen])[0]
                rng = bytes(gen.get_state().numpy()) if job.params.seed is not None else b""
            if push is not None:
                push.finish(commit=False)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the outcome all-gather, or they diverge
            log.exception("CP rank %d failed request %s", rank, job.request_id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            kv.allocator.free(table)
        return token, rng, error, push

    def step(self, job: CPJob) -> tuple[int | None, bytes, str | None]:
        """Run the job on every rank together; afterwards all ranks agree on the outcome."""
        token, rng, error, push = self.run(job)
        outcomes: list[Any] = [None] * self.state.world
        dist.all_gather_object(outcomes, (token, rng, error))
        errors = [e for _, _, e in outcomes if e]
        first = next(((t, r) for t, r, _ in outcomes if t is not None), (None, b""))
        if push is not None:
            if not errors and self.state.rank == 0:
                try:
                    push.commit()
                except TransferError as exc:
                    errors.append(str(exc))
            else:
                push.close()
        return first[0], first[1], "; ".join(errors) or None


HEARTBEAT_SECONDS = 5.0  # an idle leader broadcasts this often, so followers never wait near the collective timeout


def follower_loop(me: CPRank) -> None:
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] == STOP:
            return
        if box[0] is not None:  # None: the leader's idle heartbeat
            me.step(box[0])


class CPLeader:
    """Rank 0: serializes requests into the CP group (one prompt per step, all ranks on it)."""

    def __init__(self, me: CPRank):
        self.me = me
        self._jobs: queue.Queue = queue.Queue()
        self._queued: dict[str, Future] = {}
        self._stop = False
        self.on_fatal: Callable[[str], None] | None = None  # set by the service: NOT_SERVING, then exit
        self._thread = threading.Thread(target=self._loop, name="cp-leader", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, dest: Destination) -> Future:
        self.me.engine.validate(prompt, params)  # ValueError → INVALID_ARGUMENT before any rank works
        fut: Future = Future()
        self._queued[request_id] = fut
        self._jobs.put((CPJob(request_id, prompt, params, dest), fut, time.perf_counter()))
        return fut

    def cancel(self, request_id: str, reason: BaseException) -> None:
        """Drop a request still waiting for the group (one already running finishes)."""
        fut = self._queued.pop(request_id, None)
        if fut is not None:
            fut.cancel()

    def stop(self) -> None:
        self._stop = True
        self._thread.join(10)

    def _loop(self) -> None:
        last, fut = time.monotonic(), None
        try:
            while not self._stop:
                try:
                    job, fut, t0 = self._jobs.get(timeout=0.2)
                except queue.Empty:
                    if time.monotonic() - last > HEARTBEAT_SECONDS:
                        dist.broadcast_object_list([None], src=0)
                        last = time.monotonic()
                    continue
                last = time.monotonic()
                self._queued.pop(job.request_id, None)
                if not fut.set_running_or_notify_cancel():
                    continue
                dist.broadcast_object_list([job], src=0)
                token, rng, error = self.me.step(job)
                if error or token is None:
                    fut.set_exception(TransferError(error or "no rank produced the first token"))
                else:
                    fut.set_result((token, rng, time.perf_counter() - t0, 0))  # no prefix cache under CP
        except Exception as exc:  # noqa: BLE001 - a collective failed or timed out: the group cannot go on
            log.exception("CP leader loop failed")
            if fut is not None and not fut.done():
                fut.set_exception(TransferError(f"prefill group failed: {exc}"))
            for queued in list(self._queued.values()):
                if queued.set_running_or_notify_cancel():
                    queued.set_exception(TransferError(f"prefill group failed: {exc}"))
            if self.on_fatal is not None:
                self.on_fatal(f"{type(exc).__name__}: {exc}")
        finally:
            try:
                dist.broadcast_object_list([STOP], src=0)
            except Exception:  # noqa: BLE001 - the group is already broken
                pass
