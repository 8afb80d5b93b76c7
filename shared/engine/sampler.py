"""Token sampling: greedy, temperature, top-k, top-p, min-p, with optional per-request seeds, after the
logits processors (logit bias, min_tokens, repetition / frequency / presence penalties), all batched.

Order, as vLLM's: logit_bias → min_tokens → repetition, frequency and presence penalties on the model's
logits (greedy rows take the argmax of these) → temperature → min_p → top-k → top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from shared.model import ops
from shared.protocol.sampling import SamplingParams, TokenLogprob

# Top-p rows first look for their nucleus among this many best tokens (exact when it lies inside,
# which it does for any trained model's distribution); rows whose nucleus is wider are sorted whole.
NUCLEUS_CANDIDATES = 1024


class TokenHistory(Protocol):
    """What the penalties read of a request (shared.engine.scheduler.Sequence)."""

    output_token_ids: list[int]

    @property
    def unique_prompt_ids(self) -> torch.Tensor: ...


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: Sequence[TokenHistory] | None = None, eos_token_ids: Sequence[int] = ()) -> list[int]:
    """One token per row of `logits` [M, V] (fp32), every row in one batched pass: the logits processors
    first (rows whose params ask for them; `histories` gives their tokens so far); greedy rows take the
    argmax; sampled rows apply temperature, min-p, top-k then top-p (on the top-k renormalized
    distribution) and draw by inverse CDF with one uniform from their own generator (a seeded request
    replays)."""
    processed = histories is not None and any(p.processes_logits for p in params)
    if not processed and all(p.greedy for p in params):
        tokens = ops.greedy_tokens(logits)  # one pass where the kernels run and every logit is finite
        if tokens is not None:
            return tokens
    logits = _sanitize(logits)
    if processed:
        logits = process_logits(logits, params, histories, eos_token_ids)
    out = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        picked = [params[i] for i in rows]
        x = logits[index]
        if any(p.min_p for p in picked):
            x = _min_p(x, picked)
        chosen = _sample_rows(x, picked, [generators[i] for i in rows])
        out[index] = chosen
    return out.tolist()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability under the model's raw distribution (log-softmax of
    `logits` [M, V], before any processor or temperature) and its `top[i]` best tokens, in one pass."""
    logp = _sanitize(logits.float()).log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    k = max(top, default=0)
    vals, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    vals, ids = vals.tolist(), ids.tolist()
    return [TokenLogprob(t, lp, ids[i][: top[i]], vals[i][: top[i]]) for i, (t, lp) in enumerate(zip(tokens, chosen))]


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories: Sequence[TokenHistory],
                   eos_token_ids: Sequence[int]) -> torch.Tensor:
    """The logits after each row's logit_bias, min_tokens mask and repetition / frequency / presence
    penalties, as sparse batched updates (index lists over the rows' tokens, one scatter each)."""
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[1]

    def put(rows: list[int], tokens: list[int], values: torch.Tensor | float, accumulate: bool) -> None:
        if rows:
            index = (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev))
            vals = values if isinstance(values, torch.Tensor) else torch.full((len(rows),), values, device=dev)
            logits.index_put_(index, vals, accumulate=accumulate)

    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
    put([r for r, _, _ in bias], [t for _, t, _ in bias], torch.tensor([b for _, _, b in bias], device=dev), True)
    masked = [(i, t) for i, p in enumerate(params) if len(histories[i].output_token_ids) < p.min_tokens
              for t in dict.fromkeys([*eos_token_ids, *p.stop_token_ids])]
    put([r for r, _ in masked], [t for _, t in masked], float("-inf"), False)
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if repeat:  # each row's distinct prompt + output tokens: tensor ops, not a Python pass over the context
        seen = [torch.cat([histories[i].unique_prompt_ids, torch.tensor(histories[i].output_token_ids,
                                                                        dtype=torch.long)]).unique() for i in repeat]
        rows = torch.cat([torch.full((len(s),), i) for i, s in zip(repeat, seen)]).to(dev)
        tokens = torch.cat(seen).to(dev)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)[rows]
        x = logits[rows, tokens]
        logits[rows, tokens] = torch.where(x > 0, x / penalty, x * penalty)
    said = [(i, t) for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty
            for t in histories[i].output_token_ids]
    if said:
        keys = torch.tensor([r * vocab + t for r, t in said], device=dev)
        keys, counts = keys.unique(return_counts=True)
        rows, tokens = keys // vocab, keys % vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[rows]
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)[rows]
        logits.index_put_((rows, tokens), -(freq * counts + pres), accumulate=True)
    return logits


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens whose probability (after temperature) is below min_p × the most likely one's: in logit
    space, below the row's max + T·log(min_p)."""
    t = torch.tensor([p.temperature for p in params], device=logits.device)
    floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=logits.device)
    keep = logits >= logits.max(-1, keepdim=True).values + (t * floor)[:, None]
    return logits.masked_fill(~keep, float("-inf"))


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row's sampling draws from [M, V] fp32 (temperature, then top-k, then top-p on
    the top-k renormalized distribution, as `sample`), dense: speculative verification compares the
    target's and the draft's probabilities of the same tokens. Greedy rows are one-hot on the argmax."""
    logits = _sanitize(logits.float())
    m, vocab = logits.shape
    out = torch.zeros_like(logits)
    for i, p in enumerate(params):
        if p.greedy:
            out[i, logits[i].argmax()] = 1.0
            continue
        x = logits[i] / p.temperature
        vals, ids = x.sort(descending=True)
        if 0 < p.top_k < vocab:
            vals[p.top_k :] = float("-inf")
        probs = vals.softmax(-1)
        if p.top_p < 1:
            before = probs.cumsum(-1) - probs
            probs = probs * (before < p.top_p)
            probs = probs / probs.sum()
        out[i, ids] = probs
    return out


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 ) -> torch.Tensor:
    m, vocab = logits.shape
    dev = logits.device
    x = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    u = _uniforms(generators).to(dev)
    if bool((top_k == vocab).all() and (top_p >= 1).all()):  # plain temperature: the whole vocabulary
        return _draw(x.softmax(-1), u)

    width = int(min(vocab, max(int(top_k[top_k < vocab].max()) if (top_k < vocab).any() else 0,
                               NUCLEUS_CANDIDATES if (top_p < 1).any() else 0)))
    vals, ids = x.topk(width, dim=-1)  # sorted, best first
    ranks = torch.arange(width, device=dev)
    vals = vals.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    # probabilities relative to the top-k-filtered distribution (the whole vocabulary when top-k is off)
    norm = torch.logsumexp(vals, -1, keepdim=True)
    untruncated = top_k == vocab
    if bool(untruncated.any()):  # a full-vocabulary pass only for rows without top-k
        full_lse = torch.logsumexp(x, -1, keepdim=True)
        norm = torch.where(untruncated[:, None], full_lse, norm)
    probs = torch.exp(vals - norm)
    before = probs.cumsum(-1) - probs
    wide = (top_p < 1) & untruncated & (before[:, -1] + probs[:, -1] < top_p)
    keep = before < top_p[:, None]  # drop a token once the mass before it reaches top_p (the first stays)
    picks = ids.gather(1, _draw(probs * keep, u)[:, None]).squeeze(1)
    if bool(wide.any()):  # nucleus wider than the candidates: sort those rows whole
        w = wide.nonzero().squeeze(1)
        sorted_x, order = x[w].sort(-1, descending=True)
        p_all = (sorted_x - full_lse[w]).exp()
        before_all = p_all.cumsum(-1) - p_all
        picks[w] = order.gather(1, _draw(p_all * (before_all < top_p[w, None]), u[w])[:, None]).squeeze(1)
    return picks


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """NaN → -inf, +inf → the largest float, and a row with no finite logit becomes uniform: a broken
    row yields some token instead of failing the batch it is in."""
    if bool(torch.isfinite(logits).all()):
        return logits
    x = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    dead = ~torch.isfinite(x).any(-1)
    x[dead] = 0.0
    return x


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform per row: rows sharing a generator (every unseeded row shares the engine's) draw in
    one call, in row order; a seeded request's own generator gives the same draws wherever it runs."""
    u = torch.empty(len(generators))
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(generators):
        groups.setdefault(id(g), []).append(i)
    for rows in groups.values():
        u[rows] = torch.rand(len(rows), generator=generators[rows[0]])
    return u


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first index whose cumulative weight exceeds u · total."""
    cdf = weights.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return idx.clamp_(max=weights.shape[-1] - 1)
