"""Per-step batch metadata shared by every layer's attention.

A step is a flat run of new tokens from R requests (request-major, each request's tokens contiguous
and in position order). Attention works on a padded [R, S_max] view of the queries against the
request's cached context, read from the paged pool through per-request block tables in tiles
(shared.model.attention). Nothing here grows with R × S × T: visibility masks are made per tile.
Everything here is computed once per step, not once per layer.
"""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass

import torch

from shared.parallel.comm import gather_varlen


@dataclass
class SeqChunk:
    """One request's part of a step: new tokens at positions start_pos.. and its block table."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool = True
    num_logits: int = 1  # with need_logits: the last this many tokens' logits (speculative verification)
    generated: bool = False  # every token is past the prompt (decode, verification, drafts): see ForwardBatch


@dataclass
class CPGather:
    """Context-parallel step: this rank computed some of a prompt's tokens; every layer all-gathers the
    new KV rows of all ranks (`sizes` per rank, rank order) and writes them at `slots`, so attention and
    the indexer see the whole causal prefix."""

    group: object
    sizes: list[int]
    slots: torch.Tensor  # [sum(sizes)] long
    local_rows: int  # rows of this step that are real (0 on a rank that only runs a dummy token)


DEFAULT_WORKSPACE_BYTES = 256 << 20  # attention / indexer working set per tile (see shared.model.attention)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long, absolute positions
    slot_mapping: torch.Tensor  # [N] long, flat pool slot where each new token's KV is written
    token_request: torch.Tensor  # [N] long, the request row of each new token
    query_index: torch.Tensor  # [R, S_max] long, flat token index (padding → 0)
    query_valid: torch.Tensor  # [R, S_max] bool
    query_pos: torch.Tensor  # [R, S_max] long, absolute position of each query (padding → 0: sees key 0 only)
    block_tables: torch.Tensor  # [R, T_pad / block_size] long (padding → block 0)
    context_lens: torch.Tensor  # [R] long, tokens in cache after this step
    logits_index: torch.Tensor  # [M] long, flat tokens whose next-token logits are wanted
    block_size: int
    max_context: int
    is_decode: bool  # every request has exactly one new token
    uniform: bool  # every request has the same number of new tokens: [R, S_max] is a plain view
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    cp: CPGather | None = None
    parts: list[tuple[slice, ForwardBatch]] | None = None  # mixed steps: see attention_parts()
    # Leading flat tokens that belong to generated chunks (decodes come first in a step). Only those
    # take the CPU kernels whose results could differ from the portable path's (shared.model.ops): a
    # prompt token is computed alike however it is chunked, and a generated token however it is batched.
    generated: int = 0
    # Leading rows of the logits selection (x[logits_index]) that are generated tokens: the wanted rows of
    # the leading generated chunks (a decode's one, a verification's 1 + drafts), whatever follows them.
    logits_generated: int = 0

    def attention_parts(self) -> list[tuple[slice, ForwardBatch]]:
        """(flat token range, batch) pairs that attention and the indexer run on: the whole step, or
        for a mixed step (decodes + prompt chunks) runs of requests with similar query counts, so a
        decode is never padded to a chunk's length (the padded view would be R × S_max)."""
        return self.parts or [(slice(0, self.num_tokens), self)]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """Flat per-token tensor [N, ...] → [R, S_max, ...] (a view when uniform)."""
        if self.uniform:
            return x.view(*self.query_index.shape, *x.shape[1:])
        return x[self.query_index]

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """[R, S_max, ...] → flat [N, ...], dropping padding."""
        if self.uniform:
            return x.reshape(-1, *x.shape[2:])
        return x[self.query_valid]

    @functools.cached_property
    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per padded query (flat [R·S_max]): its request row, and how many context positions it sees
        (position + 1): the fused CPU attention's inputs, made once per step for every layer."""
        r, s = self.query_pos.shape
        return (torch.arange(r, device=self.query_pos.device).repeat_interleave(s), (self.query_pos + 1).view(-1))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_context(self) -> int:
        """T_pad: the key axis of a gathered context (whole blocks)."""
        return self.block_tables.shape[1] * self.block_size

    def visible(self, rows: slice, queries: slice, t0: int, t1: int) -> torch.Tensor:
        """Causal visibility [r, s, t1 - t0] of keys t0..t1 to the queries of a tile (key t ≤ query position)."""
        t = torch.arange(t0, t1, device=self.query_pos.device)
        return t <= self.query_pos[rows, queries, None]

    def slots_of(self, token_rows: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Flat pool slots of context positions `key_positions` [n, k] of the requests `token_rows` [n]."""
        blocks = self.block_tables[token_rows[:, None], key_positions // self.block_size]
        return blocks * self.block_size + key_positions % self.block_size

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, device: torch.device,
              workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, split: bool = True,
              expand_from: int | None = None) -> ForwardBatch:
        """The step's metadata. `expand_from` (shared.model.attention.expand_from): prompt chunks of at least
        this many tokens and shorter ones go in separate parts, so each takes its own attention form."""
        if not chunks:
            raise ValueError("a step needs at least one request")
        lens = [len(c.token_ids) for c in chunks]
        if min(lens) <= 0:
            raise ValueError("every request in a step needs at least one new token")
        num_seqs, s_max = len(chunks), max(lens)
        ctx = [c.start_pos + n for c, n in zip(chunks, lens)]
        t_max = max(ctx)
        for c, total in zip(chunks, ctx):
            if len(c.block_table) * block_size < total:
                raise ValueError(f"block table holds {len(c.block_table) * block_size} tokens, need {total}")
        # The key axis is padded to whole blocks so the context is gathered block by block.
        n_blocks = -(-t_max // block_size)

        tables = torch.tensor([c.block_table[:n_blocks] + [0] * (n_blocks - len(c.block_table[:n_blocks]))
                               for c in chunks], dtype=torch.long)  # one tensor for the whole step
        ctx_t = torch.tensor(ctx, dtype=torch.long)
        uniform = min(lens) == s_max
        # the same tensors; decode's in fewer ops, a few-token step's (MTP verification, catch-up) from host lists
        indices = _decode_indices if s_max == 1 else _host_indices if len(lens) * s_max <= 1024 else _chunk_indices
        positions, slot_mapping, token_request, query_index, query_valid, query_pos = indices(chunks, lens, tables,
                                                                                             block_size)
        ends = itertools.accumulate(lens)  # host-side: no per-request tensor indexing
        logits_index = [i for end, c in zip(ends, chunks) if c.need_logits for i in range(end - c.num_logits, end)]
        input_ids = torch.tensor([tok for c in chunks for tok in c.token_ids], dtype=torch.long)

        def dev(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=True)

        leading = list(itertools.takewhile(lambda c: c.generated, chunks))  # a step lists generated chunks first
        generated = sum(len(c.token_ids) for c in leading)
        kinds = [_PartKind.of(c, expand_from) for c in chunks]
        parts = None
        if split and (num_seqs * s_max > 2 * len(input_ids) or len(set(kinds)) > 1):
            parts, token = [], 0
            for i0, i1 in _similar_runs(lens, kinds):
                n = sum(lens[i0:i1])
                parts.append((slice(token, token + n),
                              cls.build(chunks[i0:i1], block_size, device, workspace_bytes, split=False)))
                token += n
        return cls(
            parts=parts,
            input_ids=dev(input_ids),
            positions=dev(positions),
            slot_mapping=dev(slot_mapping),
            token_request=dev(token_request),
            query_index=dev(query_index),
            query_valid=dev(query_valid),
            query_pos=dev(query_pos),
            block_tables=dev(tables),
            context_lens=dev(ctx_t),
            logits_index=dev(torch.tensor(logits_index, dtype=torch.long)),
            block_size=block_size,
            max_context=t_max,
            is_decode=s_max == 1,
            uniform=uniform,
            workspace_bytes=workspace_bytes,
            generated=generated,
            logits_generated=sum(c.num_logits for c in leading if c.need_logits),
        )


StepIndices = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _chunk_indices(chunks: list[SeqChunk], lens: list[int], tables: torch.Tensor, block_size: int) -> StepIndices:
    """(positions, slot_mapping, token_request, query_index, query_valid, query_pos) of any step."""
    num_seqs, s_max = len(chunks), max(lens)
    starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.long)
    lens_t = torch.tensor(lens, dtype=torch.long)
    s = torch.arange(s_max)
    query_valid = s[None, :] < lens_t[:, None]
    offsets = torch.cumsum(lens_t, 0) - lens_t
    query_index = torch.where(query_valid, offsets[:, None] + s[None, :], torch.zeros(()).long())
    query_pos = torch.where(query_valid, starts[:, None] + s[None, :], torch.zeros(()).long())
    uniform = min(lens) == s_max
    positions = query_pos.view(-1) if uniform else query_pos[query_valid]
    rows = torch.arange(num_seqs)
    token_request = (rows.repeat_interleave(s_max) if uniform
                     else torch.repeat_interleave(rows, lens_t, output_size=len(positions)))
    slot_mapping = tables[token_request, positions // block_size] * block_size + positions % block_size
    return positions, slot_mapping, token_request, query_index, query_valid, query_pos


def _decode_indices(chunks: list[SeqChunk], lens: list[int], tables: torch.Tensor, block_size: int) -> StepIndices:
    """The same for a step of one token per request, from host lists: a decode step is overhead-bound."""
    starts = [c.start_pos for c in chunks]
    positions = torch.tensor(starts, dtype=torch.long)
    rows = torch.arange(len(chunks))
    slot_mapping = torch.tensor([c.block_table[p // block_size] * block_size + p % block_size
                                 for c, p in zip(chunks, starts)], dtype=torch.long)
    return (positions, slot_mapping, rows, rows.view(-1, 1), torch.ones(len(chunks), 1, dtype=torch.bool),
            positions.view(-1, 1))


def _host_indices(chunks: list[SeqChunk], lens: list[int], tables: torch.Tensor, block_size: int) -> StepIndices:
    """The same for a step of few tokens per request (MTP verification and catch-up), from host lists: six
    tensors built, not a dozen tensor ops on tiny tensors."""
    s_max = max(lens)
    positions, slots, token_request, query_index, query_pos = [], [], [], [], []
    offset = 0
    for r, (c, n) in enumerate(zip(chunks, lens)):
        table, start = c.block_table, c.start_pos
        for p in range(start, start + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
        positions.extend(range(start, start + n))
        token_request.extend([r] * n)
        query_index.extend([*range(offset, offset + n), *[0] * (s_max - n)])
        query_pos.extend([*range(start, start + n), *[0] * (s_max - n)])
        offset += n
    query_valid = torch.arange(s_max)[None, :] < torch.tensor(lens)[:, None]
    shape = (len(chunks), s_max)
    return (torch.tensor(positions), torch.tensor(slots), torch.tensor(token_request),
            torch.tensor(query_index).view(shape), query_valid, torch.tensor(query_pos).view(shape))


class _PartKind(enum.Enum):
    """What a chunk is, for the parts of a step: kinds never share a part."""

    GENERATED = "generated"  # decode, verification, recomputed outputs: the CPU kernels
    PROMPT = "prompt"  # prompt chunks too short for the expanded form
    LONG_PROMPT = "long prompt"  # prompt chunks of at least `expand_from` tokens

    @classmethod
    def of(cls, chunk: SeqChunk, expand_from: int | None) -> _PartKind:
        if chunk.generated:
            return cls.GENERATED
        return cls.LONG_PROMPT if expand_from is not None and len(chunk.token_ids) >= expand_from else cls.PROMPT


def _similar_runs(lens: list[int], kinds: list[_PartKind]) -> list[tuple[int, int]]:
    """Consecutive runs of requests whose padded view wastes at most half, r · max(len) ≤ 2 · Σ len, and
    that are all of one kind."""
    runs, start, longest, total = [], 0, 0, 0
    for i, n in enumerate(lens):
        if i > start and ((i - start + 1) * max(longest, n) > 2 * (total + n) or kinds[i] != kinds[start]):
            runs.append((start, i))
            start, longest, total = i, 0, 0
        longest, total = max(longest, n), total + n
    runs.append((start, len(lens)))
    return runs


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rows of whole blocks in table order, [R, n_blocks * block_size, D], from a [blocks, block_size, D]
    pool. Copies whole blocks (an embedding lookup on the block table): far faster than per-row
    indexing on CPU."""
    num_blocks, block_size, dim = pool.shape
    rows = torch.nn.functional.embedding(tables, pool.view(num_blocks, block_size * dim))
    return rows.view(tables.shape[0], -1, dim)


def gather_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows at flat slots (any shape) from a [blocks, block_size, D] pool → [*slots.shape, D]."""
    return torch.nn.functional.embedding(slots, pool.view(-1, pool.shape[-1]))


def write_rows(pool: torch.Tensor, fb: ForwardBatch, rows: torch.Tensor) -> None:
    """Store the step's new rows [N, D] at their slots (under CP: every rank's rows, gathered)."""
    flat = pool.view(-1, pool.shape[-1])
    flat[fb.slot_mapping] = rows.to(pool.dtype)
    if fb.cp is not None:
        everyone = gather_varlen(rows[: fb.cp.local_rows].contiguous(), fb.cp.sizes, fb.cp.group)
        flat[fb.cp.slots] = everyone.to(pool.dtype)
