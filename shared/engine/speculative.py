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

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from shared.config import MAX_SPECULATIVE_TOKENS, ModelConfig
from shared.engine.policy import ForwardTarget, Solo
from shared.engine.sampler import SamplingParams, probabilities, sample
from shared.engine.scheduler import ScheduledChunk, Scheduler, Sequence
from shared.model import ForwardBatch, SeqChunk


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

    def dummy_batch(self) -> ForwardBatch: ...

    def has_request(self, request_id: str) -> bool: ...


class MtpSpeculator:
    """The checkpoint's MTP layer drafts `num_tokens` per decode step; the engine's step verifies them."""

    def __init__(self, engine: DraftingEngine, num_tokens: int):
        self.engine, self.k = engine, num_tokens
        self.drafts: dict[str, Draft] = {}
        self.stats = SpecStats()

    # -- the engine step's plug points (shared.engine.llm.LLMEngine.step_chunks) -----------------------
    def take_drafts(self, chunks: list[ScheduledChunk]) -> list[Draft | None]:
        """Each chunk's drafts to verify this step (None: none), their KV blocks ensured."""
        engine = self.engine
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
        """Per completing chunk, the tokens the step yields: its accepted drafts, then the target's next."""
        out, row = [], 0
        for c, draft in zip(chunks, drafts, strict=True):
            if not c.completes:
                continue
            n_logits = 1 + len(draft.tokens) if draft else 1
            accepted, last = self._verify(c.seq, logits[row : row + n_logits], draft)
            row += n_logits
            out.append([*accepted, last])
        return out

    def _verify(self, seq: Sequence, logits: torch.Tensor, draft: Draft | None) -> tuple[list[int], int]:
        """(accepted drafts, the token after them) from the target's logits at positions m .. m+K."""
        params = seq.params
        if draft is None:
            return [], sample(logits, [params], [seq.generator])[0]
        k = len(draft.tokens)
        for i in range(k):
            self.stats.drafted[i] += 1
        if params.greedy:
            target = logits.argmax(-1).tolist()
            n = 0
            while n < k and draft.tokens[n] == target[n]:
                n += 1
            self._count(n)
            return draft.tokens[:n], target[n]
        p = probabilities(logits, [params] * (k + 1))
        for i, (tok, q) in enumerate(zip(draft.tokens, draft.probs, strict=True)):
            u = float(torch.rand((), generator=seq.generator))
            if u * float(q[tok]) < float(p[i, tok]):  # accept with probability min(1, p/q)
                continue
            self._count(i)
            residual = (p[i] - q).clamp_(min=0)
            if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
                residual = p[i]
            return draft.tokens[:i], _draw_one(residual, seq.generator)
        self._count(k)
        return draft.tokens, _draw_one(p[k], seq.generator)

    def _count(self, n: int) -> None:
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
        chain = self.k - 1 if draft else 0  # chained single-token forwards after the catch-up forward
        if not entries:
            if policy.lockstep:
                self.dummy(1 + chain)
            return
        chunks, rows, drafting = [], [], []
        for e in entries:
            seq, start, end = e.seq, e.start, e.seq.num_cached
            decodes = draft and e.drafts and seq.num_uncached == 1 and bool(seq.output_token_ids)
            chunks.append(SeqChunk(seq.token_slice(start + 1, end + 1), start, seq.block_table, need_logits=decodes,
                                   generated=seq.generated_from(start)))
            rows.append(torch.arange(e.offset, e.offset + end - start))
            if decodes:
                drafting.append(seq)
        logits, g = engine.model.forward_mtp(policy.batch(engine, chunks), engine.kv, policy.hidden_rows(hidden, rows))
        ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
        last_g = g[ends[[i for i, c in enumerate(chunks) if c.need_logits]].to(g.device)] if drafting else None
        budgets = [self._budget(seq) for seq in drafting]
        state = {seq.request_id: Draft([], []) for seq in drafting}
        active = list(range(len(drafting)))
        forwards = chain if policy.lockstep else min(chain, max(budgets, default=0) - 1)
        for k in range(forwards + 1):  # k = 0 drafts from the catch-up forward's logits
            active = [i for i in active if budgets[i] > k]
            if k > 0:  # chained: position num_cached + k − 1, input the previous draft, h = its g
                batch, keep = [], []
                for i in active:
                    seq = drafting[i]
                    pos = seq.num_cached + k - 1
                    if not engine.scheduler.ensure_blocks(seq, pos + 1):
                        budgets[i] = k  # no room: stop drafting this request
                        continue
                    batch.append(SeqChunk([state[seq.request_id].tokens[-1]], pos, seq.block_table, generated=True))
                    keep.append(i)
                active = keep
                if not keep:
                    if not policy.lockstep:
                        break
                    self.dummy(1)
                    continue
                logits, g_new = engine.model.forward_mtp(policy.batch(engine, batch), engine.kv, last_g[keep])
                last_g = last_g.clone()
                last_g[keep] = g_new
                rows_of = {i: j for j, i in enumerate(keep)}
            else:
                rows_of = {i: i for i in active}
            if active:
                self._draw(drafting, active, logits[[rows_of[i] for i in active]], state)
        self.drafts.update({rid: d for rid, d in state.items() if d.tokens})

    def _draw(self, drafting: list[Sequence], active: list[int], logits: torch.Tensor,
              state: dict[str, Draft]) -> None:
        """Each active request's next draft from its MTP logits: argmax, or a draw kept with its q."""
        params = [drafting[i].params for i in active]
        probs = probabilities(logits, params) if any(not p.greedy for p in params) else None
        tokens = logits.argmax(-1).tolist()
        for j, i in enumerate(active):
            seq, d = drafting[i], state[drafting[i].request_id]
            if seq.params.greedy:
                d.tokens.append(tokens[j])
            else:
                d.probs.append(probs[j])
                d.tokens.append(_draw_one(probs[j], seq.generator))

    def dummy(self, forwards: int) -> None:
        """MTP forwards of one token in the scratch block: a lock-step rank with nothing to draft still
        enters the MTP block's collectives (EP all-to-all) as often as the ranks that draft."""
        engine = self.engine
        for _ in range(forwards):
            fb = engine.dummy_batch()
            engine.model.forward_mtp(fb, engine.kv, torch.zeros(1, engine.model_config.hidden_size,
                                                                dtype=engine.dtype, device=engine.device))

    def _budget(self, seq: Sequence) -> int:
        """Drafts worth making: never past max_tokens or the model's context."""
        left = min(seq.params.max_tokens - len(seq.output_token_ids), self.engine.max_model_len - seq.num_tokens)
        return max(0, min(self.k, left - 1))


def _draw_one(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    cdf = weights.float().cumsum(-1)
    u = torch.rand((), generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u.view(1), right=True).clamp_(max=weights.shape[-1] - 1))


def stats_table(stats: SpecStats, k: int) -> str:
    rates = ", ".join(f"{r:.2f}" for r in stats.acceptance()[:k])
    return f"drafted {stats.drafted[:k]}, accepted {stats.accepted[:k]}, acceptance per position [{rates}]"


__all__ = ["MAX_SPECULATIVE_TOKENS", "CatchUp", "Draft", "MtpSpeculator", "SamplingParams", "SpecStats", "stats_table"]
