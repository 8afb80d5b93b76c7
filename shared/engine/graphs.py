"""Decode steps run from recorded tapes (shared.model.tape), one per padded batch size: no host overhead.

A decode step of R requests is padded to the smallest captured size B ≥ R (rows past R repeat the first row:
its token at its position, writing its KV row into its slot again with the same bits, so padding needs no block
of its own), and its inputs are written into one static ForwardBatch per (B, key-axis width, context regime).
The first step at a key runs eagerly while the tape records it (its logits are that step's: capture costs no
extra step, so there is no cold start); every later step at that key writes its tokens, positions, slots, block
tables and lengths into the static batch and replays the tape. Decode rows are computed alike however they are
batched (shared.model.ops: generated tokens take batch-invariant kernels), so a padded replay gives every real
row the eager step's bits.

What stays eager: prompt chunks, MTP verification and drafts, steps of a parallel instance (their
collectives), steps needing a key-axis width or batch past the largest size, contexts past the indexer's
top-k (its selection reads values on the host: the tape refuses it), and any key whose capture was refused
or would hold more than `graph_memory_mb` (EngineConfig) in all. The backend per device:
`shared.device.step_graphs` (the host tape on CPU; none yet on CUDA / NPU, which run eagerly).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from shared.device import step_graphs
from shared.model import ForwardBatch, SeqChunk
from shared.model.tape import Tape, TapeMismatch, record


def graph_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes up to `max_batch` (as vLLM's CUDA graphs: 1, 2, 4, then every 8): a step pads to
    the next one, at most 8 rows (or a third) more."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


@dataclass
class _Graph:
    """One captured key: the static batch the tape reads and the logits tensor it writes."""

    batch: ForwardBatch
    logits: torch.Tensor
    tape: Tape


@dataclass
class GraphStats:
    """Counters for benches and tests."""

    replays: int = 0
    captures: int = 0  # steps recorded (each ran eagerly)
    eager: int = 0  # steps the graphs did not take
    refused: dict[tuple[int, int, int], str] = field(default_factory=dict)


class DecodeGraphs:
    """The captured decode steps of one single-rank engine (its model, KV cache and a scratch block)."""

    def __init__(self, model: torch.nn.Module, kv: object, block_size: int, max_batch: int, max_blocks: int,
                 memory_bytes: int):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.sizes, self.max_blocks = graph_sizes(max_batch), max_blocks
        self.memory_bytes, self.used_bytes = memory_bytes, 0
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.stats = GraphStats()

    @classmethod
    def for_engine(cls, engine: object) -> DecodeGraphs | None:
        """An engine's graphs, None where they do not apply: `enforce_eager`, parallel ranks, MTP (its steps
        verify drafts), torch.compile'd parts, offloaded layers, a device without a backend."""
        cfg, model = engine.config, engine.model
        if (cfg.enforce_eager or cfg.compile or cfg.speculative or engine.parallel.is_parallel
                or model.offloader is not None or not step_graphs(engine.device)):
            return None
        return cls(model, engine.kv, cfg.block_size, cfg.max_num_seqs, -(-engine.max_model_len // cfg.block_size),
                   cfg.graph_memory_mb << 20)

    @staticmethod
    def applies(chunks: list[SeqChunk]) -> bool:
        """A plain decode step: every request one generated token whose logits it wants."""
        return bool(chunks) and all(len(c.token_ids) == 1 and c.generated and c.need_logits and c.num_logits == 1
                                    for c in chunks)

    def key(self, chunks: list[SeqChunk]) -> tuple[int, int, int] | None:
        """(batch size, key-axis blocks, context bound) of a step, None where no size fits it."""
        i = bisect.bisect_left(self.sizes, len(chunks))
        context = max(c.start_pos + 1 for c in chunks)
        needed = -(-context // self.block_size)
        if i == len(self.sizes) or needed > self.max_blocks:
            return None
        blocks = min(1 << (needed - 1).bit_length(), self.max_blocks)  # a power of two ≥ the blocks, or all
        return self.sizes[i], blocks, self.model.context_bound(context, blocks * self.block_size)

    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """The step's logits [len(chunks), vocab] from a tape (captured now where the key is new), or None:
        the caller runs the step eagerly."""
        key = self.key(chunks) if self.applies(chunks) else None
        if key is None or key in self.stats.refused:
            self.stats.eager += 1
            return None
        graph = self.graphs.get(key)
        if graph is None:
            return self._capture(key, chunks)
        self._fill(graph.batch, chunks)
        try:
            graph.tape.replay()
        except TapeMismatch as exc:  # its inputs took a kernel elsewhere than at capture: never replay it again
            self._drop(key, str(exc))
            return None
        self.stats.replays += 1
        return graph.logits[: len(chunks)]

    def _drop(self, key: tuple[int, int, int], why: str) -> None:
        graph = self.graphs.pop(key, None)
        if graph is not None:
            self.used_bytes -= graph.tape.kept_bytes
        self.stats.refused[key] = why

    @staticmethod
    def _padded(chunks: list[SeqChunk], size: int) -> list[SeqChunk]:
        return chunks + [chunks[0]] * (size - len(chunks))

    def _capture(self, key: tuple[int, int, int], chunks: list[SeqChunk]) -> torch.Tensor | None:
        """Run the step eagerly on a static batch of the key's shape, recording it."""
        size, blocks, bound = key
        static = ForwardBatch.build(self._padded(chunks, size), self.block_size, torch.device("cpu"), split=False)
        tables = torch.zeros(size, blocks, dtype=torch.long)
        tables[:, : static.block_tables.shape[1]] = static.block_tables
        static.block_tables, static.max_context = tables, bound
        with torch.inference_mode():
            logits, recording = record(lambda: self.model(static, self.kv))
        if recording.tape is None:
            self.stats.refused[key] = recording.refused or "refused"
        elif self.used_bytes + recording.tape.kept_bytes > self.memory_bytes:
            self.stats.refused[key] = f"past the graphs' memory budget ({self.memory_bytes} bytes)"
        else:
            self.used_bytes += recording.tape.kept_bytes
            self.graphs[key] = _Graph(static, logits, recording.tape)
            self.stats.captures += 1
        return logits[: len(chunks)]

    def _fill(self, fb: ForwardBatch, chunks: list[SeqChunk]) -> None:
        """Write the step's inputs into the static batch's rows, the padding rows the first row's."""
        n, size = len(chunks), self.block_size
        starts = [c.start_pos for c in chunks]
        nb = max(-(-(p + 1) // size) for p in starts)
        tables = [c.block_table[:nb] + [0] * (nb - len(c.block_table[:nb])) for c in chunks]
        fb.input_ids[:n] = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long)
        fb.positions[:n] = torch.tensor(starts, dtype=torch.long)  # query_pos is a view of it
        fb.slot_mapping[:n] = torch.tensor([t[p // size] * size + p % size for t, p in zip(tables, starts)],
                                           dtype=torch.long)
        fb.context_lens[:n] = fb.positions[:n] + 1
        fb.block_tables[:n, :nb] = torch.tensor(tables, dtype=torch.long)
        for t in (fb.input_ids, fb.positions, fb.slot_mapping, fb.context_lens, fb.block_tables):
            t[n:] = t[0]
