"""Runs inside the vLLM peer venv (never imports pdserve): a long-lived vLLM engine that answers
one JSON line per request on stdin — {"prompts": [[ids]], "new_tokens": N} — with {"tok_s": x}
on stdout, so the benchmark can alternate vLLM and pdserve batch by batch in one run."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    model, dtype, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len,
              seed=0, max_num_seqs=256, distributed_executor_backend="uni")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(max_tokens=job["new_tokens"], temperature=0, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"tok_s": tokens / dt, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
