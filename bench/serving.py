"""Serving: concurrent streams through the router (1 prefill + 1 decode process) over its gRPC API and
over its OpenAI-compatible HTTP API, vs the same work in-process, vs vLLM's OpenAI server
(`--peer vllm`), plus the TTFT overhead of disaggregation on a 1k-token prompt.

    python bench/serving.py [--streams 16,64,256] [--prompt-len 128] [--max-tokens 128] [--peer vllm]
                            [--vllm-bench | --no-vllm-bench] [--rounds 1] [--quiet-below 0.3]
                            [--dtype bfloat16] [--kv-transport tcp]

Two load generators drive the HTTP servers: this file's own streaming client (bench/peers
`stream_completion`, token-id prompts; the gRPC API gets prompts of the same kind through its own client), and
vLLM's load tool `vllm bench serve` from the peer venv (its random dataset: text prompts of
--prompt-len tokens, another seed every run; on by default with `--peer vllm`), which drives
pdserve's router and vLLM's server alike. Every run draws prompts no run used before (random tokens, the
same lengths): a repeat would read its KV from pdserve's prefix cache, which vLLM's CPU MLA does not have
(until session 57 the HTTP run reused the gRPC run's prompts). For each concurrency: TTFT p50/p99, TPOT
p50/p99 and output tok/s of every system and path (all alternate within one run, both warm; `--rounds R` repeats the
alternation, ABBA order, and pools the requests), and HTTP TPOT / gRPC TPOT. With `--peer vllm` both
servers serve the tiny DeepSeek-V3 vLLM's CPU build accepts (bench/peers), with its tokenizer. Saves
bench/out/serving.png (tok/s) and bench/out/serving_tpot.png (TPOT p50), and each `vllm bench serve`
result under bench/out/vllm_bench/. All processes, the load generators included, share this machine's
cores; other programs on it are not ours to stop, so each measurement first waits (--quiet-wait s at most)
until they use under --quiet-below cores, and the cores they used during it are reported
(bench/hostload).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench.common import OUT, line_plot, pct, table
from bench.hostload import ForeignLoad, front_and_engine, wait_quiet
from bench.peers import VLLM_CONFIG, VllmServer, stream_completion, vllm_bench_serve
from router.cluster import Cluster
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.kvcache import KVCache
from shared.kvcache.lease import LeaseTable
from shared.loader.tiny import ensure_tiny_model, write_checkpoint
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.transfer import TcpReceiver, make_sender
from shared.transfer.base import cache_kinds

CPU_PARTS = ["router front", "prefill front", "prefill engine", "decode front", "decode engine"]


def stream_once(stub, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0, stamps = time.perf_counter(), []
    for msg in stub.Generate(req, timeout=600):
        if msg.token_ids:
            stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1), len(stamps)


async def _router_stream(stub, prompt: list[int], max_tokens: int) -> list[float]:
    req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    stamps = []
    async for msg in stub.Generate(req, timeout=1800):
        stamps.extend([time.perf_counter()] * len(msg.token_ids))
    return stamps


def run_streams(open_stream, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; per stream TTFT and TPOT from token arrival times."""

    async def go() -> tuple[list[list[float]], float, float]:
        t0 = time.perf_counter()
        stamps = await asyncio.gather(*(open_stream(p, max_tokens) for p in prompts))
        return stamps, t0, time.perf_counter()

    stamps, t0, t1 = asyncio.run(go())
    return {"ttft": [s[0] - t0 for s in stamps], "tpot": [(s[-1] - s[0]) / max(len(s) - 1, 1) for s in stamps],
            "tok/s": sum(len(s) for s in stamps) / (t1 - t0), "tokens": sum(len(s) for s in stamps)}


def run_router(address: str, prompts: list[list[int]], max_tokens: int) -> dict:
    async def one(prompt: list[int], n: int) -> list[float]:
        async with grpc.aio.insecure_channel(address) as ch:
            return await _router_stream(generation_pb2_grpc.GenerationStub(ch), prompt, n)

    return run_streams(one, prompts, max_tokens)


def run_in_process(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    stamps: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    while engine.has_work:
        for ev in engine.step():
            stamps[ev.seq.request_id].append(time.perf_counter())
    wall = time.perf_counter() - t0
    ttft = [v[0] - t0 for v in stamps.values()]
    tpot = [(v[-1] - v[0]) / max(len(v) - 1, 1) for v in stamps.values()]
    return {"ttft": ttft, "tpot": tpot, "tok/s": sum(len(v) for v in stamps.values()) / wall}


def wire_seconds(engine: LLMEngine, tokens: int) -> float:
    """Time to push `tokens` tokens of this model's KV over the built-in TCP transport (in-process)."""
    layout = engine.layout
    n_blocks = -(-tokens // layout.block_size)
    dst = KVCache(layout, n_blocks, torch.device("cpu"))
    leases = LeaseTable(dst.ledger, layout.block_size, layout.num_layers, cache_kinds(layout))
    receiver = TcpReceiver(dst, leases)
    best = float("inf")
    for _ in range(3):
        lease = leases.reserve("wire", tokens)
        t0 = time.perf_counter()
        push = make_sender("tcp", engine.kv).open(receiver.destination(lease))
        for layer in range(layout.num_layers):
            push.send_layer(layer, list(range(n_blocks)), 0)
        push.finish()
        best = min(best, time.perf_counter() - t0)
        leases.release(lease.lease_id)
    receiver.close()
    return best


def phases(cluster: Cluster, prompt: list[int], repeat: int = 5) -> dict[str, float]:
    """The router's three calls made by hand, timed: median ms of reserve, prefill (with the server's
    own compute+push time), and decode until the first token."""
    from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc

    dec = internal_pb2_grpc.DecodeStub(cluster.channel(cluster.decode_addrs[0]))
    pre = internal_pb2_grpc.PrefillStub(cluster.channel(cluster.prefill_addrs[0]))
    sp = generation_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rows: dict[str, list[float]] = {"reserve": [], "prefill rpc": [], "prefill server": [], "decode first": []}
    for i in range(repeat):
        prompt = [2 + (prompt[0] + 1) % 998, *prompt[1:]]  # another first token: no prefix cached from the last
        t0 = time.perf_counter()
        r = dec.Reserve(internal_pb2.ReserveRequest(request_id=f"p{i}", num_prompt_tokens=len(prompt), max_tokens=2))
        t1 = time.perf_counter()
        first = pre.Prefill(internal_pb2.PrefillRequest(request_id=f"p{i}", prompt_token_ids=prompt, sampling_params=sp,
                                                        destination=r.destination))
        t2 = time.perf_counter()
        stream = dec.Decode(internal_pb2.DecodeRequest(request_id=f"p{i}", lease_id=r.destination.lease_id,
                                                       prompt_token_ids=prompt, sampling_params=sp,
                                                       first_token_id=first.first_token_id))
        next(iter(stream))
        t3 = time.perf_counter()
        stream.cancel()
        for key, value in zip(rows, (t1 - t0, t2 - t1, first.prefill_seconds, t3 - t2)):
            rows[key].append(value * 1e3)
        time.sleep(0.2)  # let decode finish the cancelled request's step: each round starts idle
    return {k: statistics.median(v) for k, v in rows.items()}


GRPC, HTTP, HTTP_VB = "pdserve gRPC [own client]", "pdserve HTTP [own client]", "pdserve HTTP [vllm bench serve]"
VLLM, VLLM_VB, LOCAL = "vLLM HTTP [own client]", "vLLM HTTP [vllm bench serve]", "in-process engine"
SAME_CLIENT_VLLM = {GRPC: VLLM, HTTP: VLLM, HTTP_VB: VLLM_VB}  # the vLLM row each pdserve row is compared with


def from_vllm_bench(res: dict) -> dict:
    """`vllm bench serve`'s detailed result as this file's per-stream lists: TTFT from its `ttfts`, TPOT
    as it computes it, (latency - TTFT) / (output tokens - 1) = sum(itls) / (output_lens - 1), with the
    output tokens the server's usage reported; tok/s is its output throughput."""
    ok = [i for i, err in enumerate(res["errors"]) if not err]
    if len(ok) < len(res["errors"]):
        first = next(err for err in res["errors"] if err)
        print(f"  vllm bench serve: {len(res['errors']) - len(ok)} requests failed, e.g. {first[:300]}", flush=True)
    return {"ttft": [res["ttfts"][i] for i in ok],
            "tpot": [sum(res["itls"][i]) / max(res["output_lens"][i] - 1, 1) for i in ok],
            "tok/s": res["output_throughput"]}


def pooled(runs: list[dict]) -> dict:
    """Rounds of one system at one concurrency: their requests pooled, the median round's tok/s."""
    return {"ttft": [x for r in runs for x in r["ttft"]], "tpot": [x for r in runs for x in r["tpot"]],
            "tok/s": statistics.median(r["tok/s"] for r in runs)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-v32", help="without --peer (vLLM needs deepseek_v3)")
    p.add_argument("--streams", default="16,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake"])
    p.add_argument("--peer", action="append", choices=["vllm"], default=[])
    p.add_argument("--vllm-bench", action=argparse.BooleanOptionalAction, default=None,
                   help="also drive each HTTP server with vLLM's `vllm bench serve` (the peer venv, installed on "
                        "first use); default: on with --peer vllm")
    p.add_argument("--rounds", type=int, default=1, help="alternations of all systems per concurrency")
    p.add_argument("--quiet-below", type=float, default=0.3,
                   help="before each measurement wait until other programs use fewer cores than this (0: never wait)")
    p.add_argument("--quiet-wait", type=float, default=60, help="at most this many seconds per wait")
    p.add_argument("--decode-flag", action="append", default=[],
                   help="extra decode_service flag, e.g. --decode-flag=--engine-in-process")
    p.add_argument("--router-flag", action="append", default=[],
                   help="extra router flag, e.g. --router-flag=--no-token-bus")
    args = p.parse_args(argv)
    use_vb = args.vllm_bench if args.vllm_bench is not None else "vllm" in args.peer
    tmp = tempfile.TemporaryDirectory()
    if "vllm" in args.peer:  # with its tokenizer: `vllm bench serve` sends text, tokenized by either server
        model = str(write_checkpoint(Path(tmp.name) / "v3", "deepseek_v3", **VLLM_CONFIG))
    else:
        model = str(ensure_tiny_model(args.model))
    levels = [int(x) for x in args.streams.split(",")]
    g = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(2, 1000, (args.long_prompt,), generator=g).tolist()
    seeds = iter(range(1, 1 << 30))  # vllm bench serve's: one per run

    def fresh(n: int, prompt_len: int) -> list[list[int]]:
        """Prompts no run saw before: each run draws its own (same lengths, random tokens), so none reads
        another's KV from pdserve's prefix cache (vLLM's CPU MLA has none)."""
        return torch.randint(2, 1000, (n, prompt_len), generator=g).tolist()

    vb_out = OUT / "vllm_bench"

    print("in-process engine ...", flush=True)
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=max(levels)))
    run_in_process(engine, fresh(2, args.prompt_len), 4)  # warm-up
    wire = wire_seconds(engine, args.long_prompt)
    vllm = None
    if "vllm" in args.peer:
        print("starting vLLM's OpenAI server ...", flush=True)
        vllm = VllmServer(model, args.dtype, log=OUT / "vllm_server.log", tokenizer=True)
    print(f"starting router + 1 prefill + 1 decode ({args.kv_transport}, {args.dtype}) ...", flush=True)
    runs: dict[str, dict[int, list[dict]]] = {}
    try:
        with Cluster(model, kv_transport=args.kv_transport, dtype=args.dtype,
                     extra_router=["--http-port", "0", *args.router_flag],
                     extra_decode=["--max-num-seqs", str(max(levels)), *args.decode_flag]) as cluster:
            host, _, port = cluster.http_address.rpartition(":")
            served = Path(model).resolve().name  # the router's HTTP model id (its default --served-model-name)

            def http(prompt: list[int], n: int):  # a coroutine of the tokens' arrival times
                return stream_completion(host, int(port), served, prompt, n)

            def bench(name: str, url: str, model_id: str, n: int, tag: str, prompt_len: int, max_tokens: int) -> dict:
                slug = name.split()[0].lower()
                return from_vllm_bench(vllm_bench_serve(url, model_id, model, prompt_len, max_tokens, n, n,
                                                        vb_out / f"{slug}-{tag}.json", seed=next(seeds)))

            systems = {  # name → run(concurrency, tag, prompt_len, max_tokens) → per-stream results
                GRPC: lambda n, tag, pl, mt: run_router(cluster.address, fresh(n, pl), mt),
                HTTP: lambda n, tag, pl, mt: run_streams(http, fresh(n, pl), mt),
            }
            if use_vb:
                systems[HTTP_VB] = lambda n, tag, pl, mt: bench(HTTP_VB, f"http://{cluster.http_address}", served,
                                                                n, tag, pl, mt)
            if vllm is not None:
                systems[VLLM] = lambda n, tag, pl, mt: run_streams(vllm.stream, fresh(n, pl), mt)
                if use_vb:
                    systems[VLLM_VB] = lambda n, tag, pl, mt: bench(VLLM_VB, f"http://127.0.0.1:{vllm.port}",
                                                                    vllm.model, n, tag, pl, mt)
            systems[LOCAL] = lambda n, tag, pl, mt: run_in_process(engine, fresh(n, pl), mt)
            print("warm-up ...", flush=True)
            for run in systems.values():
                run(2, "warmup", min(16, args.prompt_len), 4)
            runs = {name: {n: [] for n in levels} for name in systems}
            pids = {"router": cluster.process(cluster.address).pid,
                    "prefill": cluster.process(cluster.prefill_addrs[0]).pid,
                    "decode": cluster.process(cluster.decode_addrs[0]).pid}
            for n in levels:
                for r in range(args.rounds):
                    order = list(systems) if r % 2 == 0 else list(systems)[::-1]  # ABBA: drift hits all alike
                    for name in order:
                        if args.quiet_below > 0:
                            wait_quiet(args.quiet_below, args.quiet_wait)
                        print(f"{n} concurrent streams, round {r + 1}/{args.rounds}: {name} ...", flush=True)
                        others, cpu0 = ForeignLoad(), front_and_engine(pids)
                        res = systems[name](n, f"{n}-r{r}", args.prompt_len, args.max_tokens)
                        res["others"] = others.cores()
                        if name in (GRPC, HTTP):  # each process's CPU per generated token
                            res["cpu"] = {k: 1e3 * (v - cpu0[k]) / max(res["tokens"], 1)
                                          for k, v in front_and_engine(pids).items()}
                        if res["others"] > 0.1:
                            print(f"  other programs kept {res['others']:.2f} cores busy meanwhile", flush=True)
                        runs[name][n].append(res)
            stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.address))
            remote_long, local_long = [], []
            for _ in range(5):  # alternate, so machine noise hits both paths alike; a new prompt each (new to both)
                prompt = fresh(1, args.long_prompt)[0]
                remote_long.append(stream_once(stub, prompt, 1)[0])
                local_long.append(run_in_process(engine, [prompt], 1)["ttft"][0])
            breakdown = phases(cluster, long_prompt)
    finally:
        if vllm is not None:
            vllm.close()
        tmp.cleanup()

    results = {name: {n: pooled(by_level[n]) for n in levels} for name, by_level in runs.items()}
    print()
    print(f"{args.prompt_len}-token prompts → {args.max_tokens} tokens, {args.dtype}, {args.rounds} round(s); "
          f"TPOT per stream = (last token - first token) / (tokens - 1), percentiles over streams")
    for n in levels:
        grpc_tpot = pct(results[GRPC][n]["tpot"], .5)
        rows = []
        for name, by_level in results.items():
            r = by_level[n]
            peer = results.get(SAME_CLIENT_VLLM.get(name, ""), {}).get(n)
            rows.append([name, f"{pct(r['ttft'], .5) * 1e3:.0f}", f"{pct(r['ttft'], .99) * 1e3:.0f}",
                         f"{pct(r['tpot'], .5) * 1e3:.1f}", f"{pct(r['tpot'], .99) * 1e3:.1f}", r["tok/s"],
                         f"{pct(r['tpot'], .5) / grpc_tpot:.3f}",
                         f"{r['tok/s'] / peer['tok/s']:.2f}x" if peer else ""])
        print()
        print(f"{n} concurrent streams")
        print(table(["system / path [load tool]", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                     "tok/s", "TPOT p50 / gRPC", "tok/s / vLLM (same tool)"], rows))
    http_rows = [name for name in (HTTP, HTTP_VB) if name in results]
    cpu_rows = [[n, name, *(f"{statistics.median(r['cpu'][k] for r in runs[name][n]):.3f}" for k in CPU_PARTS)]
                for n in levels for name in (GRPC, HTTP)]
    print("\nCPU ms per generated token, by process (median over rounds; front: the service's own process, engine: "
          "the engine ranks it started; the router's engine column is 0: it has none)")
    print(table(["streams", "path", *CPU_PARTS], cpu_rows))

    def round_ratio(name: str, n: int, r: int) -> float:  # TPOT p50 of `name` / gRPC's, one round
        return pct(runs[name][n][r]["tpot"], .5) / pct(runs[GRPC][n][r]["tpot"], .5)

    if args.rounds > 1:  # the spread: rounds ran minutes apart on a shared machine
        print()
        print(table(["streams", "round", *[f"TPOT p50 ms {name}" for name in runs],
                     *[f"{name.removeprefix('pdserve ')} / gRPC" for name in http_rows],
                     "others' cores (max of the round)"], [
            [n, r + 1, *[f"{pct(runs[name][n][r]['tpot'], .5) * 1e3:.1f}" for name in runs],
             *[f"{round_ratio(h, n, r):.3f}" for h in http_rows],
             f"{max(runs[name][n][r]['others'] for name in runs):.2f}"]
            for n in levels for r in range(args.rounds)]))
    print()
    summary = []
    for n in levels:
        pooled_ratios = [pct(results[h][n]["tpot"], .5) / pct(results[GRPC][n]["tpot"], .5) for h in http_rows]
        round_ratios = [statistics.median(round_ratio(h, n, r) for r in range(args.rounds)) for h in http_rows]
        summary.append([n, *[f"{a:.3f} / {b:.3f}" for a, b in zip(pooled_ratios, round_ratios)],
                        " / ".join("yes" if max(x) <= 1.05 else "no" for x in (pooled_ratios, round_ratios))])
    print("HTTP TPOT / gRPC TPOT: pooled = p50 over all rounds' streams; rounds = median of each round's ratio")
    print(table(["streams", *[f"TPOT p50 {name.removeprefix('pdserve ')} / gRPC (pooled / rounds)"
                              for name in http_rows], "within 5% (pooled / rounds)"], summary))
    d_ttft, l_ttft = statistics.median(remote_long), statistics.median(local_long)
    print()
    print(table([f"{args.long_prompt}-token prompt", "ms"], [
        ["TTFT disaggregated (median of 5)", f"{d_ttft * 1e3:.1f}"],
        ["TTFT in-process (median of 5)", f"{l_ttft * 1e3:.1f}"],
        ["overhead", f"{(d_ttft - l_ttft) * 1e3:.1f}"],
        ["KV wire time (built-in tcp)", f"{wire * 1e3:.1f}"],
        ["overhead - wire time", f"{(d_ttft - l_ttft - wire) * 1e3:.1f}"],
    ]))
    print()
    b = breakdown
    machinery = b["reserve"] + b["prefill rpc"] - b["prefill server"] + b["decode first"]
    print(table([f"{args.long_prompt}-token prompt, phases by hand (median)", "ms"],
                [[k, f"{v:.1f}"] for k, v in b.items()]
                + [["machinery = reserve + (prefill rpc - prefill server) + decode first", f"{machinery:.1f}"]]))
    title = f"{args.prompt_len} → {args.max_tokens} tokens, {args.dtype}"
    png = line_plot(OUT / "serving.png", title, levels,
                    {name: [by_level[n]["tok/s"] for n in levels] for name, by_level in results.items()},
                    "concurrent streams", "output tokens/s")
    tpot_png = line_plot(OUT / "serving_tpot.png", title, levels,
                         {name: [pct(by_level[n]["tpot"], .5) * 1e3 for n in levels]
                          for name, by_level in results.items() if name != LOCAL},
                         "concurrent streams", "TPOT p50 (ms)")
    print(f"plots: {png}, {tpot_png}")


if __name__ == "__main__":
    main()
