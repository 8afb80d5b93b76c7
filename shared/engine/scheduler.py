"""Continuous batching with chunked prefill over the paged KV cache.

Every request is a token list (prompt, then generated tokens) with a count of tokens whose KV is
already cached. A step feeds each scheduled request its next uncached tokens: a prompt chunk during
prefill, one token during decode. Every step has one token budget, `max_num_batched_tokens` (as in
vLLM v1): each running decode gets its token first, then chunks of prompts (running ones first, then
new ones) fill what is left, all in one forward, so a long prompt never stalls the decodes. When a
decode runs out of blocks the newest request is preempted (its blocks freed, recomputed later).

With prefix caching a request admitted from the queue first claims the cached blocks of its longest
cached prefix (matched by a chain of block hashes, see BlockAllocator) and computes only the rest;
every block it completes is registered for later requests.

Blocks come and go through the rank's BlockLedger (shared.kvcache.ledger): the scheduler names each
hand-off (grow, prefix retain / release, preempt, finish) and tells the ledger's debug check which
blocks its sequences hold.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from shared.engine.sampler import SamplingParams
from shared.engine.structured import GrammarState
from shared.kvcache import BlockLedger, Holder, Holding, Owner
from shared.protocol.finish import FinishReason
from shared.protocol.limits import blocks_for
from shared.protocol.prefix import block_hash, salt_root
from shared.protocol.sampling import TokenLogprob

PROMPT_LOGPROBS_CHUNK_TOKENS = 256  # see _chunk_cap


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, with params.logprobs
    # with params.prompt_logprobs: entry i is prompt token i + 1's (the first token has no context)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    grammar: GrammarState | None = None  # with params.structured: where the output is in its constraint
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the pool
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    order: int = field(default_factory=lambda: next(_ids))
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_registered: int = 0  # leading blocks of block_table already in the prefix cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_host_cached_prompt_tokens: int = 0  # of those, read back from the second KV tier (shared.kvcache.tier)
    priority: int = 0  # lower is served first (vLLM's convention); equal priorities first come, first served
    cache_salt: str = ""  # a tenant's: its prefix-cache keys chain from the salt (shared.protocol.prefix)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @functools.cached_property
    def unique_prompt_ids(self) -> torch.Tensor:
        """The prompt's distinct token ids, once per request (repetition_penalty reads them every step)."""
        return torch.tensor(self.prompt_token_ids).unique()

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating prompt and outputs (a decode step reads one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncached(self) -> int:
        return self.num_tokens - self.num_cached

    def generated_from(self, start: int) -> bool:
        """Whether tokens from position `start` on are all past the prompt (what a step marks as
        SeqChunk.generated: the rows the CPU kernels take)."""
        return start >= len(self.prompt_token_ids)

    def wants_prompt_logprobs(self, start: int) -> bool:
        """A chunk from position `start` needs the logits of all its tokens: the request asked for prompt
        logprobs and those from `start` on are not known yet (a recompute after preemption has them)."""
        return (self.params.prompt_logprobs is not None and start < len(self.prompt_token_ids) - 1
                and len(self.prompt_logprobs) >= start)

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncached > 1 or not self.output_token_ids


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int
    completes: bool = field(init=False)  # after it every token is cached: the step samples a token

    def __post_init__(self) -> None:
        self.completes = self.seq.num_cached + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, ledger: BlockLedger, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False):
        self.ledger, self.block_size = ledger, block_size
        self.prefix_caching = prefix_caching
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.decode_width = 1  # tokens a decode takes from the budget (1 + drafts under speculative decoding)
        self.cache_prompt_only = False  # register only blocks wholly inside prompts (a decode instance's cache)
        ledger.watch(self)

    def add(self, seq: Sequence) -> None:
        """Queue a request behind every waiting one of the same or a more urgent (lower) priority."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        self.waiting.insert(next(i for i, w in enumerate(self.waiting) if w.priority > seq.priority), seq)

    def add_running(self, seq: Sequence) -> None:
        """A request whose KV is already in the pool (pushed by a prefill instance): decode next."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` (False: the pool cannot)."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.ledger.can_allocate(need):
            return False
        self.ledger.grow(seq, need)
        return True

    def schedule(self) -> list[ScheduledChunk]:
        """The next step: decodes first (oldest first), then prompt chunks, within one token budget."""
        self.ledger.settle()
        chunks = self._schedule_decode(self.max_num_batched_tokens)
        prefill = self._schedule_prefill(self.max_num_batched_tokens - self.decode_width * len(chunks))
        # recomputed outputs beside the decodes: a step lists its generated chunks first (ForwardBatch.generated)
        prefill.sort(key=lambda c: not c.seq.generated_from(c.seq.num_cached))
        return chunks + prefill

    def _schedule_prefill(self, budget: int) -> list[ScheduledChunk]:
        chunks = []
        for seq in sorted((s for s in self.running if s.is_prefilling and s.num_uncached > 0), key=_urgency):
            n = min(seq.num_uncached, budget, _chunk_cap(seq))
            if n <= 0 or not self.ensure_blocks(seq, seq.num_cached + n):
                break
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs need every prompt position's logits: such a request computes its whole prompt
            claimed = self.prefix_caching and not seq.block_table and seq.params.prompt_logprobs is None
            if claimed:
                self._claim_prefix(seq)
            n = min(seq.num_uncached, budget, _chunk_cap(seq))
            if not self.ensure_blocks(seq, seq.num_cached + n):
                if claimed:  # not admitted now: its hits are looked up again next time
                    self._release_prefix(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def _schedule_decode(self, budget: int) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        for seq in sorted((s for s in self.running if not s.is_prefilling), key=_urgency):
            if (len(chunks) + 1) * self.decode_width > budget and chunks:
                break
            while seq.status is Status.RUNNING and not self.ensure_blocks(seq, seq.num_tokens):
                self.preempt(max(self.running, key=_urgency))  # the least urgent, newest first
            if seq.status is Status.RUNNING:
                chunks.append(ScheduledChunk(seq, seq.num_uncached))
        return chunks

    def block_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of the request's first `num_blocks` full blocks."""
        return self._hashes(seq, num_blocks)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of the request's first `num_blocks` full blocks (computed once), chained
        from its cache_salt's root (shared.protocol.prefix.prompt_block_hashes, the router's, is the same)."""
        bs, tokens = self.block_size, None
        while len(seq.block_hashes) < num_blocks:
            tokens = tokens or seq.all_token_ids
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else salt_root(seq.cache_salt)
            seq.block_hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs]))
        return seq.block_hashes[:num_blocks]

    def _claim_prefix(self, seq: Sequence) -> None:
        """Start a queued request on the cached blocks of its longest cached prefix; at least one
        token is always left to compute (its logits give the next token)."""
        hits = self.ledger.retain_prefix(seq, self._hashes(seq, (seq.num_tokens - 1) // self.block_size))
        seq.num_registered = hits
        seq.num_cached = hits * self.block_size
        if not seq.output_token_ids:
            seq.num_cached_prompt_tokens = seq.num_cached
            seq.num_host_cached_prompt_tokens = self.ledger.last_restored * self.block_size

    def _release_prefix(self, seq: Sequence) -> None:
        self.ledger.release_prefix(seq)
        seq.num_cached, seq.num_registered = 0, 0

    def cache_computed(self, seq: Sequence) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        full = seq.num_cached // self.block_size
        if self.cache_prompt_only:
            full = min(full, len(seq.prompt_token_ids) // self.block_size)
        if full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered, full):
            self.ledger.register(seq.block_table[i], hashes[i])
        seq.num_registered = full

    def preempt(self, seq: Sequence) -> None:
        """Free the request's blocks; it re-enters the queue and recomputes prompt + outputs."""
        self.running.remove(seq)
        self.ledger.preempt(seq)
        seq.num_cached, seq.num_registered, seq.status = 0, 0, Status.WAITING
        # first among the waiting requests of its priority (it had started), behind more urgent ones
        self.waiting.insert(next((i for i, w in enumerate(self.waiting) if w.priority >= seq.priority),
                                 len(self.waiting)), seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free its blocks (finish, abort, cancel: all end here)."""
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.ledger.finish(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason


    def holdings(self) -> list[Holding]:
        """The blocks each queued or running request holds (the ledger's debug check)."""
        return [Holding(Holder(Owner.SEQUENCE, seq.request_id), seq.block_table)
                for seq in [*self.running, *self.waiting] if seq.block_table]


def _chunk_cap(seq: Sequence) -> int:
    """The most tokens one step may compute of the request: a prompt-logprobs chunk takes logits rows of
    the whole vocabulary per token (129,280 fp32 values, 0.5 MB, at DeepSeek's), so it is bounded. A
    request that recomputes its outputs (preempted, or migrated from a failed instance) computes its prompt
    first, then its outputs as generated rows, which take the CPU kernels their decode steps took: their
    KV rows and the next token are the ones the request would have had, not a prompt row's near miss."""
    start, prompt = seq.num_cached, len(seq.prompt_token_ids)
    cap = PROMPT_LOGPROBS_CHUNK_TOKENS if seq.wants_prompt_logprobs(start) else seq.num_uncached
    return min(cap, prompt - start) if start < prompt < seq.num_tokens else cap


def _urgency(seq: Sequence) -> tuple[int, int]:
    """Sort key: more urgent (lower priority value), then older, first."""
    return seq.priority, seq.order
