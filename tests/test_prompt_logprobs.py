"""Prompt logprobs (what `echo` and lm-eval's loglikelihood read): each prompt token's log-softmax under
the model given the tokens before it, equal to transformers' full forward across chunk boundaries, with
a warm prefix cache, beside other requests in one step, and under context-parallel prefill."""

from __future__ import annotations

import pytest
import torch

from shared.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from shared.engine.scheduler import PROMPT_LOGPROBS_CHUNK_TOKENS
from shared.parallel import ParallelConfig, ParallelState
from tests.dist_utils import run_ranks
from tests.helpers import random_prompts

TOP = 3
ASK = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)


def _reference(path: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of every position [len(prompt), vocab] (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def _check(prompt: list[int], got: list, ref: torch.Tensor, atol: float = 1e-4) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i, lp in enumerate(got[1:], start=1):
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - ref[i - 1, prompt[i]].item()) <= atol, f"position {i}"
        assert len(lp.top_ids) == TOP and lp.top_ids[0] == ref[i - 1].argmax().item(), f"position {i}"
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_prompt_logprobs_equal_transformers_across_chunks_and_prefix_hits(ckpt):
    """A prompt longer than one prompt-logprobs chunk, on the sparse checkpoint with transformers' indexer
    numerics (its top-k past index_topk keys), then again with its prefix cached by a plain request."""
    path = str(ckpt("v32_sparse"))
    prompt = random_prompts(1, [PROMPT_LOGPROBS_CHUNK_TOKENS + 40], 512, seed=5)[0]
    other = random_prompts(1, [30], 512, seed=6)[0]
    ref = _reference(path, prompt)
    llm = LLM(path, dtype="float32", block_size=4, indexer_numerics="transformers")
    alone = llm.generate([other], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids
    llm.generate([prompt], SamplingParams(max_tokens=1))  # its blocks now in the prefix cache
    together = llm.generate([prompt, other], [ASK, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])
    _check(prompt, together[0].prompt_logprobs, ref)
    assert together[1].token_ids == alone and together[1].prompt_logprobs is None  # the neighbour is untouched
    assert together[0].token_ids[0] == ref[-1].argmax().item()  # sampled from the last row, as without
    assert llm.engine.scheduler.ledger.num_free == llm.engine.usable_blocks


def test_prompt_logprobs_are_validated_and_refused_with_mtp():
    llm = LLM("models/demo-v32", speculative="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, prompt_logprobs=21))
    with pytest.raises(ValueError, match="not supported with --speculative mtp"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, prompt_logprobs=0))


def _cp_rank(rank: int, world: int, path: str, prompts: list[list[int]]):
    state = ParallelState.initialize(ParallelConfig(world=world, cp=world), rank, torch.device("cpu"))
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, max_num_batched_tokens=24,
                                    indexer_numerics="transformers"), state)
    seqs = [engine.add_request(p, ASK, f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    return [[(lp.token_id, lp.logprob, lp.top_ids) for lp in s.prompt_logprobs] for s in seqs]


def test_prompt_logprobs_under_context_parallel_prefill(ckpt):
    """Each CP rank computes its zigzag pieces' rows; every rank ends with the whole prompt's logprobs."""
    path = str(ckpt("v32_sparse"))
    prompts = random_prompts(2, [53, 3], 512, seed=7)  # chunked by the 24-token budget; one shorter than 2·cp
    for got in run_ranks(_cp_rank, 2, path, prompts):
        for prompt, rows in zip(prompts, got, strict=True):
            ref = _reference(path, prompt)
            assert [t for t, _, _ in rows] == prompt[1:]
            for i, (token, logprob, top) in enumerate(rows, start=1):
                assert abs(logprob - ref[i - 1, token].item()) <= 1e-4 and top[0] == ref[i - 1].argmax().item()
