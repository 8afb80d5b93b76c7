"""The logits processors of the batched sampler (logit_bias, min_tokens, repetition / frequency /
presence penalties, min_p): equal to a row-by-row reference written from their definitions, in effect
end to end through the engine, validated naming the field, and refused with MTP."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from shared.engine import LLM, SamplingParams
from shared.engine.sampler import process_logits, sample

DEMO = "models/demo-v32"
EOS = 1


@dataclass
class History:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def unique_prompt_ids(self) -> torch.Tensor:
        return torch.tensor(self.prompt_token_ids).unique()


def reference(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """Row by row, from the definitions (vLLM's order)."""
    out = logits.clone()
    for i, (p, h) in enumerate(zip(params, histories)):
        row = out[i]
        for t, b in p.logit_bias.items():
            row[t] += b
        if len(h.output_token_ids) < p.min_tokens:
            for t in {EOS, *p.stop_token_ids}:
                row[t] = -math.inf
        for t in set(h.prompt_token_ids + h.output_token_ids):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(h.output_token_ids):
            row[t] -= p.frequency_penalty * h.output_token_ids.count(t) + p.presence_penalty
    return out


def test_processors_equal_the_row_by_row_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(5, vocab, generator=gen) * 3
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=1.8),
              SamplingParams(logit_bias={3: 5.0, 7: -2.5}, min_tokens=4, stop_token_ids=[9]),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, logit_bias={0: 1.0}, min_tokens=1)]
    histories = [History([1, 2, 3], [4, 4, 5, 4]), History([6, 6, 7], [8, 2]), History([10], [11]),
                 History([12], [13, 13]), History([14, 15], [15, 16])]
    got = process_logits(logits, params, histories, [EOS])
    assert torch.equal(got, reference(logits, params, histories))
    assert torch.equal(got[3], logits[3])  # a row without processors is untouched


def test_min_p_never_draws_below_its_floor():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 200, generator=gen) * 2
    p = SamplingParams(temperature=0.8, min_p=0.2)
    probs = (logits[0] / 0.8).softmax(-1)
    allowed = probs >= 0.2 * probs.max()
    draws = {sample(logits, [p], [torch.Generator().manual_seed(s)], [History([1])])[0] for s in range(300)}
    assert draws and all(allowed[t] for t in draws)
    assert len(draws) == int(allowed.sum())  # and everything above it stays reachable


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(DEMO, enable_prefix_caching=False)


def _tokens(llm: LLM, prompt: str, **kw) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0.0, **kw))[0].token_ids


def test_processors_take_effect_through_the_engine(demo):
    prompt = "And God said, Let there be light"
    plain = _tokens(demo, prompt, max_tokens=24, ignore_eos=True)
    assert len(set(plain)) < len(plain)  # the demo model repeats itself
    assert _tokens(demo, prompt, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}) == [42] * 6
    # EOS forced by a bias, held back by min_tokens: exactly min_tokens other tokens, then EOS
    forced = demo.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias={EOS: 100.0},
                                                    min_tokens=3))[0]
    assert len(forced.token_ids) == 4 and EOS not in forced.token_ids[:3] and forced.finish_reason == "stop"
    # penalties: fewer repeats, and a generated token's logit drops by exactly the penalty
    for kw in ({"repetition_penalty": 3.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = _tokens(demo, prompt, max_tokens=24, ignore_eos=True, **kw)
        assert penalized != plain and len(set(penalized)) > len(set(plain)), kw


def test_processors_are_validated_naming_the_field(demo):
    for kw, name in (({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")},
                     "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
                     ({"min_p": 1.5}, "min_p"), ({"min_tokens": 20}, "min_tokens"),
                     ({"logit_bias": {5: 101.0}}, "logit_bias"), ({"logit_bias": {10**6: 1.0}}, "logit_bias")):
        with pytest.raises(ValueError, match=name):
            demo.generate([[5, 6]], SamplingParams(max_tokens=8, **kw))


def test_processors_are_refused_with_mtp():
    llm = LLM(DEMO, speculative="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="not supported with --speculative mtp"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=8, presence_penalty=1.0))
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids  # others run
