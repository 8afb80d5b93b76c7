"""Selective disaggregation: TTFT of short prompts under a decode load, with and without letting the decode
instance prefill them itself (`--local-prefill-tokens`).

    python bench/selective.py [--background 64] [--probes 40] [--probe-len 16] [--local-prefill-tokens 32]
                              [--prefill-load 0,2] [--long-prompt 512] [--repeat 1] [--model DIR]

Each run starts `pdserve up` (1 prefill + 1 decode, the trained demo model, bf16) with the router flag
off and on (alternating, `--repeat` times each), keeps `--background` greedy streams decoding (and, per
`--prefill-load` scenario, that many long prompts keeping the prefill instance busy), and sends
`--probes` short prompts one after another: their TTFT p50 / p99, the background streams' TPOT p50, and
which path the router took for them (its pdserve_router_prefill_path_total). Saves bench/out/selective.png. All
processes share this machine's cores.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import asyncio
import re
import time
import urllib.request
from pathlib import Path

import grpc

from bench.common import OUT, ROOT, bar_plot, pct, table
from router.cli import up_cluster
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc

BACKGROUND_PROMPT = "And it came to pass, when the LORD had spoken these words"


async def _background(stub, max_tokens: int, stop: asyncio.Event, gaps: list[float]) -> None:
    """One stream decoding until told to stop (restarted when it ends); its inter-token gaps."""
    req = generation_pb2.GenerateRequest(prompt=BACKGROUND_PROMPT, sampling_params=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while not stop.is_set():
        call = stub.Generate(req, timeout=600)
        last = None
        try:
            async for msg in call:
                now = time.perf_counter()
                if last is not None and msg.token_ids:
                    gaps.append((now - last) / len(msg.token_ids))
                last = now
                if stop.is_set():
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise


async def _long_prompts(stub, tokens: int, stop: asyncio.Event, seed: int) -> None:
    """Keep the prefill instance busy: distinct long prompts (no prefix-cache hits), one token each."""
    i = 0
    while not stop.is_set():
        ids = [(seed * 7919 + i * 31 + 13 * j) % 4000 + 10 for j in range(tokens)]
        req = generation_pb2.GenerateRequest(prompt_token_ids=ids, sampling_params=generation_pb2.SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True))
        async for _ in stub.Generate(req, timeout=600):
            pass
        i += 1


async def _probe(stub, prompt_ids: list[int]) -> float:
    req = generation_pb2.GenerateRequest(prompt_token_ids=prompt_ids, sampling_params=generation_pb2.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    async for msg in stub.Generate(req, timeout=600):
        if msg.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("a probe got no token")


async def _measure(address: str, metrics_url: str, prefill_load: int, args: argparse.Namespace
                   ) -> tuple[list[float], list[float], float]:
    """(probe TTFTs, background inter-token gaps, share of the probes prefilled on decode), with
    `prefill_load` long prompts keeping the prefill instance busy."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stop, gaps = asyncio.Event(), []
        tasks = [asyncio.create_task(_background(stub, args.background_tokens, stop, gaps))
                 for _ in range(args.background)]
        tasks += [asyncio.create_task(_long_prompts(stub, args.long_prompt, stop, k))
                  for k in range(prefill_load)]
        await asyncio.sleep(args.warmup)  # every background stream admitted and decoding
        before = _paths(metrics_url)
        ttfts = []
        for i in range(args.probes):
            ids = [(7 * i + 3 * j) % 4000 + 10 for j in range(args.probe_len)]  # distinct prompts
            ttfts.append(await _probe(stub, ids))
            await asyncio.sleep(args.gap)
        after = _paths(metrics_url)
        stop.set()
        await asyncio.gather(*tasks)
    local = after.get("local", 0.0) - before.get("local", 0.0)
    return ttfts, gaps, local / args.probes


def _paths(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {p: float(v) for p, v in re.findall(r'pdserve_router_prefill_path_total\{path="(\w+)"\} (\S+)', text)}


def run(local_tokens: int, prefill_load: int, args: argparse.Namespace) -> dict[str, float]:
    """One cluster with the router flag at `local_tokens`: the probes' TTFT p50 / p99 (ms), the background
    TPOT p50 (ms) and the share of probes prefilled on decode."""
    cluster = up_cluster(["--model", args.model, "--port", "0", "--local-prefill-tokens", str(local_tokens),
                          "--overflow-prefill-tokens", "0"])  # the flag alone: no burst overflow in either run
    cluster.extra_router += ["--metrics-port", "0"]
    with cluster:
        url = f"http://127.0.0.1:{cluster.metrics_ports[cluster.address]}/metrics"
        ttfts, gaps, local_share = asyncio.run(_measure(cluster.address, url, prefill_load, args))
    return {"ttft_p50": pct(ttfts, 0.5) * 1e3, "ttft_p99": pct(ttfts, 0.99) * 1e3,
            "tpot_p50": pct(gaps, 0.5) * 1e3, "local_share": local_share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "demo-v32"))
    p.add_argument("--background", type=int, default=64, help="streams decoding in the background")
    p.add_argument("--background-tokens", type=int, default=900, help="max_tokens of a background stream")
    p.add_argument("--probes", type=int, default=40, help="short prompts timed, one after another")
    p.add_argument("--probe-len", type=int, default=16, help="tokens of a probe prompt")
    p.add_argument("--local-prefill-tokens", type=int, default=32, help="the router flag in the 'on' runs")
    p.add_argument("--prefill-load", default="0,2",
                   help="scenarios: this many concurrent long prompts keep the prefill instance busy")
    p.add_argument("--long-prompt", type=int, default=512, help="tokens of a prefill-load prompt")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of background before the probes")
    p.add_argument("--gap", type=float, default=0.1, help="seconds between probes")
    p.add_argument("--repeat", type=int, default=1, help="off/on pairs, alternating")
    args = p.parse_args()
    rows, results = [], {}
    for load in [int(x) for x in args.prefill_load.split(",")]:
        for r in range(args.repeat):
            for mode, tokens in (("off", 0), ("on", args.local_prefill_tokens)):
                print(f"prefill load {load}, run {r + 1}/{args.repeat}: --local-prefill-tokens {tokens} ...",
                      flush=True)
                res = run(tokens, load, args)
                results.setdefault((load, mode), []).append(res)
                rows.append([load, f"{mode} ({tokens})", r + 1, res["ttft_p50"], res["ttft_p99"], res["tpot_p50"],
                             f"{res['local_share']:.0%}"])
    print(f"\n{args.probes} prompts of {args.probe_len} tokens, one after another, beside {args.background} "
          f"decoding streams and N concurrent {args.long_prompt}-token prompts (1 prefill + 1 decode, bf16, "
          f"{Path(args.model).name}):")
    print(table(["N long prompts", "--local-prefill-tokens", "run", "TTFT p50 ms", "TTFT p99 ms",
                 "background TPOT p50 ms", "probes prefilled on decode"], rows))
    OUT.mkdir(parents=True, exist_ok=True)
    labels = [f"{k} (N={load})" for load in sorted({x for x, _ in results}) for k in ("TTFT p50", "TTFT p99")]
    series = {f"--local-prefill-tokens {tokens}": [
        sum(x[k] for x in results[load, mode]) / len(results[load, mode])
        for load in sorted({x for x, _ in results}) for k in ("ttft_p50", "ttft_p99")]
        for mode, tokens in (("off", 0), ("on", args.local_prefill_tokens))}
    path = bar_plot(OUT / "selective.png", f"{args.probe_len}-token prompts beside {args.background} streams",
                    labels, series, "ms")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
