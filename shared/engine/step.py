"""The step body's vocabulary and its two phases' hand-over (LLMEngine.compute_chunks, commit_chunks).

A step computes (forward, then sample or verify) and commits (tokens appended, requests finished, the
MTP layer caught up, the observer told). The compute phase changes nothing a second try would see
twice: a request's logprobs, seeded generator and drafts are put back by whoever retries it
(shared.engine.isolation), its KV rows past `num_cached` are written again, and `num_cached` only
moves in the commit. So a compute that raises can be retried on part of the batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.engine.sampler import token_logprobs
from shared.engine.scheduler import ScheduledChunk, Sequence
from shared.engine.speculative import Draft
from shared.engine.structured import Grammars, MaskRow
from shared.model import SeqChunk
from shared.protocol.sampling import TokenLogprob

PROMPT_LOGPROBS_TILE = 64  # prompt rows log-softmaxed at once (each a vocabulary of fp32 values)
POISON_ENV = "PDSERVE_FAULT_POISON"  # fault injection for tests: "TOKEN[:AFTER],…" (see Poison)


@dataclass
class StepEvent:
    """What one step produced for one request: a new token (maybe the last). Text is made by the
    consumer (OutputProcessor), off the engine thread."""

    seq: Sequence
    token_id: int
    finished: bool
    logprob: TokenLogprob | None = None  # with params.logprobs


class StepObserver(Protocol):
    """What a service plugs into the engine's step body (a prefill: KV pushed layer by layer, an answer
    when a prompt completes). With an observer, a finished request's blocks stay until `finished` has
    seen them (the observer may take them: `seq.block_table = []`), and under MTP its MTP rows are
    computed too."""

    def scheduled(self, chunks: list[ScheduledChunk]) -> None:
        """Before the forward: this step's chunks (or, retrying a failed step, a part of them)."""

    def layer_done(self, layer: int) -> None:
        """Layer `layer`'s KV of this step's chunks is in their blocks (the MTP layer's last)."""

    def retracted(self, chunks: list[ScheduledChunk]) -> None:
        """The compute of these chunks raised and was undone: what `scheduled` planned for them is void
        (they are scheduled again at once, alone or in a smaller part, or failed)."""

    def finished(self, seqs: list[Sequence]) -> None:
        """Requests this step finished, their last token appended, before their blocks are freed."""


@dataclass
class Computed:
    """A compute phase's outcome, for its commit: per chunk its drafts, model input, first position, and
    (completing chunks only, in order) the tokens the step yields; the hidden states under MTP."""

    chunks: list[ScheduledChunk]
    drafts: list[Draft | None]
    batch: list[SeqChunk]
    starts: list[int]
    sampled: list[list[int]]
    hidden: torch.Tensor | None = None


@dataclass
class Fault:
    """A request a step failed. `alone`: it failed on its own while the engine works (a poison request:
    its caller should not retry it elsewhere); else the engine itself failed under it."""

    seq: Sequence
    error: BaseException
    alone: bool = True


@dataclass
class Committed:
    """A commit's events, and the requests whose tokens could not be recorded (each failed alone)."""

    events: list[StepEvent] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)


@dataclass(frozen=True)
class Poison:
    """Fault injection for tests: $PDSERVE_FAULT_POISON = "TOKEN[:AFTER],…" makes the compute of a step
    raise while it holds a request whose prompt contains TOKEN and that has at least AFTER outputs (0:
    from its prefill on; 1: from its first decode step). Off unless the variable is set."""

    rules: tuple[tuple[int, int], ...]

    @classmethod
    def from_env(cls) -> Poison | None:
        spec = os.environ.get(POISON_ENV, "")
        rules = [rule.partition(":") for rule in spec.split(",") if rule.strip()]
        return cls(tuple((int(token), int(after or 0)) for token, _, after in rules)) if rules else None

    def check(self, chunks: list[ScheduledChunk]) -> None:
        for c in chunks:
            seq = c.seq
            for token, after in self.rules:
                if len(seq.output_token_ids) >= after and token in seq.prompt_token_ids:
                    raise RuntimeError(f"injected fault: request {seq.request_id} holds poison token {token}")


def mask_verification(grammars: Grammars, chunks: list[ScheduledChunk], drafts: list[Draft | None],
                      logits: torch.Tensor) -> None:
    """Constrained requests' verification rows masked by their grammar, each draft row by the state after
    the drafts before it: a draft the grammar refuses is rejected, the output is constrained decoding's."""
    rows, row = [], 0
    for c, draft in zip(chunks, drafts, strict=True):
        if not c.completes:
            continue
        tokens = tuple(draft.tokens) if draft else ()
        if c.seq.grammar is not None:
            rows.append(MaskRow(c.seq.grammar, row, tokens))
        row += 1 + len(tokens)
    grammars.mask(logits, rows)


def note_logprobs(done: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> None:
    """The sampled tokens' logprobs of the requests that asked for them, kept on the request."""
    rows = [i for i, s in enumerate(done) if s.params.logprobs is not None]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        lps = token_logprobs(logits[index], [tokens[i] for i in rows], [done[i].params.logprobs for i in rows])
        for i, lp in zip(rows, lps, strict=True):
            done[i].logprobs.append(lp)


def note_prompt_logprobs(chunks: list[ScheduledChunk], batch: list[SeqChunk], logits: torch.Tensor) -> torch.Tensor:
    """Keep the prompt logprobs of the chunks that computed every token's logits (row j of a chunk from
    position s is token s + j + 1's distribution); the completing chunks' last rows, for sampling."""
    last_rows, row = [], 0
    for c, sc in zip(chunks, batch, strict=True):
        if not sc.need_logits:
            continue
        if sc.num_logits > 1:
            seq, start = c.seq, sc.start_pos
            known = len(seq.prompt_token_ids) - 1 - start  # rows whose next token is still in the prompt
            targets = seq.prompt_token_ids[start + 1 : start + 1 + min(known, sc.num_logits)]
            del seq.prompt_logprobs[start:]  # a recompute after preemption (or a retried step) writes them again
            for a in range(0, len(targets), PROMPT_LOGPROBS_TILE):  # log-softmax a tile of rows at a time
                part = targets[a : a + PROMPT_LOGPROBS_TILE]
                seq.prompt_logprobs += token_logprobs(logits[row + a : row + a + len(part)], part,
                                                      [seq.params.prompt_logprobs] * len(part))
        row += sc.num_logits
        if c.completes:
            last_rows.append(row - 1)
    return logits[torch.tensor(last_rows, dtype=torch.long, device=logits.device)]
