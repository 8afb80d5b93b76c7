"""Serving latency: N concurrent streams through the router (1 prefill + 1 decode process) vs the
same prompts in-process, plus the TTFT overhead of disaggregation on a 1k-token prompt.

    python bench/serving.py [--streams 16] [--prompt-len 128] [--max-tokens 32] [--kv-transport tcp]

Prints TTFT / TPOT p50 and p90 and output tok/s for both, and the 1k-prompt TTFT overhead next to
the KV transfer's wire time; saves bench/out/serving.png. All processes share this machine's cores.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import statistics
import threading
import time

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.common import OUT, bar_plot, table  # noqa: E402
from router.cli import Cluster  # noqa: E402
from shared.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from shared.kvcache import KVCache  # noqa: E402
from shared.kvcache.lease import LeaseTable  # noqa: E402
from shared.loader.tiny import ensure_tiny_model  # noqa: E402
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from shared.transfer import TcpReceiver, make_sender  # noqa: E402
from shared.transfer.base import cache_kinds  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def stream_once(stub, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:  # noqa: ANN001
    req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0, stamps = time.perf_counter(), []
    for msg in stub.Generate(req, timeout=600):
        if msg.token_ids:
            stamps.append(time.perf_counter())
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1), len(stamps)


def run_router(address: str, prompts: list[list[int]], max_tokens: int) -> dict:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = stream_once(stub, prompts[i], max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"ttft": [o[0] for o in out], "tpot": [o[1] for o in out], "tok/s": sum(o[2] for o in out) / wall}


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
    leases = LeaseTable(dst.allocator, layout.block_size, layout.num_layers, cache_kinds(layout))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-v32")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--kv-transport", default="tcp", choices=["tcp", "mooncake"])
    args = p.parse_args()
    model = str(ensure_tiny_model(args.model))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 1000, (args.streams, args.prompt_len), generator=g).tolist()
    long_prompt = torch.randint(2, 1000, (args.long_prompt,), generator=g).tolist()

    print("in-process engine ...", flush=True)
    engine = LLMEngine(EngineConfig(model=model, dtype="bfloat16"))  # what the services run
    run_in_process(engine, prompts[:2], 4)  # warm-up
    local = run_in_process(engine, prompts, args.max_tokens)
    wire = wire_seconds(engine, args.long_prompt)

    print(f"starting router + 1 prefill + 1 decode ({args.kv_transport}) ...", flush=True)
    with Cluster(model, kv_transport=args.kv_transport) as cluster:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(cluster.address))
        run_router(cluster.address, prompts[:2], 4)  # warm-up
        print(f"{args.streams} concurrent streams through the router ...", flush=True)
        remote = run_router(cluster.address, prompts, args.max_tokens)
        remote_long, local_long = [], []
        for _ in range(5):  # alternate, so machine noise hits both paths alike
            remote_long.append(stream_once(stub, long_prompt, 1)[0])
            local_long.append(run_in_process(engine, [long_prompt], 1)["ttft"][0])
        breakdown = phases(cluster, long_prompt)

    rows = []
    for name, r in (("router (disaggregated)", remote), ("in-process engine", local)):
        rows.append([name, args.streams, f"{pct(r['ttft'], .5) * 1e3:.1f}", f"{pct(r['ttft'], .9) * 1e3:.1f}",
                     f"{pct(r['tpot'], .5) * 1e3:.1f}", f"{pct(r['tpot'], .9) * 1e3:.1f}", r["tok/s"]])
    print()
    print(table(["path", "streams", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms", "tok/s"], rows))
    d_ttft, l_ttft = statistics.median(remote_long), statistics.median(local_long)
    print()
    print(table(["1k-token prompt", "ms"], [
        ["TTFT disaggregated (median of 5)", f"{d_ttft * 1e3:.1f}"],
        ["TTFT in-process (median of 5)", f"{l_ttft * 1e3:.1f}"],
        ["overhead", f"{(d_ttft - l_ttft) * 1e3:.1f}"],
        ["KV wire time (built-in tcp)", f"{wire * 1e3:.1f}"],
        ["overhead - wire time (target <= 5 ms)", f"{(d_ttft - l_ttft - wire) * 1e3:.1f}"],
    ]))
    print()
    b = breakdown
    machinery = b["reserve"] + b["prefill rpc"] - b["prefill server"] + b["decode first"]
    print(table(["1k-token prompt, phases by hand (median)", "ms"],
                [[k, f"{v:.1f}"] for k, v in b.items()]
                + [["machinery = reserve + (prefill rpc - prefill server) + decode first", f"{machinery:.1f}"]]))
    png = bar_plot(OUT / "serving.png", f"{args.streams} streams, {args.prompt_len}-token prompts, "
                   f"{args.max_tokens} new tokens", ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"],
                   {name: [pct(r["ttft"], .5) * 1e3, pct(r["ttft"], .9) * 1e3, pct(r["tpot"], .5) * 1e3,
                           pct(r["tpot"], .9) * 1e3] for name, r in (("router", remote), ("in-process", local))},
                   "milliseconds")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
