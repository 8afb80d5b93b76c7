"""Structured outputs in the engine: each constrained request carries a grammar matcher; every step the
allowed-token bitmasks of all its constrained rows are computed together (llguidance's executor, in
Rust, off the GIL) and applied to the logits in one masked fill before sampling or speculative
verification. A compiled constraint is cached per engine (a schema compiles once; each request gets a
copy of the compiled matcher), and a matcher advances by each token the request accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import llguidance.torch
import torch

from shared.protocol.structured import ConstraintCompiler, StructuredOutput


@dataclass
class GrammarState:
    """One request's place in its constraint. `waiting_for`: thinking mode's `</think>` id until the
    reasoning ends (the constraint starts after it)."""

    matcher: llguidance.LLMatcher
    waiting_for: int | None = None

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def advance(self, token: int) -> str | None:
        """Take a token the request accepted; a finish reason when the constraint ends it: `stop` when
        the grammar is complete and allows nothing more, `abort` for a token it refuses (never a token
        this engine sampled under the mask: a first token handed over by a disagreeing peer)."""
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return None
        if not self.matcher.consume_token(token):
            return "abort"
        return "stop" if self.matcher.is_stopped() else None


@dataclass(frozen=True)
class MaskRow:
    """Rows of a step's logits one constrained request samples from: `first`, then one per draft token
    (MTP verification: row i is the distribution after the drafts before it)."""

    state: GrammarState
    first: int
    drafts: tuple[int, ...] = ()


class Grammars:
    """The engine's constraints: compiled once each (shared.protocol.structured), masked in batches."""

    def __init__(self, compiler: ConstraintCompiler, reasoning_end: int | None):
        self.compiler, self.reasoning_end = compiler, reasoning_end
        self.executor = llguidance.LLExecutor()

    def start(self, constraint: StructuredOutput) -> GrammarState:
        """A request's state at the start of its constraint (ValueError naming the field if it is bad)."""
        if constraint.after_reasoning and self.reasoning_end is None:
            raise ValueError("structured_output.after_reasoning: this model's tokenizer has no </think> token")
        return GrammarState(self.compiler.matcher(constraint), self.reasoning_end if constraint.after_reasoning
                            else None)

    @torch.inference_mode()  # the logits are an inference tensor
    def mask(self, logits: torch.Tensor, rows: list[MaskRow]) -> None:
        """Set every token a constrained row does not allow to -inf, in place: one bitmask for all rows,
        filled by the executor, unpacked and applied in one masked fill."""
        jobs = []
        for r in rows:
            state, first, drafts = r.state, r.first, list(r.drafts)
            if not state.active:  # reasoning: free until `</think>`, constrained after it (a draft may hold it)
                if state.waiting_for not in drafts:
                    continue
                skip = drafts.index(state.waiting_for) + 1
                first, drafts = first + skip, drafts[skip:]
            jobs.append((state.matcher, first, drafts))
        if not jobs:
            return
        bitmask = llguidance.torch.allocate_token_bitmask(logits.shape[0], self.compiler.vocab_size)
        plain = [(m, first) for m, first, drafts in jobs if not drafts]
        drafted = [job for job in jobs if job[2]]
        if plain:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, plain, bitmask)
        if drafted:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, bitmask)
        index = torch.tensor(sorted({first + i for _, first, drafts in jobs for i in range(len(drafts) + 1)}))
        bits = bitmask[index]
        allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(len(index), -1)
        allowed = allowed[:, : logits.shape[1]]
        logits[index.to(logits.device)] = logits[index.to(logits.device)].masked_fill(~allowed.to(logits.device),
                                                                                      float("-inf"))
