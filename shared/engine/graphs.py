"""Decode steps run from recorded tapes (shared.model.tape), one per padded batch size: no host overhead.

A decode step of R requests with L generated tokens each (a plain decode: 1; an MTP verification: the last token
and its drafts) is padded to the smallest recorded size B ≥ R (rows past R repeat the first request: its tokens
at its positions, writing its KV rows into its slots again with the same bits, so padding needs no block of its
own), and its inputs are written into one static ForwardBatch per key (B, L, key-axis blocks, context regime,
whether it returns the hidden states MTP drafts from). The first step at a key runs eagerly, the second
eagerly while the tape records it (its outputs are that step's: recording costs no extra step; a key met once, a
short request's or a passing batch size's, is never recorded: recording costs several eager steps); every later
step at that key writes its tokens, positions, slots, block tables and lengths into the static batch and replays
the tape. Generated rows are computed alike however they are batched (shared.model.ops: batch-invariant
kernels), so a padded replay gives every real row the eager step's bits.

The MTP layer's own forwards (its catch-up over each request's accepted positions, its chained single-token
drafts) are recorded the same way, their input states copied into a static buffer. What stays eager: prompt
chunks, steps whose requests have different token counts (an MTP step whose requests accepted or draft
different counts), CP prefill ranks (each rank's batch is its pieces), steps needing a key-axis
width or batch past the largest size, and any key whose recording was refused or would hold more than
`graph_memory_mb` (EngineConfig) in all. The backend per device: `shared.device.step_graphs` (the host tape on
CPU; none yet on CUDA / NPU, which run eagerly).

Parallel ranks: TP ranks replay their fixed-shape collectives (the tape issues them again), meeting the same keys
at the same steps; they keep a recording only if every rank made one. Attention-DP ranks each have their own
batch: for a decode step of the same shape on every rank (a plain decode, an MTP verification) they pad to the
largest rank's size (shared.engine.policy.LockStep)
and take the fixed-shape EP exchange (shared.model.moe.fixed_exchange) whether they replay, record or run eagerly
(`padded_step`), so each keeps its own recordings.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from shared.device import step_graphs
from shared.model import ForwardBatch, SeqChunk
from shared.model.moe import ep_layers, fixed_exchange
from shared.model.tape import Tape, TapeMismatch, record


def graph_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes up to `max_batch` (as vLLM's CUDA graphs: 1, 2, 4, then every 8): a step pads to
    the next one, at most 8 rows (or a third) more."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # logits, or logits and the post-norm hidden states


@dataclass(frozen=True)
class GraphKey:
    """What a recording is made for: the padded batch, tokens and logits per request, key-axis blocks (a power of
    two), the context bound given the static batch (Model.context_bound), whether it returns the hidden states,
    and whether it is the MTP layer's forward."""

    size: int
    each: int
    logits: int
    blocks: int
    bound: int
    hidden: bool
    mtp: bool


@dataclass
class _Graph:
    """One recorded key: the static batch the tape reads and the output it writes."""

    batch: ForwardBatch
    out: Output
    tape: Tape
    mtp_input: torch.Tensor | None = None  # the MTP layer's static input states


@dataclass
class GraphStats:
    """Counters for benches and tests."""

    replays: int = 0
    captures: int = 0  # steps recorded (each ran eagerly)
    eager: int = 0  # steps the graphs did not take
    refused: dict[GraphKey, str] = field(default_factory=dict)


class DecodeGraphs:
    """The recorded decode steps of one engine (its model and KV cache; on TP ranks, this rank's shards)."""

    def __init__(self, model: torch.nn.Module, kv: object, block_size: int, max_batch: int, max_blocks: int,
                 memory_bytes: int, agree: Callable[[bool], bool] = bool, padded_exchange: bool = False):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.agree = agree  # whether every rank of the instance says yes (one all-reduce; one rank: its own word)
        # attention-DP ranks: steps padded to a size every rank agreed on, their EP exchange fixed-shape (moe)
        self.padded_exchange = padded_exchange
        self.ep_layers = ep_layers(model)  # found once: the fixed exchange is switched on around each padded step
        self.sizes, self.max_blocks = graph_sizes(max_batch), max_blocks
        self.memory_bytes, self.used_bytes = memory_bytes, 0
        self.graphs: dict[GraphKey, _Graph] = {}
        self.seen: set[GraphKey] = set()  # keys a step has had once
        self.stats = GraphStats()

    @classmethod
    def for_engine(cls, engine: object) -> DecodeGraphs | None:
        """An engine's graphs, None where they do not apply: `enforce_eager`, ranks that step different batches
        (attention-DP, CP: engine.policy.graphs_apply), torch.compile'd parts, offloaded layers, a device
        without a backend. TP ranks record and replay the same steps, their collectives included."""
        cfg, model, policy = engine.config, engine.model, engine.policy
        if (cfg.enforce_eager or cfg.compile or not policy.graphs_apply or model.offloader is not None
                or not step_graphs(engine.device)):
            return None
        return cls(model, engine.kv, cfg.block_size, cfg.max_num_seqs, -(-engine.max_model_len // cfg.block_size),
                   cfg.graph_memory_mb << 20, policy.agree, policy.lockstep)

    @staticmethod
    def shape_of(chunks: list[SeqChunk]) -> tuple[int, int] | None:
        """(L, logits per request) where every request has L generated tokens and wants the logits of its last
        one or of each (a plain decode: (1, 1); an MTP verification: (1 + drafts, the same); the MTP layer's
        catch-up: (accepted + 1, 1)); None for any other step."""
        n, rows = (len(chunks[0].token_ids), chunks[0].num_logits) if chunks else (0, 0)
        same = all(len(c.token_ids) == n and c.generated and c.need_logits and c.num_logits == rows for c in chunks)
        return (n, rows) if n and same and rows in (1, n) else None

    def key(self, chunks: list[SeqChunk], hidden: bool, mtp: bool) -> GraphKey | None:
        """A step's key, None where no recording can take it."""
        shape = self.shape_of(chunks)
        if shape is None:
            return None
        i = bisect.bisect_left(self.sizes, len(chunks))
        context = max(c.start_pos + shape[0] for c in chunks)
        needed = -(-context // self.block_size)
        if i == len(self.sizes) or needed > self.max_blocks:
            return None
        blocks = min(1 << (needed - 1).bit_length(), self.max_blocks)  # a power of two ≥ the blocks, or all
        return GraphKey(self.sizes[i], *shape, blocks, self.model.context_bound(context, blocks * self.block_size),
                        hidden, mtp)

    def forward(self, chunks: list[SeqChunk], hidden: bool = False, mtp_input: torch.Tensor | None = None
                ) -> Output | None:
        """The step's logits [rows, vocab] (with `hidden`, and every token's post-norm state [tokens, H]: what MTP
        drafts from) from a recording (made on a key's second step), or None: the caller runs it eagerly. With
        `mtp_input` (the states h_j of the chunks' tokens), the MTP layer's forward instead: its logits and g_j.
        (Attention-DP ranks take `padded_step` instead, with the key every rank agreed on.)"""
        key = self.key(chunks, hidden, mtp_input is not None)
        if key is None or key in self.stats.refused:
            self.stats.eager += 1
            return None
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.seen:  # a key seen once runs eagerly: recording costs several steps, and many
                self.seen.add(key)  # keys (a short request's, a passing batch size) never come back
                self.stats.eager += 1
                return None
            return self._capture(key, chunks, mtp_input)
        self._fill(graph.batch, chunks, key.each)
        if mtp_input is not None:
            _fill_rows(graph.mtp_input, mtp_input, len(chunks), key.each)
        try:
            graph.tape.replay()
        except TapeMismatch as exc:  # its inputs took a kernel elsewhere than at capture: never replay it again
            self._drop(key, str(exc))  # (TP ranks have the same inputs: each drops it at the same call)
            return None
        self.stats.replays += 1
        return _rows(graph.out, key, len(chunks))

    def exchange_fits(self, size: int, ranks: int) -> bool:
        """Whether a padded step's fixed EP exchange could be recorded at all: each EP layer keeps every rank's rows
        (bf16) and their fp32 partial sums out and back, ranks · size · hidden · 10 bytes, within graph_memory_mb.
        Past it (real shapes: 58 layers, hidden 7,168, 32 ranks → about 15 rows a rank at 2 GiB) the ranks take
        the all-to-all-v, eagerly, which moves only the rows each rank's experts need."""
        return size * ranks * self.model.config.hidden_size * 10 * len(self.ep_layers) <= self.memory_bytes

    def padded_step(self, key: GraphKey, chunks: list[SeqChunk]) -> Output:
        """An attention-DP rank's step at the agreed size, its EP exchange fixed-shape whether it is replayed,
        recorded or run eagerly, so the ranks' collectives pair up whichever each does. A replay issues every call
        even past a kernel that returned otherwise; then the ranks agree (one all-reduce, every rank after its
        step) whether all replays held: if not, every rank runs the step again eagerly (a replay's KV writes are
        the eager step's rows)."""
        graph, why = self.graphs.get(key), ""
        if graph is not None:
            self._fill(graph.batch, chunks, key.each)
            try:
                graph.tape.replay(finish=True)
                out = _rows(graph.out, key, len(chunks))
            except TapeMismatch as exc:
                why = str(exc)
        elif key in self.seen and key not in self.stats.refused:
            out = self._capture(key, chunks, None)
        else:
            self.seen.add(key)
            out = self._padded_eager(key, chunks)
        if not self.agree(not why):
            if why:
                self._drop(key, why)
            return self._padded_eager(key, chunks)
        self.stats.replays += graph is not None
        return out

    def _padded_eager(self, key: GraphKey, chunks: list[SeqChunk]) -> Output:
        self.stats.eager += 1
        static, _ = self._static(key, chunks, None)
        return _rows(self._run(key, static, None), key, len(chunks))

    def _drop(self, key: GraphKey, why: str) -> None:
        graph = self.graphs.pop(key, None)
        if graph is not None:
            self.used_bytes -= graph.tape.kept_bytes
        self.stats.refused[key] = why

    @staticmethod
    def _padded(chunks: list[SeqChunk], size: int) -> list[SeqChunk]:
        return chunks + [chunks[0]] * (size - len(chunks))

    def _static(self, key: GraphKey, chunks: list[SeqChunk], mtp_input: torch.Tensor | None
                ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """A static batch of the key's shape holding the step (and the MTP layer's static input states)."""
        static = ForwardBatch.build(self._padded(chunks, key.size), self.block_size, torch.device("cpu"), split=False)
        tables = torch.zeros(key.size, key.blocks, dtype=torch.long)
        tables[:, : static.block_tables.shape[1]] = static.block_tables
        static.block_tables, static.max_context = tables, key.bound
        states = None  # the MTP layer's input, static: [B·L, H]
        if mtp_input is not None:
            states = mtp_input.new_empty(key.size * key.each, mtp_input.shape[1])
            _fill_rows(states, mtp_input, len(chunks), key.each)
        return static, states

    def _run(self, key: GraphKey, static: ForwardBatch, states: torch.Tensor | None) -> Output:
        """The model (or its MTP layer) on a static batch, eagerly (DP ranks: with the fixed EP exchange)."""
        with torch.inference_mode(), fixed_exchange(self.ep_layers) if self.padded_exchange else nullcontext():
            if states is None:
                return self.model(static, self.kv, None, key.hidden)
            return self.model.forward_mtp(static, self.kv, states)

    def _capture(self, key: GraphKey, chunks: list[SeqChunk], mtp_input: torch.Tensor | None) -> Output:
        """Run the step eagerly on a static batch of the key's shape, recording it. TP ranks keep it only if every
        rank made one (their padded and unpadded steps' collectives differ); DP ranks' padded steps issue the same
        collectives recorded or not (padded_step), so each keeps its own."""
        static, states = self._static(key, chunks, mtp_input)
        left = max(0, self.memory_bytes - self.used_bytes)
        out, recording = record(lambda: self._run(key, static, states), left)
        made = recording.tape is not None
        if not (made if self.padded_exchange else self.agree(made)):
            self.stats.refused[key] = recording.refused or "another rank's recording was refused"
        else:
            self.used_bytes += recording.tape.kept_bytes
            self.graphs[key] = _Graph(static, out, recording.tape, states)
            self.stats.captures += 1
        return _rows(out, key, len(chunks))

    def _fill(self, fb: ForwardBatch, chunks: list[SeqChunk], each: int) -> None:
        """Write the step's inputs into the static batch's rows, the padding rows the first row's."""
        n, size = len(chunks), self.block_size
        starts = [c.start_pos for c in chunks]
        nb = max(-(-(p + each) // size) for p in starts)
        tables = [c.block_table[:nb] + [0] * (nb - len(c.block_table[:nb])) for c in chunks]
        fb.input_ids[: n * each] = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        fb.positions[: n * each] = torch.tensor([p + j for p in starts for j in range(each)], dtype=torch.long)
        fb.slot_mapping[: n * each] = torch.tensor([t[q // size] * size + q % size for t, p in zip(tables, starts)
                                                    for q in range(p, p + each)], dtype=torch.long)
        fb.query_pos[:n] = fb.positions[: n * each].view(n, each)  # (one token each: a view of the same rows)
        fb.context_lens[:n] = fb.query_pos[:n, -1] + 1
        fb.block_tables[:n, :nb] = torch.tensor(tables, dtype=torch.long)
        for t in (fb.input_ids, fb.positions, fb.slot_mapping):
            t.view(-1, each)[n:] = t.view(-1, each)[0]
        for t in (fb.query_pos, fb.context_lens, fb.block_tables):
            t[n:] = t[0]


def _fill_rows(static: torch.Tensor, rows: torch.Tensor, n: int, each: int) -> None:
    """Per-token input rows into a static [B·L, H] buffer, the padding requests' rows the first request's."""
    static[: n * each] = rows
    static.view(-1, each, static.shape[1])[n:] = static.view(-1, each, static.shape[1])[0]


def _rows(out: Output, key: GraphKey, n: int) -> Output:
    """The first n requests' rows of a recording's output (its padding requests' rows come last): logits, and the
    hidden states or the MTP layer's g of every token."""
    if isinstance(out, tuple):
        return out[0][: n * key.logits], out[1][: n * key.each]
    return out[: n * key.logits]
