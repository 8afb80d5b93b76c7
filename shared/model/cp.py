"""Context-parallel prefill: each prompt chunk of a step cut into 2·cp pieces, rank r computing
pieces r and 2·cp−1−r (balanced causal work), KV all-gathered every layer so each rank attends
over the whole prefix. Chunks start anywhere (chunked prefill, prefix-cache hits): every rank holds
the whole KV of what came before, so a chunk's pieces attend over it like any cached prefix."""

from __future__ import annotations

import torch

from shared.model.batch import CPGather, ForwardBatch, SeqChunk


def zigzag_ranges(length: int, cp: int) -> list[list[tuple[int, int]]]:
    """Per rank, its (start, end) token ranges (empty ranges dropped)."""
    n = 2 * cp
    sizes = [length // n + (1 if i < length % n else 0) for i in range(n)]
    bounds = [sum(sizes[:i]) for i in range(n + 1)]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(n)]
    return [[c for c in (chunks[r], chunks[n - 1 - r]) if c[1] > c[0]] for r in range(cp)]


def piece_logits(chunk: SeqChunk, a: int, b: int) -> int:
    """How many of the chunk's wanted logits rows (its last `num_logits` tokens) fall in its piece
    [a, b): always the piece's last ones, so the piece takes them as its own last `num_logits`."""
    if not chunk.need_logits:
        return 0
    return max(0, b - max(a, len(chunk.token_ids) - chunk.num_logits))


def build_cp_batch(chunks: list[SeqChunk], rank: int, cp: int, block_size: int, device: torch.device,
                   group, scratch_block: int, all_logits: bool = False,
                   workspace_bytes: int | None = None, expand_from: int | None = None) -> ForwardBatch:
    """This rank's part of a CP step over `chunks` (each a request's new tokens at start_pos..). Its
    logits rows are the wanted ones (see piece_logits) of the tokens it computed, in chunk and piece
    order (every row it computed with `all_logits`). A rank with no tokens runs one dummy token in
    `scratch_block`, so it still enters every collective."""
    mine: list[SeqChunk] = []
    sizes = [0] * cp
    slots: list[list[int]] = [[] for _ in range(cp)]
    for c in chunks:
        n = len(c.token_ids)
        for r, ranges in enumerate(zigzag_ranges(n, cp)):
            for a, b in ranges:
                sizes[r] += b - a
                slots[r].extend(c.block_table[t // block_size] * block_size + t % block_size
                                for t in range(c.start_pos + a, c.start_pos + b))
                if r == rank:
                    wanted = piece_logits(c, a, b)
                    mine.append(SeqChunk(c.token_ids[a:b], c.start_pos + a, c.block_table,
                                         need_logits=all_logits or wanted > 0, num_logits=wanted or 1,
                                         generated=c.generated))
    local_rows = sizes[rank]
    if not mine:
        mine = [SeqChunk([0], 0, [scratch_block], need_logits=False)]
    extra = {} if workspace_bytes is None else {"workspace_bytes": workspace_bytes}
    fb = ForwardBatch.build(mine, block_size, device, expand_from=expand_from, **extra)
    if all_logits and local_rows:
        fb.logits_index = torch.arange(local_rows, device=device)
        fb.logits_generated = fb.generated
    flat = torch.tensor([s for per_rank in slots for s in per_rank], dtype=torch.long)
    fb.cp = CPGather(group, sizes, flat.to(device), local_rows)
    return fb

