"""`make demo`: the main job end to end on the trained demo model (models/demo-v32, KJV English).

Starts `pdserve up` (router + 1 prefill + 1 decode as real processes on loopback), sends a few
concurrent text `Generate` calls, prints each streamed text with its TTFT and TPOT, sends them again
to compare the first (cold) requests' TTFT with warm ones, and stops everything. Then it generates the
same prompts in-process (`LLM.generate`) and checks the tokens are the same.

The text is sampled as the model's generation_config.json says (do_sample, temperature, top_p, top_k,
read as Hugging Face reads them; greedy where it does not sample) with a fixed `--seed`: a seeded request
draws the same tokens wherever it runs (first token on the prefill instance, the rest on decode, or all in
one process), so the check holds for sampled text as for greedy. A `--model` directory that does not
exist gets the random tiny model generated in it.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import threading
import time
from pathlib import Path

import grpc

from router.cli import DEFAULT_MODEL, Cluster
from shared.engine import LLM
from shared.loader.tiny import ensure_tiny_model
from shared.rpc.convert import sampling_from_proto
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc

PROMPTS = ["And it came to pass", "In the beginning", "The LORD is my shepherd", "And Jesus said unto them,"]
HF_TOP_K = 50  # Hugging Face's top_k when a sampling generation_config sets none


def model_sampling(model: str, max_tokens: int, seed: int) -> generation_pb2.SamplingParams:
    """The demo's sampling: the model's generation_config.json (greedy when it has none or does not
    sample), `max_tokens` tokens each (EOS ignored, so every prompt shows as much), seeded."""
    path = Path(model) / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    if not cfg.get("do_sample", False):
        return generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=seed)
    return generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=float(cfg.get("temperature", 1.0)),
                                         top_p=float(cfg.get("top_p", 1.0)), top_k=int(cfg.get("top_k", HF_TOP_K)),
                                         ignore_eos=True, seed=seed)


def run_one(stub, prompt: str, params: generation_pb2.SamplingParams, results: dict) -> None:
    req = generation_pb2.GenerateRequest(prompt=prompt, sampling_params=params)
    t0, stamps, text, finish, ids = time.perf_counter(), [], "", "", []
    for msg in stub.Generate(req, timeout=120):
        if msg.token_ids:
            stamps.append(time.perf_counter())
        ids.extend(msg.token_ids)
        text += msg.text
        finish = msg.finish_reason or finish
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    results[prompt] = (text, ttft, tpot, ids, finish)


def run_all(stub, params: generation_pb2.SamplingParams) -> dict:
    """Every demo prompt at once, one thread each; their results by prompt."""
    results: dict = {}
    threads = [threading.Thread(target=run_one, args=(stub, pr, params, results)) for pr in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake"])
    p.add_argument("--seed", type=int, default=0, help="sampling seed of every request (the same text each run)")
    args = p.parse_args(argv)
    path = Path(args.model)
    trained = (path / "train_log.json").exists()
    model = str(path if (path / "config.json").exists() else ensure_tiny_model(path))
    params = model_sampling(model, args.max_tokens, args.seed)
    how = "greedy" if params.temperature == 0 else (f"temperature {params.temperature:g}, top_p {params.top_p:g}, "
                                                     f"top_k {params.top_k}, seed {params.seed}")
    print(f"starting router + 1 prefill + 1 decode on {model} (kv transport: {args.kv_transport}) ...", flush=True)
    with Cluster(model, kv_transport=args.kv_transport) as cluster:
        print(f"router at {cluster.address}; sending {len(PROMPTS)} concurrent Generate calls "
              f"(sampling: {how}, from the model's generation_config.json)\n", flush=True)
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.address))
        results = run_all(stub, params)
        for prompt in PROMPTS:
            text, ttft, tpot, ids, finish = results[prompt]
            print(f"prompt: {prompt!r}\n{textwrap.indent(prompt + text, '  | ')}\n  {len(ids)} tokens, "
                  f"finish={finish}, TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.1f} ms\n")
        warm = run_all(stub, params)
        cold_ttft = max(results[p][1] for p in PROMPTS)
        warm_ttft = max(warm[p][1] for p in PROMPTS)
        print(f"\nfirst {len(PROMPTS)} requests' TTFT at most {cold_ttft * 1e3:.1f} ms; the same requests again "
              f"(warm) at most {warm_ttft * 1e3:.1f} ms: {cold_ttft / warm_ttft:.2f}x")
    print("all services stopped; checking the tokens against in-process LLM.generate ...")
    local = LLM(model).generate(PROMPTS, sampling_from_proto(params))  # the services' defaults (dtype auto: bf16
    # here) and the sampling they were sent, seed included
    same = all(out.token_ids == results[p][3] for p, out in zip(PROMPTS, local))
    print(f"disaggregated tokens == in-process tokens: {same}")
    if not trained:
        print("(the tiny model has random weights, so its text is noise; make demo uses models/demo-v32)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
