"""Context-parallel prefill: a prompt cut into 2·cp chunks, rank r computing chunks r and 2·cp−1−r
(balanced causal work), KV all-gathered every layer so each rank attends over the whole prefix."""

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


def build_cp_batch(prompt: list[int], block_table: list[int], rank: int, cp: int, block_size: int,
                   device: torch.device, group, scratch_block: int, all_logits: bool = False,  # noqa: ANN001
                   ) -> ForwardBatch:
    """This rank's part of a CP prefill step. A rank with no tokens runs one dummy token in
    `scratch_block` so it still enters every collective."""
    ranges = zigzag_ranges(len(prompt), cp)
    mine = ranges[rank]
    last = len(prompt)
    chunks = [SeqChunk(prompt[a:b], a, block_table, need_logits=all_logits or b == last) for a, b in mine]
    local_rows = sum(b - a for a, b in mine)
    if not chunks:
        chunks = [SeqChunk([0], 0, [scratch_block], need_logits=False)]
    fb = ForwardBatch.build(chunks, block_size, device)
    if all_logits and local_rows:
        fb.logits_index = torch.arange(local_rows, device=device)
    bs = block_size
    positions = [t for r in ranges for a, b in r for t in range(a, b)]
    slots = torch.tensor([block_table[t // bs] * bs + t % bs for t in positions], dtype=torch.long)
    fb.cp = CPGather(group, [sum(b - a for a, b in r) for r in ranges], slots.to(device), local_rows)
    return fb


def owned_blocks(length: int, rank: int, cp: int, block_size: int) -> list[int]:
    """Block indices (into the request's block table) this rank pushes: those whose first token it
    computed. Every rank holds the whole KV after the gathers, so each block goes out exactly once."""
    mine = zigzag_ranges(length, cp)[rank]
    return [b for b in range(-(-length // block_size)) if any(s <= b * block_size < e for s, e in mine)]
