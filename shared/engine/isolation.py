"""A poison request fails alone: when a step's compute raises, the batch is bisected to the requests
that make it raise, the others' tokens go on as if nothing happened, and only those fail.

A compute that raises is undone for its requests (their logprobs and seeded generators put back; the
rest of a compute changes nothing a retry would see twice: shared.engine.step), then each half is
computed again, a half that raises is halved again, down to single requests. A single request that
still raises fails *alone* (a `RequestFault`: its caller must not retry it elsewhere, it would fail
there too) when the engine is shown to work: another part of the batch computed, or a probe forward
of one token does. If nothing computes, not even the probe, the engine itself is failing: its requests
fail as an engine error, which callers treat as the instance's (they may move the request). One bad
request among n costs about 2·log2(n) extra forwards, once; its neighbours keep their exact tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engine.scheduler import ScheduledChunk, Sequence
from shared.engine.step import Fault, StepEvent, StepObserver
from shared.kvcache import OutOfBlocks
from shared.model import SeqChunk

log = logging.getLogger("pdserve.engine")
REQUEST_FAULT = "request fault"  # how a RequestFault's message starts (the router does not migrate these)


class RequestFault(RuntimeError):
    """A request failed an engine step on its own while the engine kept serving the others: retrying
    it on another instance would fail the same way. Its message starts with REQUEST_FAULT."""

    @classmethod
    def of(cls, request_id: str, error: BaseException) -> RequestFault:
        return cls(f"{REQUEST_FAULT}: the engine step failed on request {request_id} alone "
                   f"({type(error).__name__}: {error}); the rest of its batch went on; not retried elsewhere")


@dataclass
class IsolatedStep:
    """What an isolating step did: the events of the requests that stepped, the requests it failed
    (aborted already, their blocks freed), and the extra computes the search took."""

    events: list[StepEvent] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    retries: int = 0


@dataclass
class _Saved:
    """What a compute may change of a request and a retry must see as before: its logprobs, and the
    state of its own generator (a seeded sampled request draws from it)."""

    seq: Sequence
    logprobs: int
    generator: torch.Tensor | None

    @classmethod
    def of(cls, seq: Sequence) -> _Saved:
        own = seq.params.seed is not None and not seq.params.greedy and seq.generator is not None
        return cls(seq, len(seq.logprobs), seq.generator.get_state() if own else None)

    def restore(self) -> None:
        del self.seq.logprobs[self.logprobs:]
        if self.generator is not None:
            self.seq.generator.set_state(self.generator)


def isolate(engine: Any, chunks: list[ScheduledChunk], observer: StepObserver | None = None) -> IsolatedStep:
    """Step `chunks` on `engine` (an LLMEngine of one rank) through its compute and commit phases,
    bisecting a compute that raises (module doc). A commit that raises is not retried: it raises here."""
    out = IsolatedStep()
    computed_any = False
    suspects: list[tuple[Sequence, BaseException]] = []
    parts = [chunks]
    while parts:
        part = parts.pop()
        saved = [_Saved.of(c.seq) for c in part]
        try:
            computed = engine.compute_chunks(part, observer)
        except Exception as exc:
            for s in saved:
                s.restore()
            if observer is not None:
                observer.retracted(part)
            if len(part) == 1:
                suspects.append((part[0].seq, exc))
            else:
                out.retries += 2
                half = len(part) // 2
                parts += [part[half:], part[:half]]  # the first half next
            continue
        computed_any = True
        done = engine.commit_chunks(computed, observer)
        out.events += done.events
        out.faults += done.faults
    for fault in out.faults:  # a token that could not be recorded: the engine works (it computed)
        fault.error = RequestFault.of(fault.seq.request_id, fault.error)
        engine.fail(fault.seq.request_id)
    if suspects:
        for seq, _ in suspects:  # aborted before the probe: their blocks are free for it
            engine.fail(seq.request_id)
        alone = computed_any or engine_works(engine)
        for seq, exc in suspects:
            log.error("step failed on request %s%s: %s", seq.request_id,
                      " alone" if alone else " (the engine fails every step)", exc)
            out.faults.append(Fault(seq, RequestFault.of(seq.request_id, exc) if alone else exc, alone))
    return out


def engine_works(engine: Any) -> bool:
    """A one-token forward into a block borrowed for it (and given back): whether the engine computes at all."""
    try:
        probe = engine.kv.ledger.borrow_probe()
    except OutOfBlocks:
        return False
    try:
        engine.policy.forward(engine, [SeqChunk([0], 0, list(probe.blocks))])
        return True
    except Exception as exc:
        log.error("the engine's probe forward failed: %s", exc)
        return False
    finally:
        engine.kv.ledger.return_probe(probe)
