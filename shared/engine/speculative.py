"""MTP speculative decoding: the model's own multi-token-prediction layer drafts K tokens, the main
model verifies them (and the token before them) in one forward over the paged cache.

Per step, for the scheduled requests:
1. Main forward: prompt chunks as scheduled; each decoding request's last token followed by its K
   drafts at positions m .. m+K, with logits at every one of them (and every token's post-norm state).
2. Verification, per request: greedy accepts drafts while they equal the target's argmax, then takes
   the target's token (the output is bitwise the non-speculative greedy output); sampled requests use
   the standard rejection rule (accept d with probability min(1, p(d)/q(d)), else draw from
   norm(max(p − q, 0)); all accepted: a bonus draw from the last p), so the output distribution is the
   target's. KV past the accepted positions is left in place and counted out (`num_cached`): the next
   step overwrites it.
3. MTP catch-up: the MTP layer consumes every position the main forward just made final, j =
   start .. num_cached − 1, with (t_{j+1}, h_j), writing its own cache layer; the last position's output
   is the first draft for the next step, and K − 1 chained single-token steps (g_j for h_j) add the rest.

With the prefix cache, a request reuses cached blocks' MTP rows with their main rows. The MTP row at a
cached block's last position was made with the next token of the request that computed it, which may
differ from this request's: that can only change drafts, never the output (verification decides), so
the prefix cache stays on under MTP (the same trade vLLM makes). Blocks are registered once their
positions are final and their MTP rows written, and no MTP or draft write ever lands in a shared block
(every write is at or past the request's first uncached position).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch

from shared.config import MAX_SPECULATIVE_TOKENS, ModelConfig
from shared.engine.draft_tuner import DraftTuner
from shared.engine.policy import ForwardTarget, Solo
from shared.engine.sampler import SamplingParams, probabilities, sample
from shared.engine.scheduler import ScheduledChunk, Scheduler, Sequence
from shared.model import SeqChunk


@dataclass
class SpecStats:
    """Drafted / accepted counts, per draft position (position i: the i-th draft of a step)."""

    drafted: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verification (tokens per step = this + 1)."""
        return sum(self.accepted) / self.drafted[0] if self.drafted[0] else 0.0


@dataclass
class Draft:
    """A request's drafts for its next step, each with the q it was drawn from (sampled requests only)."""

    tokens: list[int]
    probs: list[torch.Tensor]  # q per draft [V]


class CatchUp(NamedTuple):
    """A request whose positions start .. num_cached − 1 became final this step: the MTP layer consumes
    them. `offset` is where its rows start in the step's hidden states; `drafts` whether it may decode
    next (a finished request, whose KV a prefill pushes, is caught up without drafting)."""

    seq: Sequence
    start: int
    offset: int
    drafts: bool


class DraftingEngine(ForwardTarget, Protocol):
    """What the speculator uses of its engine (an LLMEngine): a protocol, so this module needs no
    engine import and the engine can build its speculator."""

    scheduler: Scheduler
    policy: Solo
    model_config: ModelConfig
    dtype: torch.dtype

    @property
    def max_model_len(self) -> int: ...

    def dummy_chunk(self) -> SeqChunk: ...

    def has_request(self, request_id: str) -> bool: ...


class MtpSpeculator:
    """The checkpoint's MTP layer drafts up to `num_tokens` per decode step; the engine's step verifies them.

    `max_draft_tokens` (0: no limit) caps the drafts of one step: with B requests decoding each drafts
    min(K, max_draft_tokens // B), none once B exceeds the cap. A verified draft row costs about what a
    decode row costs once a step's work grows with its rows (large batches), its draft brings less than one
    token, and each draft position adds an MTP forward: past the cap a step costs more than the tokens it
    gains. A step with no drafts is a plain decode step: the MTP layer skips its decode positions too
    (their MTP rows stay unwritten: zeros or a freed block's rows), so a request that decoded past the cap
    may draft less well once the batch shrinks, never with another output (verification decides). Under
    lock-step ranks (attention DP) every rank drafts K: their MTP forwards must pair up."""

    def __init__(self, engine: DraftingEngine, num_tokens: int, max_draft_tokens: int = 0, tune: bool = False):
        self.engine, self.k, self.max_draft_tokens = engine, num_tokens, max_draft_tokens
        self.drafts: dict[str, Draft] = {}
        self.stats = SpecStats()
        self.gated_steps = 0  # steps the cap (or the tuner) left without drafts
        self.tuner = DraftTuner(num_tokens) if tune else None
        self._timing = _StepTiming()

    def reset(self) -> None:
        """Forget what the warm-up measured: its counts and its (cold) step times."""
        self.stats = SpecStats()
        self.tuner = DraftTuner(self.k) if self.tuner is not None else None
        self._timing = _StepTiming()

    # -- the engine step's plug points (shared.engine.llm.LLMEngine.step_chunks) -----------------------
    def take_drafts(self, chunks: list[ScheduledChunk]) -> list[Draft | None]:
        """Each chunk's drafts to verify this step (None: none), their KV blocks ensured."""
        engine = self.engine
        self._timing.verify_start = time.perf_counter()
        for rid in list(self.drafts):
            if not engine.has_request(rid):  # finished or aborted since it drafted
                del self.drafts[rid]
        drafts: list[Draft | None] = []
        for c in chunks:
            seq, start = c.seq, c.seq.num_cached
            draft = self.drafts.pop(seq.request_id, None) if c.completes and seq.output_token_ids else None
            if draft is not None and not engine.scheduler.ensure_blocks(seq, start + c.num_tokens + len(draft.tokens)):
                draft = None  # no room for the drafts' KV: verify none this step
            drafts.append(draft)
        return drafts

    def verify(self, chunks: list[ScheduledChunk], drafts: list[Draft | None], logits: torch.Tensor) -> list[list[int]]:
        """Per completing chunk, the tokens the step yields: its accepted drafts, then the target's next.

        Batched over the step, whatever the requests accept: one `sample` call for the requests without
        drafts, one argmax and one tensor comparison for the greedy ones, one rejection pass for the sampled
        ones (no per-request tensor ops: at batch 64 those cost more than the comparison itself)."""
        done = [(c.seq, d) for c, d in zip(chunks, drafts, strict=True) if c.completes]
        firsts = list(itertools.accumulate((1 + len(d.tokens) if d else 1 for _, d in done), initial=0))
        out: list[list[int]] = [[] for _ in done]
        plain, greedy, sampled = [], [], []
        for i, (seq, d) in enumerate(done):
            (plain if d is None else greedy if seq.params.greedy else sampled).append(i)
        if plain:
            at = [firsts[i] for i in plain]
            rows = logits if at == list(range(logits.shape[0])) else logits[_index(at, logits.device)]  # no drafts
            tokens = sample(rows, [done[i][0].params for i in plain], [done[i][0].generator for i in plain])
            for i, token in zip(plain, tokens, strict=True):
                out[i] = [token]
        for group in (greedy, sampled):
            if not group:
                continue
            batch = VerifyBatch.of([done[i][1] for i in group], [firsts[i] for i in group], logits.device)
            if group is greedy:
                n, last = accept_greedy(logits, batch)
            else:
                n, last = self._accept_sampled(logits, batch, [done[i][0] for i in group])
            for i, d, accepted, token in zip(group, batch.drafts, n, last, strict=True):
                out[i] = [*d.tokens[:accepted], token]
            self._count(batch.lengths, n)
        return out

    def _accept_sampled(self, logits: torch.Tensor, batch: VerifyBatch, seqs: list[Sequence]
                        ) -> tuple[list[int], list[int]]:
        """The standard rejection rule for sampled requests, batched: accept draft i with probability
        min(1, p(d_i) / q(d_i)); at the first rejection draw from norm(max(p − q, 0)); all accepted: a bonus
        draw from the last p. Each request takes K + 1 uniforms from its own generator per verification
        (a seeded request replays)."""
        params = [s.params for s in seqs]
        k = batch.width
        p = probabilities(logits[batch.rows.view(-1)], [q for q in params for _ in range(k + 1)])
        p = p.view(len(seqs), k + 1, -1)
        q = torch.zeros(len(seqs), k, p.shape[-1], dtype=p.dtype, device=p.device)
        for r, d in enumerate(batch.drafts):
            q[r, : len(d.tokens)] = torch.stack(d.probs).to(p.device, p.dtype)
        u = uniform_rows([s.generator for s in seqs], k + 1).to(p.device)
        tok = batch.tokens[:, :, None]
        n = accepted_prefix(u[:, :k] * q.gather(2, tok)[..., 0] < p[:, :k].gather(2, tok)[..., 0], batch.lengths)
        ar = torch.arange(len(seqs), device=p.device)
        target = p[ar, n]
        residual = torch.where((n < batch.lengths)[:, None], (target - q[ar, n.clamp(max=k - 1)]).clamp(min=0), target)
        empty = residual.sum(-1) <= 0  # p == q up to rounding: any draw from p is exact
        weights = torch.where(empty[:, None], target, residual)
        return n.tolist(), inverse_cdf(weights, u[:, k]).tolist()

    def _count(self, lengths: torch.Tensor, accepted: list[int]) -> None:
        for length, n in zip(lengths.tolist(), accepted, strict=True):
            for i in range(length):
                self.stats.drafted[i] += 1
            for i in range(n):
                self.stats.accepted[i] += 1

    # -- drafting --------------------------------------------------------------------------------------
    def catch_up(self, entries: list[CatchUp], hidden: torch.Tensor, draft: bool = True) -> None:
        """MTP over each entry's newly final positions (input t_{j+1} with h_j, its tokens already
        appended), and with `draft`, drafts for the entries that decode next.

        Under lock-step (attention DP, EP inside the MTP block) every rank runs exactly 1 + (K − 1) MTP
        forwards per drafting step, dummy ones where it has nothing to draft, so the ranks' collectives
        pair up whatever each one's requests accept or finish."""
        engine, policy = self.engine, self.engine.policy
        recorded = engine.graphs.stats.captures if engine.graphs is not None else 0
        started = self._timing.step_measured(self.tuner, recorded)
        chain = self.k - 1 if draft else 0  # chained single-token forwards after the catch-up forward
        if not entries:
            if policy.lockstep:
                self.dummy(1 + chain)
            return
        decoding = sum(map(self._decodes_next, entries))
        per_request = self.drafts_per_request(decoding) if draft else 0
        if draft and decoding:  # the step after this one verifies what this one drafts: measured together
            self._timing.drafting(decoding, per_request, started, recorded)
        if draft and per_request == 0:  # a plain step: no drafts, and the decode positions are not caught up
            self.gated_steps += 1
            draft = False
            entries = [e for e in entries if not e.seq.generated_from(e.start)]
            if not entries:
                self._timing.drafted()
                return
        chain = per_request - 1 if draft else 0
        chunks: list[SeqChunk] = []
        rows: list[int] = []  # each MTP input's row in the step's hidden states
        drafting: list[Sequence] = []
        ends: list[int] = []  # the drafting entries' last rows in the MTP batch
        for e in entries:
            seq, start, end = e.seq, e.start, e.seq.num_cached
            decodes = draft and self._decodes_next(e)
            chunks.append(SeqChunk(seq.token_slice(start + 1, end + 1), start, seq.block_table, need_logits=decodes,
                                   generated=seq.generated_from(start)))
            rows.extend(range(e.offset, e.offset + end - start))
            if decodes:
                drafting.append(seq)
                ends.append(len(rows) - 1)
        every = rows == list(range(hidden.shape[0]))  # all of the step's rows, in order: no gather
        h = hidden if every else policy.hidden_rows(hidden, [_index(rows, hidden.device)])
        logits, g = policy.forward_mtp(engine, chunks, h)
        budgets = [min(per_request, self._budget(seq)) for seq in drafting]
        state = [Draft([], []) for _ in drafting]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if active:
            rows_of_active = logits if len(active) == len(drafting) else logits[_index(active, logits.device)]
            self._draw(drafting, active, rows_of_active, state)
        last_g = g[_index(ends, g.device)] if drafting else None
        forwards = chain if policy.lockstep else min(chain, max(budgets, default=0) - 1)
        for k in range(1, forwards + 1):  # chained: position num_cached + k − 1, input the previous draft, h = its g
            batch, keep = [], []
            for i in active:
                seq = drafting[i]
                pos = seq.num_cached + k - 1
                if budgets[i] <= k or not engine.scheduler.ensure_blocks(seq, pos + 1):
                    continue  # enough drafts, or no room for another: this request stops drafting
                batch.append(SeqChunk([state[i].tokens[-1]], pos, seq.block_table, generated=True))
                keep.append(i)
            active = keep
            if not keep:
                if not policy.lockstep:
                    break
                self.dummy(1)
                continue
            # rows of last_g: the drafting requests in order; `keep` is a subset (usually all of them)
            g_in = last_g if len(keep) == len(drafting) else last_g[_index(keep, last_g.device)]
            logits, g_new = policy.forward_mtp(engine, batch, g_in)
            if len(keep) == len(drafting):
                last_g = g_new
            else:
                last_g = last_g.clone()
                last_g[_index(keep, last_g.device)] = g_new
            self._draw(drafting, keep, logits, state)
        self.drafts.update({seq.request_id: d for seq, d in zip(drafting, state, strict=True) if d.tokens})
        self._timing.drafted()

    @staticmethod
    def _decodes_next(e: CatchUp) -> bool:
        """The entry's request decodes in the next step (so it would draft for it)."""
        return e.drafts and e.seq.num_uncached == 1 and bool(e.seq.output_token_ids)

    def drafts_per_request(self, decoding: int) -> int:
        """Drafts each of `decoding` requests makes for the next step: under `max_draft_tokens`, the count the
        tuner measured fastest for this batch size on a one-rank instance (the cap's count on mirrored TP
        ranks; K under lock-step: see the class docstring)."""
        if self.engine.policy.lockstep or decoding == 0:
            return self.k
        most = min(self.k, self.max_draft_tokens // decoding) if self.max_draft_tokens else self.k
        if self.tuner is None or self.engine.policy.mirror:  # mirrored ranks must choose alike: not by their clocks
            return most
        return self.tuner.choose(decoding, most, self.stats.drafted, self.stats.accepted)

    def _draw(self, drafting: list[Sequence], active: list[int], logits: torch.Tensor, state: list[Draft]) -> None:
        """Each active request's next draft from its MTP logits (row j for active[j]): the argmax, or a draw
        kept with the q it came from."""
        params = [drafting[i].params for i in active]
        tokens = logits.argmax(-1).tolist()
        sampled = [j for j, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = logits if len(sampled) == len(active) else logits[_index(sampled, logits.device)]
            probs = probabilities(rows, [params[j] for j in sampled])
            u = uniform_rows([drafting[active[j]].generator for j in sampled], 1)[:, 0]
            for j, q, token in zip(sampled, probs, inverse_cdf(probs, u).tolist(), strict=True):
                tokens[j] = token
                state[active[j]].probs.append(q)
        for i, token in zip(active, tokens, strict=True):
            state[i].tokens.append(token)

    def dummy(self, forwards: int) -> None:
        """MTP forwards of one token in the scratch block: a lock-step rank with nothing to draft still
        enters the MTP block's collectives (EP all-to-all) as often as the ranks that draft."""
        engine = self.engine
        chunk = replace(engine.dummy_chunk(), need_logits=False, generated=False)
        for _ in range(forwards):
            engine.policy.forward_mtp(engine, [chunk], torch.zeros(1, engine.model_config.hidden_size,
                                                                   dtype=engine.dtype, device=engine.device))

    def _budget(self, seq: Sequence) -> int:
        """Drafts worth making: never past max_tokens or the model's context."""
        left = min(seq.params.max_tokens - len(seq.output_token_ids), self.engine.max_model_len - seq.num_tokens)
        return max(0, min(self.k, left - 1))


@dataclass
class VerifyBatch:
    """Drafted requests of a step as tensors: each one's K + 1 logits rows (a shorter draft's padded with
    its last row), its drafts (padded with token 0) and how many it has."""

    drafts: list[Draft]
    rows: torch.Tensor  # [R, K + 1] long, rows of the step's logits
    tokens: torch.Tensor  # [R, K] long
    lengths: torch.Tensor  # [R] long

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @classmethod
    def of(cls, drafts: list[Draft], firsts: list[int], device: torch.device) -> VerifyBatch:
        """`firsts[r]`: the logits row of request r's first verified position (its last token's)."""
        k = max(len(d.tokens) for d in drafts)
        rows = [[f + min(j, len(d.tokens)) for j in range(k + 1)] for d, f in zip(drafts, firsts, strict=True)]
        tokens = [d.tokens + [0] * (k - len(d.tokens)) for d in drafts]
        return cls(drafts, torch.tensor(rows, dtype=torch.long, device=device),
                   torch.tensor(tokens, dtype=torch.long, device=device).view(len(drafts), k),
                   torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long, device=device))


def accepted_prefix(accept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per row of `accept` [R, K] (bool), how many leading drafts are accepted, never past `lengths` [R]."""
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < lengths[:, None]
    return (accept & valid).long().cumprod(1).sum(1)


@dataclass
class _StepTiming:
    """What one drafting step and the verification after it cost (the tuner's samples: draft_tuner)."""

    verify_start: float | None = None  # take_drafts of the step now verifying
    pending: tuple[int, int, bool] | None = None  # (decoding, drafts per request, steady) of the last catch-up
    draft_seconds: float = 0.0
    _started: float = 0.0
    _previous: int = -1  # drafts per request of the drafting step before
    _recorded: int = 0  # the engine's recorded steps (shared.engine.graphs) when the span began

    def step_measured(self, tuner: DraftTuner | None, recorded: int = 0) -> float:
        """At a catch-up's start: the previous drafting step's cost ends here (its drafts are verified). A span in
        which a step was recorded (run eagerly under the recorder, several times a replay's cost) is no sample."""
        now = time.perf_counter()
        if tuner is not None and self.pending is not None and self.verify_start is not None:
            decoding, drafts, steady = self.pending
            tuner.observe(decoding, drafts, self.draft_seconds + now - self.verify_start,
                          steady and recorded == self._recorded)
        self.pending = None
        return now

    def drafting(self, decoding: int, drafts: int, started: float, recorded: int = 0) -> None:
        self.pending, self._started = (decoding, drafts, drafts == self._previous), started
        self._previous, self._recorded = drafts, recorded

    def drafted(self) -> None:
        if self.pending is not None:
            self.draft_seconds = time.perf_counter() - self._started


def accept_greedy(logits: torch.Tensor, batch: VerifyBatch) -> tuple[list[int], list[int]]:
    """Greedy verification of every drafted request at once: drafts are accepted while they equal the
    target's argmax; the token after them is the argmax at the first mismatch (or after the last draft),
    so the output is bitwise the non-speculative greedy output. (accepted counts, next tokens)."""
    target = logits.argmax(-1)[batch.rows]  # [R, K + 1]
    n = accepted_prefix(batch.tokens == target[:, : batch.width], batch.lengths)
    return n.tolist(), target.gather(1, n[:, None])[:, 0].tolist()


def uniform_rows(generators: list[torch.Generator | None], n: int) -> torch.Tensor:
    """[R, n] uniforms on the host, row r from generators[r]: rows sharing a generator (unseeded rows share
    the default one) draw in one call, in row order; a seeded request's draws are its own."""
    u = torch.empty(len(generators), n)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(generators):
        groups.setdefault(id(g), []).append(i)
    for rows in groups.values():
        u[rows] = torch.rand(len(rows), n, generator=generators[rows[0]])
    return u


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` [R, V] (unnormalized, ≥ 0), the first index whose cumulative weight exceeds
    u · total (u [R] in [0, 1))."""
    cdf = weights.float().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_(max=weights.shape[-1] - 1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def stats_table(stats: SpecStats, k: int) -> str:
    rates = ", ".join(f"{r:.2f}" for r in stats.acceptance()[:k])
    return f"drafted {stats.drafted[:k]}, accepted {stats.accepted[:k]}, acceptance per position [{rates}]"


__all__ = ["MAX_SPECULATIVE_TOKENS", "CatchUp", "Draft", "MtpSpeculator", "SamplingParams", "SpecStats", "stats_table"]
