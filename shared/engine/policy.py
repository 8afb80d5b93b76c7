"""How the ranks of one instance take a step together: the only thing that differs between instance
shapes, so one engine loop (shared.engine.core) serves them all.

* `Solo` — one rank.
* `LockStep` — attention-DP ranks, each with its own requests; while any rank has work every rank
  steps (an idle one runs a dummy token), so the EP all-to-alls inside the model are always entered
  by all; decode steps of one shape on every rank pad to one size and may replay recorded steps.
* `Mirror` — local-TP ranks: every rank applies every command in the same order, so their schedulers,
  block tables and samplers stay identical; rank 0 alone answers and pushes.
* `ContextSplit` — CP prefill ranks: mirrored like TP, but each scheduled chunk is cut into zigzag
  pieces, one pair per rank; the layers all-gather the new KV and the chunk's logits are summed
  across ranks so every rank samples the same token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist

from shared.engine.graphs import DecodeGraphs, GraphKey
from shared.kvcache import KVCache, KVLayout
from shared.model import ForwardBatch, SeqChunk
from shared.model.cp import build_cp_batch, piece_logits, zigzag_ranges
from shared.parallel.state import ParallelState


class ForwardTarget(Protocol):
    """What a policy forwards through: an engine's model, cache and scratch block (an LLMEngine).
    A protocol, so the policy needs no engine import and the engine can import the policy."""

    model: torch.nn.Module
    kv: KVCache
    layout: KVLayout
    device: torch.device
    scratch_blocks: list[int] | None
    graphs: DecodeGraphs | None  # recorded decode steps (where the device has a backend; not on CP ranks)
    expand_from: int  # prompt chunks this long or longer take parts of their own (ForwardBatch.build)

    @property
    def workspace_bytes(self) -> int: ...


class Solo:
    """One rank: schedule, forward, sample."""

    mirror = False  # every rank applies every command (identical schedulers on all ranks)
    lockstep = False  # ranks step different batches: each must still run as many forwards as the others
    graphs_apply = True  # a step may replay a recorded one (every rank replays the same steps in the same order)

    def __init__(self, state: ParallelState):
        self.state = state

    @property
    def answers(self) -> bool:
        """This rank's events and replies are the instance's (rank 0 under mirroring)."""
        return True

    def wants_step(self, has_chunks: bool) -> bool:
        """Whether this rank forwards this turn (LockStep: also when another rank has work)."""
        return has_chunks

    def batch(self, engine: ForwardTarget, chunks: list[SeqChunk]) -> ForwardBatch:
        return ForwardBatch.build(chunks, engine.layout.block_size, engine.device, engine.workspace_bytes,
                                  expand_from=engine.expand_from)

    def logits(self, chunks: list[SeqChunk], logits: torch.Tensor) -> torch.Tensor:
        """The completing chunks' logits, the same on every rank that samples them."""
        return logits

    def forward_mtp(self, engine: ForwardTarget, chunks: list[SeqChunk], states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's forward (Model.forward_mtp) over `chunks` with their input states, replayed where the
        engine has a recording of it."""
        if engine.graphs is not None and self.graphs_apply:
            out = engine.graphs.forward(chunks, mtp_input=states)
            if out is not None:
                return out
        return engine.model.forward_mtp(self.batch(engine, chunks), engine.kv, states)

    def push_share(self, first: int, last: int) -> tuple[int, int]:
        """The part of a chunk's blocks [first, last) this rank sends to decode (prefill)."""
        return first, last

    def agree(self, ok: bool) -> bool:
        """Whether every rank of the instance says `ok` (one all-reduce; one rank: its own word)."""
        if not self.state.is_parallel:
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.state.world_group)
        return bool(flag.item())

    def hidden_rows(self, hidden: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
        """The MTP layer's inputs h_j: `rows` (indexes into the step's flat tokens) of the step's hidden states."""
        return hidden[torch.cat(rows).to(hidden.device)]

    def forward(self, engine: ForwardTarget, chunks: list[SeqChunk], layer_done: Callable[[int], None] | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits of the chunks that want them; with `return_hidden` also every token's post-norm state. A plain
        decode step of one rank replays a recorded step where the engine has them (shared.engine.graphs)."""
        if engine.graphs is not None and self.graphs_apply and layer_done is None:
            out = engine.graphs.forward(chunks, return_hidden)
            if out is not None:
                return out
        return self.eager_forward(engine, chunks, layer_done, return_hidden)

    def eager_forward(self, engine: ForwardTarget, chunks: list[SeqChunk],
                      layer_done: Callable[[int], None] | None = None, return_hidden: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The model's forward over the step as it is, every op run from Python."""
        out = engine.model(self.batch(engine, chunks), engine.kv, layer_done, return_hidden)
        if return_hidden:
            return self.logits(chunks, out[0]), out[1]
        return self.logits(chunks, out)


class LockStep(Solo):
    """Attention-DP: every rank has its own batch; all step while any has work. Where every rank's step is a decode
    step of the same tokens per request (a plain decode or an MTP verification of K drafts; an idle rank's dummy
    takes that shape), all pad to the largest rank's graph size and run it with the fixed-shape EP exchange,
    replayed where recorded (shared.engine.graphs); any other step, and the MTP layer's forwards, run eagerly."""

    lockstep = True

    def wants_step(self, has_chunks: bool) -> bool:
        flag = torch.tensor([int(has_chunks)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.state.world_group)
        return bool(flag.item())

    def forward(self, engine: ForwardTarget, chunks: list[SeqChunk], layer_done: Callable[[int], None] | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        key = self.common_key(engine, chunks, return_hidden, layer_done is None)
        if key is not None:
            return engine.graphs.padded_step(key, chunks)
        return self.eager_forward(engine, chunks, layer_done, return_hidden)

    def common_key(self, engine: ForwardTarget, chunks: list[SeqChunk], hidden: bool, usable: bool
                   ) -> GraphKey | None:
        """This rank's graph key at the size every rank pads this step to (one all-reduce), None where any rank's
        step is not a decode step a recording could take or the ranks' steps differ in tokens per request or in
        returning the hidden states (a plain decode: 1 token; an MTP verification: 1 + K and its states, an idle
        rank's dummy alike)."""
        if engine.graphs is None:
            return None
        key = engine.graphs.key(chunks, hidden, False) if usable else None
        each = key.each if key is not None else 0
        flag = torch.tensor([int(key is None), key.size if key else 0, each, -each, int(hidden), -int(hidden)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.state.world_group)
        if flag[0] or flag[2] != -flag[3] or flag[4] != -flag[5]:
            return None
        size = int(flag[1])
        return replace(key, size=size) if engine.graphs.exchange_fits(size * each, self.state.config.ep) else None

    def forward_mtp(self, engine: ForwardTarget, chunks: list[SeqChunk], states: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eagerly: the ranks' MTP forwards differ in count and shape (their EP exchange is the all-to-all-v)."""
        return engine.model.forward_mtp(self.batch(engine, chunks), engine.kv, states)


class Mirror(Solo):
    """Local TP: identical batches on every rank (the model's TP collectives need the same tokens)."""

    mirror = True

    @property
    def answers(self) -> bool:
        return self.state.rank == 0


    def push_share(self, first: int, last: int) -> tuple[int, int]:
        return (first, last) if self.state.rank == 0 else (first, first)  # the KV is identical everywhere


class ContextSplit(Mirror):
    """CP prefill: every chunk split zigzag over the ranks; each rank pushes a slice of its blocks."""

    graphs_apply = False  # each rank's batch is its own pieces

    def batch(self, engine: ForwardTarget, chunks: list[SeqChunk]) -> ForwardBatch:
        # a rank with no piece of the step runs a dummy token in the scratch block every parallel engine has
        return build_cp_batch(chunks, self.state.rank, self.state.config.cp, engine.layout.block_size,
                              engine.device, self.state.world_group, engine.scratch_blocks[0],
                              workspace_bytes=engine.workspace_bytes, expand_from=engine.expand_from)

    def logits(self, chunks: list[SeqChunk], logits: torch.Tensor) -> torch.Tensor:
        """Each wanted row lives on the rank that computed its token (a completing chunk's on the rank of
        its last token; a prompt-logprobs chunk's spread over all): placed at its row of the whole step
        and summed into every rank."""
        cp, rank = self.state.config.cp, self.state.rank
        mine: list[int] = []  # rows of the whole step this rank computed, in its logits' order
        row = 0
        for c in chunks:
            if not c.need_logits:
                continue
            first = len(c.token_ids) - c.num_logits  # the chunk's first wanted token
            for a, b in zigzag_ranges(len(c.token_ids), cp)[rank]:
                if (k := piece_logits(c, a, b)) > 0:
                    mine.extend(range(row + b - k - first, row + b - first))
            row += c.num_logits
        full = torch.zeros(row, logits.shape[-1], dtype=torch.float32, device=logits.device)
        if mine:
            full[torch.tensor(mine, device=logits.device)] = logits[: len(mine)].float()
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.state.world_group)
        return full

    def hidden_rows(self, hidden: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
        """A CP rank holds only its zigzag pieces' states, and the MTP batch over chunks of the same starts
        and lengths splits into the same pieces in the same order: the rows are all of them, as they are.
        (A prefill's MTP catch-up covers every chunk of the step, which this relies on.)"""
        return hidden

    def push_share(self, first: int, last: int) -> tuple[int, int]:
        """Every rank holds the whole KV after the gathers: rank r sends the r-th contiguous slice
        (rank 0 first, so it always has a push to commit)."""
        n, cp, r = last - first, self.state.config.cp, self.state.rank
        a = first + r * (n // cp) + min(r, n % cp)
        return a, a + n // cp + (1 if r < n % cp else 0)


def policy_for(state: ParallelState) -> Solo:
    """The step policy of this rank's instance shape: the one place the shape rules live (local TP
    means Mirror; services read `policy.mirror` instead of re-deriving it from the config)."""
    cfg = state.config
    if cfg.world == 1:
        return Solo(state)
    if cfg.cp > 1:
        return ContextSplit(state)
    if cfg.tp > 1:
        return Mirror(state)
    return LockStep(state)
