"""lm-evaluation-harness through the HTTP API: `lm_eval --model local-completions` scores a small
multiple-choice task (tests/data/pdserve_kjv.yaml, local jsonl, no downloads) against `pdserve up`'s
/v1/completions, and each choice's loglikelihood equals the engine's in-process prompt logprobs summed
over the continuation tokens, so acc / acc_norm / exact_match equal the in-process ones too.

What lm-eval 0.4.13 sends for each loglikelihood batch (prompts as token ids, tokenized_requests=True):
    {"model": "demo-v32", "prompt": [[ids of context + continuation], ...], "temperature": 0,
     "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}
and it reads choices[i].logprobs.token_logprobs[ctxlen:-1] (summed: the continuation's tokens, the one
generated token dropped) and top_logprobs[ctxlen:-1] (is_greedy: each token's logprob == the top one's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from lm_eval.models.openai_completions import LocalCompletionsAPI

from shared.engine import LLM, SamplingParams
from tests.test_http import DEMO, KEY, cluster  # noqa: F401  (the module's cluster: `pdserve up --http-port 0`)

ROOT = Path(__file__).resolve().parents[1]
TASK = "pdserve_kjv"
TOL = 1e-3  # the same bf16 checkpoint on both sides; only the batch a prompt is computed in differs


def run_lm_eval(base_url: str, out: Path) -> tuple[dict, list[dict]]:
    """`lm_eval run` on the task; its aggregated results and its logged samples (one per doc)."""
    model_args = ",".join([
        "model=demo-v32", f"base_url={base_url}", f"tokenizer={DEMO}", "tokenizer_backend=huggingface",
        "tokenized_requests=True", "max_length=1024", "max_retries=1"])
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(out / "hf-home")}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--batch_size", "4", "--tasks", TASK, "--include_path", "tests/data", "--output_path", str(out / "results"),
           "--log_samples"]
    # from the repository root: the task's data_files path is relative to it
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"lm_eval failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = json.loads(next((out / "results").rglob("results_*.json")).read_text())
    samples_file = next((out / "results").rglob(f"samples_{TASK}_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
    return results, sorted(samples, key=lambda s: s["doc_id"])


def test_lm_eval_loglikelihoods_through_http_equal_in_process(cluster, tmp_path):  # noqa: F811
    results, samples = run_lm_eval(f"http://{cluster.http_address}/v1/completions", tmp_path)
    assert len(samples) == 10

    # lm-eval's own context / continuation split (its tokenizer only: no request is sent from here)
    lm = LocalCompletionsAPI(model="demo-v32", base_url="http://127.0.0.1:1/unused", tokenizer=DEMO,
                             tokenizer_backend="huggingface")
    llm = LLM(DEMO, enable_prefix_caching=False)
    acc, acc_norm, exact = [], [], []
    for sample in samples:
        doc = sample["doc"]
        pairs = [(a["arg_0"], a["arg_1"]) for _, a in sorted(sample["arguments"].items(),
                                                            key=lambda kv: int(kv[0].rsplit("_", 1)[1]))]
        assert [cont for _, cont in pairs] == [" " + c for c in doc["choices"]]
        http = [(float(ll), greedy == "True") for ll, greedy in sample["filtered_resps"]]
        lls, greedy = [], []
        for context, continuation in pairs:
            ctx, cont = lm._encode_pair(context, continuation)
            out = llm.generate([ctx + cont], SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0.0))[0]
            scored = out.prompt_logprobs[len(ctx):]
            assert [t.token_id for t in scored] == cont
            lls.append(sum(t.logprob for t in scored))
            greedy.append(all(t.top_ids[0] == t.token_id for t in scored))
        assert [ll for ll, _ in http] == pytest.approx(lls, abs=TOL), doc["context"]
        assert [g for _, g in http] == greedy, doc["context"]
        gold = doc["label"]
        acc.append(float(np.argmax(lls) == gold))
        acc_norm.append(float(np.argmax(np.array(lls) / [len(c) for c in doc["choices"]]) == gold))
        exact.append(float(greedy[gold]))
        assert (sample["acc"], sample["acc_norm"], sample["exact_match"]) == (acc[-1], acc_norm[-1], exact[-1])

    got = results["results"][TASK]
    print(f"\nlm-eval through HTTP: acc {got['acc,none']:.3f} acc_norm {got['acc_norm,none']:.3f} exact_match "
          f"{got['exact_match,none']:.3f}; in-process: acc {np.mean(acc):.3f} acc_norm {np.mean(acc_norm):.3f} "
          f"exact_match {np.mean(exact):.3f}")
    assert got["acc,none"] == pytest.approx(np.mean(acc))
    assert got["acc_norm,none"] == pytest.approx(np.mean(acc_norm))
    assert got["exact_match,none"] == pytest.approx(np.mean(exact))
    # the demo model knows some of these verses and misses others: a mixed score, sensitive to a mis-scored token
    assert 0 < np.mean(acc) < 1 and np.mean(exact) > 0
