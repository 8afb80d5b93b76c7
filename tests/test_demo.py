"""`make demo` (router.demo) shows text a person wants to read: it samples as the demo model's
generation_config.json says, with a fixed seed, so its check that the disaggregated tokens equal the
in-process ones still holds (seeded sampling is the same on both paths: tests/test_services.py
test_seeded_sampling_matches_in_process)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from router.demo import PROMPTS, model_sampling
from shared.rpc.convert import sampling_from_proto

DEMO = "models/demo-v32"


def _most_repeated(text: str) -> int:
    """How often the text's most frequent run of 4 words occurs (a greedy loop repeats one many times)."""
    words = text.split()
    return max(Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3)).values())


def test_the_demo_samples_as_the_models_generation_config_says(tmp_path):
    config = json.loads((Path(DEMO) / "generation_config.json").read_text())
    assert config["do_sample"] is True
    params = sampling_from_proto(model_sampling(DEMO, 64, seed=7))
    assert params.temperature == pytest.approx(config["temperature"]) and params.temperature > 0
    assert params.top_p == pytest.approx(config["top_p"]) and params.top_k == config["top_k"]
    assert (params.seed, params.max_tokens, params.ignore_eos) == (7, 64, True)
    greedy = sampling_from_proto(model_sampling(str(tmp_path), 8, seed=0))  # no generation_config.json
    assert greedy.temperature == 0.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    hf = sampling_from_proto(model_sampling(str(tmp_path), 8, seed=0))  # Hugging Face's defaults
    assert (hf.temperature, hf.top_p, hf.top_k) == (1.0, 1.0, 50)


def test_the_demo_text_does_not_loop():
    """Greedy, the demo model loops ("and the king of Israel, and the king of Israel, ...": one 4-word run
    9 and 15 times in the first two prompts); the demo's sampling does not (the same tokens for a seed in
    one process and across the services: tests/test_engine.py, tests/test_services.py)."""
    from shared.engine import LLM

    llm = LLM(DEMO)
    params = sampling_from_proto(model_sampling(DEMO, 64, seed=0))
    outs = llm.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 64 for o in outs)
    assert max(_most_repeated(p + o.text) for p, o in zip(PROMPTS, outs)) <= 4, [o.text for o in outs]
    greedy = llm.generate(PROMPTS[:2], sampling_from_proto(model_sampling("/nonexistent", 64, seed=0)))
    assert max(_most_repeated(p + o.text) for p, o in zip(PROMPTS, greedy)) >= 8  # what the demo showed before
