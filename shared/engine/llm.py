"""Offline engine: `LLM(path).generate(prompts, SamplingParams(...))`, and the step loop services use.

    from shared.engine import LLM, SamplingParams
    llm = LLM("path/to/ckpt", dtype="float32")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=20, temperature=0.0))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import shared.model.cpu_kernels as cpu_kernels
import shared.model.int8_kernels as int8_kernels
from shared.config import EngineConfig
from shared.device import cache_dtype, get_device
from shared.engine.graphs import DecodeGraphs
from shared.engine.isolation import IsolatedStep, isolate
from shared.engine.policy import policy_for
from shared.engine.sampler import SamplingParams, sample
from shared.engine.scheduler import ScheduledChunk, Scheduler, Sequence, Status
from shared.engine.speculative import CatchUp, Draft, MtpSpeculator
from shared.engine.step import (
    Committed,
    Computed,
    Fault,
    Poison,
    StepEvent,
    StepObserver,
    mask_verification,
    note_logprobs,
    note_prompt_logprobs,
)
from shared.engine.structured import Grammars, MaskRow
from shared.kvcache import KVCache, KVLayout
from shared.loader import load_model
from shared.model import SeqChunk
from shared.model.offload import parse_layers
from shared.parallel.state import ParallelState
from shared.protocol.chat import THINK_END, ChatMessage, render_messages
from shared.protocol.finish import FinishReason, wire
from shared.protocol.limits import RequestLimits
from shared.protocol.sampling import TokenLogprob
from shared.protocol.structured import ConstraintCompiler
from shared.protocol.tokenizer import OutputProcessor, Tokenizer
from shared.transfer.mooncake_store import shared_tier_store


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # the offline API's word for the engine's FinishReason (None: not finished)
    logprobs: list[TokenLogprob] | None = None  # one per token, with params.logprobs
    # with params.prompt_logprobs: one per prompt token, None for the first (it has no context)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    """Model + KV cache + scheduler + sampler; `step()` advances every running request by one step.
    `parallel` places the model on this rank's share (EP experts, TP shards, layer sharding), and
    picks the step policy of the instance's shape (shared.engine.policy)."""

    def __init__(self, config: EngineConfig, parallel: ParallelState | None = None):
        self.config = config
        self.parallel = parallel or ParallelState.single()
        self.policy = policy_for(self.parallel)
        self.device = get_device(config.device)
        mtp = config.speculative == "mtp"
        self.model, self.load_report = load_model(config.model, config.dtype, str(self.device),
                                                  config.indexer_numerics, progress=config.progress,
                                                  parallel=self.parallel, quantization=config.quantization,
                                                  share_weights_dir=config.share_weights_dir, mtp=mtp)
        self.model_config = self.model.config
        self.dtype = self.model.dtype
        self.expand_from = self.model.expand_from()  # steps' parts split there (ForwardBatch.build)
        if config.offload_layers:
            self.model.enable_offload(parse_layers(config.offload_layers, self.model_config.num_hidden_layers),
                                      config.offload_buffers)
        if config.compile:
            self.model.compile_token_parts()
        self.tokenizer = Tokenizer.from_model_dir(config.model, self.model_config.bos_token_id)
        compiler = ConstraintCompiler(self.tokenizer.path if self.tokenizer else None, self.model_config.vocab_size,
                                      list(self.model_config.eos_token_ids))
        self.grammars = Grammars(compiler, self.tokenizer.token_to_id(THINK_END) if self.tokenizer else None)
        kv_dtype = cache_dtype(self.dtype, self.device)  # bf16 rows for a bf16 model on any CPU
        self.layout = KVLayout.from_model_config(self.model_config, config.block_size, kv_dtype,
                                                 kv_cache_dtype=config.kv_cache_dtype, extra_layers=int(mtp))
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_tokens // config.block_size)
        self.kv = KVCache(self.layout, num_blocks, self.device)
        if config.kv_tier_tokens and not self.policy.mirror:  # mirrored ranks must restore alike: no tier there
            self.kv.attach_tier(config.kv_tier_tokens, config.kv_tier_dir, shared_tier_store(config, self.layout))
        self.scheduler = Scheduler(self.kv.ledger, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_caching)
        self.speculator = MtpSpeculator(self, config.num_speculative_tokens, config.speculative_max_draft_tokens,
                                        config.speculative_tuning) if mtp else None
        self.scheduler.decode_width = 1 + (config.num_speculative_tokens if mtp else 0)  # drafts take budget
        self._requests: dict[str, Sequence] = {}
        self._counter = itertools.count()
        self.default_generator = torch.Generator().manual_seed(config.seed)
        # a scratch block for parallel ranks' dummy batches (DP idle ranks, empty CP shares)
        self.scratch_blocks: list[int] | None = self.kv.ledger.hold_scratch() if self.parallel.is_parallel else None
        self.graphs = DecodeGraphs.for_engine(self)  # recorded decode steps (CPU; not on CP ranks)
        self.stepped = False  # whether the last step() ran a forward (a dummy one included)
        self.poison = Poison.from_env()  # fault injection for tests (off unless $PDSERVE_FAULT_POISON is set)
        int8 = any(p.dtype == torch.int8 for p in self.model.parameters())  # W8A8 weights take the int8 kernels
        self.kernel_build_seconds = cpu_kernels.prepare(self.model, *([int8_kernels.library] if int8 else []))
        self.gemm_warm_seconds = self.model.warm_host_gemms()  # parallel ranks too: no collective in it
        if not self.parallel.is_parallel:
            self.warm_up()

    def warm_up(self, prompt_tokens: int = 16, new_tokens: int = 3) -> None:
        """One short greedy request through this engine's step (a prompt chunk, then decode steps, with MTP
        drafts where configured) before it serves, and nothing of it kept: its blocks freed, its prefix
        forgotten, no request id or random draw taken. The first calls of a step's ops (oneDNN primitives, lazy
        initialisation) made the first requests' TTFT about 2× a warm one's in-process (demo model, four
        prompts: 37 vs 17 ms; 27-30 ms after a warm-up: the rest is per shape, each new token count's
        matmuls). Parallel ranks skip it: their steps are collective, entered only with the whole instance."""
        n = min(prompt_tokens, self.usable_blocks * self.layout.block_size - new_tokens - 1,
                self.max_model_len - new_tokens - 1)
        if n < 1 or self.has_work:
            return
        seq = self.make_sequence([1 + t % (self.model_config.vocab_size - 1) for t in range(n)],
                                 SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                                 request_id="warm-up")
        self.scheduler.add(seq)
        while self.has_work:
            self.step()
        self.kv.allocator.reset_prefix_cache()
        if self.speculator is not None:
            self.speculator.reset()

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask of this engine: the model's context and vocabulary, a rank's KV pool."""
        return RequestLimits(self.max_model_len, self.model_config.vocab_size, self.layout.block_size,
                             self.usable_blocks, speculative=self.speculator is not None)

    @property
    def usable_blocks(self) -> int:
        """KV blocks requests can use (the pool minus the scratch block of a parallel rank)."""
        return self.kv.num_blocks - (1 if self.scratch_blocks else 0)

    @property
    def workspace_bytes(self) -> int:
        return self.config.attention_workspace_mb << 20

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json; pass prompt_token_ids")
        return self.tokenizer.encode(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, num_resumed: int = 0,
                 cache_salt: str = "") -> None:
        """Raise ValueError naming the offending field (what a front checks once per request)."""
        params.validate()
        self.limits.check_request(prompt_token_ids, params, num_resumed, cache_salt)

    def make_sequence(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str | None = None, priority: int = 0, num_resumed: int = 0,
                      cache_salt: str = "") -> Sequence:
        """A request its front validated (`validate`; the services' gRPC fronts, `add_request` offline): not
        checked again here; ValueError only for what needs the engine (a request id in flight, a constraint
        that does not compile). `num_resumed`: the last tokens of `prompt_token_ids` are the request's own
        outputs from an instance that failed (the router migrated it): they count as generated — toward
        max_tokens, min_tokens, the penalties and the grammar — and a seeded request's generator skips the
        draws they took, so its random stream goes on where it stopped. `cache_salt`: its prefix-cache
        namespace (only requests with the same salt share cached blocks)."""
        rid = request_id or f"req-{next(self._counter)}"
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in flight")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else self.default_generator
        grammar = self.grammars.start(params.structured) if params.structured is not None else None
        split = len(prompt_token_ids) - num_resumed
        seq = Sequence(rid, list(prompt_token_ids[:split]), params, output_token_ids=list(prompt_token_ids[split:]),
                       generator=gen, priority=priority, grammar=grammar, cache_salt=cache_salt)
        if params.seed is not None and not params.greedy:
            for _ in range(num_resumed):  # one uniform per sampled token (shared.engine.sampler._uniforms)
                torch.rand(1, generator=gen)
        for token in seq.output_token_ids if grammar is not None else ():
            grammar.advance(token)
        self._requests[rid] = seq
        return seq

    def output_processor(self, params: SamplingParams) -> OutputProcessor:
        """Text deltas and stop strings for one request, for whichever thread consumes its tokens."""
        return OutputProcessor(self.tokenizer, params.stop, params.skip_special_tokens)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0, num_resumed: int = 0,
                    cache_salt: str = "") -> Sequence:
        """Queue a request, validated (the offline API is its own front); a lower `priority` is scheduled
        first (waiting queue, prompt chunks, preemption last), as vLLM's priority scheduling. `num_resumed`,
        `cache_salt`: see make_sequence."""
        self.validate(prompt_token_ids, params, num_resumed, cache_salt)
        seq = self.make_sequence(prompt_token_ids, params, request_id, priority, num_resumed, cache_salt)
        self.scheduler.add(seq)
        return seq

    def add_prefilled(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None = None,
                      ) -> list[StepEvent]:
        """Admit a request whose KV is already in its blocks (disaggregated decode: its prompt's, and a migrated
        request's earlier outputs', all pushed); the prefill's first token (and its logprob, when asked for)."""
        seq.num_cached = seq.num_tokens
        if first_logprob is not None:
            seq.logprobs.append(first_logprob)
        events = self.append_token(seq, first_token)
        if seq.status is not Status.FINISHED:
            self.scheduler.add_running(seq)
        return events

    def abort(self, request_id: str) -> FinishReason | None:
        """End a request its caller let go (cancel, deadline, drain): ABORT. The reason it ended with
        (None: it was not here)."""
        return self._end(request_id, FinishReason.ABORT)

    def fail(self, request_id: str) -> FinishReason | None:
        """End a request the engine failed (it alone failed a step, or its step could not be committed): ERROR."""
        return self._end(request_id, FinishReason.ERROR)

    def stop_string_found(self, request_id: str) -> FinishReason | None:
        """End a request whose consumer found one of its stop strings in its text (an OutputProcessor, off
        the engine thread): STOP, as a stop token would."""
        return self._end(request_id, FinishReason.STOP)

    def _end(self, request_id: str, reason: FinishReason) -> FinishReason | None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        return seq.finish_reason

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def run_chunks(self, chunks: list[ScheduledChunk], layer_done: Callable[[int], None] | None = None
                   ) -> torch.Tensor:
        """Forward the scheduled chunks without sampling (KV written to their blocks, `num_cached`
        advanced, completed blocks registered); the completing chunks' logits. A tool for checks that
        compute a schedule by hand: serving steps go through `step_chunks`."""
        logits = self.policy.forward(self, [self._seq_chunk(c) for c in chunks], layer_done)
        for c in chunks:
            c.seq.num_cached += c.num_tokens
        self._register([c.seq for c in chunks])
        return logits

    def sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[int]:
        done = [c.seq for c in chunks if c.completes]
        self.grammars.mask(logits, [MaskRow(s.grammar, i) for i, s in enumerate(done) if s.grammar is not None])
        return sample(logits, [s.params for s in done], [s.generator for s in done], done,
                      () if all(s.params.ignore_eos for s in done) else self.model_config.eos_token_ids)

    def step(self, observer: StepObserver | None = None) -> list[StepEvent]:
        """One step of this rank (every rank of a parallel instance calls it together): schedule, then
        the step body (`step_chunks`), or a dummy forward where the policy needs this rank to take part."""
        chunks = self._schedule()
        return self.step_chunks(chunks, observer) if chunks else []

    def step_isolated(self, observer: StepObserver | None = None) -> IsolatedStep:
        """`step` where a failing compute fails only the requests that cause it (shared.engine.isolation):
        the step's events, and the requests it failed (already aborted here). One rank only: a parallel
        instance's ranks could not retry their collectives apart."""
        chunks = self._schedule()
        return isolate(self, chunks, observer) if chunks else IsolatedStep()

    def _schedule(self) -> list[ScheduledChunk]:
        """This step's chunks ([]: none; a dummy forward has run where the policy wants this rank in it)."""
        self.stepped = False
        chunks = self.scheduler.schedule() if self.has_work else []
        if not self.policy.wants_step(bool(chunks)):
            return []
        self.stepped = True
        if not chunks:
            self.dummy_step()
        return chunks

    def dummy_step(self) -> None:
        """A one-token forward into a scratch block, for a parallel rank with nothing to do: every
        rank must enter the same collectives (EP all-to-all, layer-sharding broadcasts) each step."""
        tokens = 1 + (self.speculator.k if self.speculator is not None else 0)  # a drafting rank's verification
        self.policy.forward(self, [self.dummy_chunk(tokens)], return_hidden=tokens > 1)  # (DP ranks may replay it)
        if self.speculator is not None:  # and the MTP forwards a drafting rank runs
            self.speculator.dummy(self.speculator.k)

    def dummy_chunk(self, tokens: int = 1) -> SeqChunk:
        """Generated tokens from position 0 of the scratch block, each with logits (all dropped)."""
        self.scratch_blocks = self.scratch_blocks or self.kv.ledger.hold_scratch()
        tokens = min(tokens, len(self.scratch_blocks) * self.layout.block_size)
        return SeqChunk([0] * tokens, 0, self.scratch_blocks, num_logits=tokens, generated=True)

    def step_chunks(self, chunks: list[ScheduledChunk], observer: StepObserver | None = None) -> list[StepEvent]:
        """The one step body, whatever the service or shape: forward → sample → append.

        The policy (shared.engine.policy) says how the ranks forward together; the speculator (MTP) adds
        each decode's drafts to the forward, verifies them instead of sampling, and catches its own layer
        up over the positions the step made final; the observer (prefill) plans its pushes, gets every
        layer as it is computed and the finished requests before their blocks are freed. A request whose
        token cannot be recorded raises here after the others' are (step_isolated fails it alone)."""
        if not chunks:
            return []
        done = self.commit_chunks(self.compute_chunks(chunks, observer), observer)
        if done.faults:
            raise done.faults[0].error
        return done.events

    def compute_chunks(self, chunks: list[ScheduledChunk], observer: StepObserver | None = None) -> Computed:
        """The step's forward, then its sampling (or MTP verification). A raise leaves the drafts where they
        were and nothing committed (see shared.engine.step)."""
        if observer is not None:
            observer.scheduled(chunks)
        layer_done = observer.layer_done if observer is not None else None
        spec = self.speculator
        drafts = spec.take_drafts(chunks) if spec is not None else [None] * len(chunks)
        try:
            batch = [self._seq_chunk(c, d) for c, d in zip(chunks, drafts, strict=True)]
            if self.poison is not None:
                self.poison.check(chunks)
            if spec is not None:
                logits, hidden = self.policy.forward(self, batch, layer_done, return_hidden=True)
                mask_verification(self.grammars, chunks, drafts, logits)
                return Computed(chunks, drafts, batch, [c.seq.num_cached for c in chunks],
                                spec.verify(chunks, drafts, logits), hidden)
            logits = self.policy.forward(self, batch, layer_done)
            if any(sc.num_logits > 1 for sc in batch):  # prompt-logprobs chunks: logits of every token
                logits = note_prompt_logprobs(chunks, batch, logits)
            tokens = self.sample(chunks, logits)
            note_logprobs([c.seq for c in chunks if c.completes], logits, tokens)
        except BaseException:
            if spec is not None:  # still valid: nothing moved
                spec.drafts.update({c.seq.request_id: d for c, d in zip(chunks, drafts, strict=True) if d})
            raise
        return Computed(chunks, drafts, batch, [c.seq.num_cached for c in chunks], [[t] for t in tokens])

    def commit_chunks(self, step: Computed, observer: StepObserver | None = None) -> Committed:
        """Append the computed tokens, finish the requests that stop, catch the MTP layer up, tell the
        observer. A request whose token cannot be recorded fails alone (Committed.faults; the caller
        aborts it), its tokens of this step dropped."""
        chunks, spec = step.chunks, self.speculator
        new_tokens = iter(step.sampled)
        per_chunk = [next(new_tokens) if c.completes else [] for c in chunks]
        for c, start, tokens in zip(chunks, step.starts, per_chunk, strict=True):
            c.seq.num_cached = start + c.num_tokens + max(len(tokens) - 1, 0)  # accepted drafts are cached
        if spec is None:
            self._register([c.seq for c in chunks])
        # A finished request's blocks are freed at once, unless an observer takes its KV (a prefill
        # pushes it, the MTP layer's rows too): then once the observer has seen it.
        keep = observer is not None
        out, finished = Committed(), []
        for c, tokens in zip(chunks, per_chunk, strict=True):
            mine = []
            try:
                for token in tokens:
                    mine.append(self._record_token(c.seq, token, retire=not keep))
                    if mine[-1].finished:
                        finished.append(c.seq)
                        break
            except Exception as exc:  # this request's alone: the others' tokens stand
                out.faults.append(Fault(c.seq, exc))
                continue
            out.events += mine
        if spec is not None:
            failed = {id(f.seq) for f in out.faults}
            entries, offset = [], 0
            for c, sc, start in zip(chunks, step.batch, step.starts, strict=True):
                done = c.seq.finish_reason is not None
                if (keep or not done) and id(c.seq) not in failed:
                    entries.append(CatchUp(c.seq, start, offset, drafts=not done))
                offset += len(sc.token_ids)
            spec.catch_up(entries, step.hidden)
            if observer is not None:
                observer.layer_done(self.model_config.num_hidden_layers)  # the MTP layer's rows of these blocks
            self._register([e.seq for e in entries])  # once final and their MTP rows written
        if observer is not None and finished:
            observer.finished(finished)
        for seq in finished if keep else []:
            self._retire(seq)
        return out

    def has_request(self, request_id: str) -> bool:
        """The request is queued or running here (not finished, not aborted)."""
        return request_id in self._requests

    def _seq_chunk(self, c: ScheduledChunk, draft: Draft | None = None) -> SeqChunk:
        """A scheduled chunk as the model takes it: its next uncached tokens (and drafts to verify)."""
        seq, start = c.seq, c.seq.num_cached
        tokens = seq.token_slice(start, start + c.num_tokens) + (draft.tokens if draft else [])
        if seq.wants_prompt_logprobs(start):  # every token's next-token logits (never with a draft: MTP refuses)
            return SeqChunk(tokens, start, seq.block_table, num_logits=len(tokens))
        return SeqChunk(tokens, start, seq.block_table, need_logits=c.completes,
                        num_logits=1 + len(draft.tokens) if draft else 1, generated=seq.generated_from(start))

    def _register(self, seqs: list[Sequence]) -> None:
        """Register the requests' newly completed blocks in the prefix cache."""
        if self.scheduler.prefix_caching:
            for seq in seqs:
                self.scheduler.cache_computed(seq)

    def append_token(self, seq: Sequence, token: int) -> list[StepEvent]:
        """Add a token outside a step (a prefilled request's first); a stop finishes the request."""
        return [self._record_token(seq, token, retire=True)]

    def _record_token(self, seq: Sequence, token: int, retire: bool) -> StepEvent:
        """Append a token; on a stop the request finishes (its blocks freed now with `retire`, else by
        the caller's `_retire` once done with them)."""
        seq.output_token_ids.append(token)
        reason = self._finish_reason(seq)
        if reason is not None:
            seq.finish_reason = reason
            if retire:
                self._retire(seq)
        logprob = seq.logprobs[-1] if len(seq.logprobs) == len(seq.output_token_ids) else None
        return StepEvent(seq, token, reason is not None, logprob)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, seq.finish_reason or FinishReason.STOP)
        self._requests.pop(seq.request_id, None)

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        """Whether the token just appended ends the request, and why: the engine's one decision of a
        finish reason (the others: `abort`, `fail`, `stop_string_found`). Stop *strings* are found by the
        consumer's OutputProcessor, which calls `stop_string_found`."""
        token = seq.output_token_ids[-1]
        if seq.grammar is not None:
            completed = seq.grammar.advance(token)
            if seq.grammar.refused:  # a token its constraint refuses: the request cannot go on
                return FinishReason.ABORT
            if completed:
                return FinishReason.STOP
        p = seq.params
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            return FinishReason.STOP
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


class LLM:
    """Offline batch generation over LLMEngine (continuous batching inside)."""

    def __init__(self, model: str, parallel: ParallelState | None = None, **kwargs: object):
        """`kwargs`: EngineConfig's knobs (dtype, block_size, …), with its defaults."""
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), parallel)  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: list[list[int]] | list[str] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, cache_salt: str = "") -> list[RequestOutput]:
        """`cache_salt`: every prompt's prefix-cache namespace (see LLMEngine.make_sequence)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs, outputs = [], {}
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            seq = self.engine.add_request(ids, p, priority=priority[i] if priority else 0, cache_salt=cache_salt)
            seqs.append(seq)
            outputs[seq.request_id] = self.engine.output_processor(p)
        while self.engine.has_work:
            for ev in self.engine.step():
                out = outputs[ev.seq.request_id]
                out.process([ev.token_id])
                if out.stopped and not ev.finished:
                    self.engine.stop_string_found(ev.seq.request_id)
        return [
            RequestOutput(s.request_id, s.prompt_token_ids, list(s.output_token_ids),
                          outputs[s.request_id].text if self.engine.tokenizer else None, wire(s.finish_reason) or None,
                          list(s.logprobs) if s.params.logprobs is not None else None,
                          [None, *s.prompt_logprobs] if s.params.prompt_logprobs is not None else None)
            for s in seqs
        ]

    def chat(self, messages: list[ChatMessage] | list[dict], sampling_params: SamplingParams | None = None,
             thinking: bool = False) -> RequestOutput:
        """One conversation rendered with the DeepSeek-V3.2 chat encoding, then generated."""
        msgs = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
        return self.generate(render_messages(msgs, thinking), sampling_params)[0]

