"""Structured outputs in the engine: each constrained request carries a grammar matcher; every step the
allowed-token bitmasks of all its constrained rows are computed together (llguidance's executor, in
Rust, off the GIL) and applied to the logits in place before sampling or speculative verification (on
the CPU at a cost that follows the tokens a row refuses or allows, whichever are fewer; measured by
bench/structured.py). A compiled constraint is cached per engine (a schema compiles once; each request
gets a copy of the compiled matcher), and a matcher advances by each token the request accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

# llguidance.numpy, not llguidance.torch: importing that one compiles a torch.compile kernel we do not use, which
# imports dynamo and inductor (2-3 s in every process that imports the engine)
import llguidance
import llguidance.numpy
import numpy as np
import torch

from shared.protocol.structured import ConstraintCompiler, StructuredOutput


@dataclass
class GrammarState:
    """One request's place in its constraint. `waiting_for`: thinking mode's `</think>` id until the
    reasoning ends (the constraint starts after it). `refused`: a token it does not allow was taken
    (never a token this engine sampled under the mask: a first token handed over by a disagreeing peer).
    What either means for the request is the engine's to say (shared.engine.llm)."""

    matcher: llguidance.LLMatcher
    waiting_for: int | None = None
    refused: bool = False

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def advance(self, token: int) -> bool:
        """Take a token the request accepted; whether the grammar is now complete and allows nothing
        more (a token it refuses sets `refused` instead)."""
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return False
        if not self.matcher.consume_token(token):
            self.refused = True
            return False
        return self.matcher.is_stopped()


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
        """Set every token a constrained row does not allow to the lowest finite logit, in place: one bitmask
        for the rows from the first constrained one to the last (unconstrained rows between them stay
        all-allowed), filled by the executor, then applied (`apply_bitmask`).

        The lowest finite value, not -inf, is what the sampler's sanitizing (`sample`, `probabilities`,
        `token_logprobs`: NaN → -inf, ±inf → the dtype's extremes) turns -inf into anyway: the tokens,
        probabilities and logprobs are the same, without sending every constrained step down its
        non-finite path (three more passes over [rows, vocab])."""
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
        lo = min(first for _, first, _ in jobs)
        hi = max(first + len(drafts) for _, first, drafts in jobs) + 1
        bitmask = torch.full(llguidance.numpy.get_bitmask_shape(hi - lo, self.compiler.vocab_size), -1,
                             dtype=torch.int32)
        words = bitmask.numpy()  # the same memory: llguidance writes the masks into it
        plain = [(m, first - lo) for m, first, drafts in jobs if not drafts]
        drafted = [(m, first - lo, drafts) for m, first, drafts in jobs if drafts]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, plain, words)
        if drafted:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, words)
        apply_bitmask(logits, bitmask, lo, refused_logit(logits.dtype))


def refused_logit(dtype: torch.dtype) -> float:
    """What a refused token's logit becomes: the lowest finite value of the logits' dtype."""
    return torch.finfo(dtype).min if dtype.is_floating_point else float("-inf")


# A row whose allowed (or refused) tokens lie in at most this share of its bitmask's 32-token words is
# masked sparsely, by their positions; rows in between by a dense masked fill.
SPARSE_WORDS = 0.25


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, start: int = 0, value: float = float("-inf")
                  ) -> None:
    """`value`, in place, at every token of logits rows `start`…`start + len(bitmask)` whose bit is clear in
    `bitmask` (int32 [rows, words], llguidance's layout: token t is bit t % 32 of word t // 32; bits past
    the logits' width are ignored).

    On the CPU the cost follows what changes, not rows × vocabulary: a row that refuses few tokens (inside
    a JSON string: most of the vocabulary is allowed) gets `value` at just those; a row that allows few (a
    key, a number, punctuation) is filled with `value` and its allowed logits put back; only rows with many of
    both go through a dense unpacked mask. The positions come from the nonzero words alone (numpy), and
    the rows are written through slices where contiguous. Elsewhere (an accelerator) the packed bitmask
    is copied over and unpacked there, in one in-place masked fill of the rows' slice."""
    if logits.device.type != "cpu" or not logits.is_contiguous():
        _apply_dense(logits, bitmask, start, value)
        return
    vocab, words = logits.shape[1], bitmask.numpy()
    refused = ~words
    n_words = words.shape[1]
    rows = np.arange(start, start + words.shape[0])
    with_refused = np.count_nonzero(refused, axis=1)
    with_allowed = np.count_nonzero(words, axis=1)
    limit = SPARSE_WORDS * n_words
    touched = with_refused > 0  # all-allowed rows (unconstrained ones between constrained) stay as they are
    few_refused = touched & (with_refused <= with_allowed) & (with_refused <= limit)
    few_allowed = touched & ~few_refused & (with_allowed <= limit)
    dense = touched & ~few_refused & ~few_allowed
    flat = logits.view(-1)
    if few_refused.any():
        flat[torch.from_numpy(_bit_positions(refused[few_refused], rows[few_refused], vocab))] = value
    if few_allowed.any():
        keep = torch.from_numpy(_bit_positions(words[few_allowed], rows[few_allowed], vocab))
        kept = flat[keep]
        _fill_rows(logits, rows[few_allowed], None, value)
        flat[keep] = kept
    if dense.any():
        refuse = np.unpackbits(refused[dense].view(np.uint8), axis=-1, count=vocab, bitorder="little")
        _fill_rows(logits, rows[dense], torch.from_numpy(refuse.view(np.bool_)), value)


def _bit_positions(words: np.ndarray, rows: np.ndarray, vocab: int) -> np.ndarray:
    """Flat logits positions (row * vocab + token) of the set bits of `words` [k, W] int32, whose row i is
    logits row `rows[i]`; tokens past `vocab` dropped."""
    n_words = words.shape[1]
    nonzero = np.flatnonzero(words)
    bits = np.unpackbits(words.reshape(-1)[nonzero].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    word, bit = np.nonzero(bits)
    nonzero = nonzero[word]
    token = (nonzero % n_words) * 32 + bit
    positions = rows[nonzero // n_words] * vocab + token
    return positions[token < vocab] if n_words * 32 > vocab else positions


def _fill_rows(logits: torch.Tensor, rows: np.ndarray, where: torch.Tensor | None, value: float) -> None:
    """`value` over logits rows `rows` (ascending), everywhere or where `where` [len(rows), vocab] is set."""
    if rows[-1] - rows[0] + 1 == len(rows):
        part = logits[int(rows[0]) : int(rows[-1]) + 1]
        if where is None:
            part.fill_(value)
        else:
            part.masked_fill_(where, value)
        return
    index = torch.from_numpy(rows)
    if where is None:
        logits.index_fill_(0, index, value)
    else:
        logits[index] = logits[index].masked_fill_(where, value)


def _apply_dense(logits: torch.Tensor, bitmask: torch.Tensor, start: int, value: float) -> None:
    """`apply_bitmask` by unpacking the whole bitmask on the logits' device (one in-place masked fill)."""
    n, vocab = bitmask.shape[0], logits.shape[1]
    words = bitmask.to(logits.device, non_blocking=True)  # pinned where CUDA is: the copy overlaps
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    refuse = ((words.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab] == 0
    logits[start : start + n].masked_fill_(refuse, value)
