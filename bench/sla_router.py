"""SLA routing under open-loop Poisson load through the real router: the SLA policy vs round-robin
at rates below and above capacity, and the planner's predictions for the same (M, N) and rates vs
what was measured.

    python bench/sla_router.py [--decode 2] [--requests 80] [--isl 64] [--osl 32] [--loads 0.5,1,1.5]
                               [--dtype float32]

Capacity and targets come from a profile measured through the served system first (`pdserve profile
--router`, so processes sharing the cores are in it): the planner's stage-A goodput for the local
(M=1, N) at targets of 3× its idle TTFT p90 and 2× its idle TPOT p90; both routers start with that profile.
Prints attainment (of accepted requests, and of all), goodput, rejection
rate per policy and rate, then predicted vs measured TTFT / TPOT p90 and attainment; saves
bench/out/sla_router.png. All processes share this machine's cores.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import asyncio
import random
import time

import grpc

from bench.common import OUT, line_plot, pct, table
from router.cluster import Cluster
from router.perf import PerfModel, profile_served
from router.planner import Dist, Workload, analytic, goodput, simulate
from shared.loader.tiny import ensure_tiny_model
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc


async def open_loop(address: str, rate: float, requests: int, isl: int, osl: int, seed: int) -> dict:
    """Poisson arrivals; per accepted request its TTFT and TPOT; refusals counted."""
    rng = random.Random(seed)
    ttft, tpot, refused, failed = [], [], 0, 0

    async with grpc.aio.insecure_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(prompt: list[int]) -> None:
            nonlocal refused, failed
            req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
                max_tokens=osl, temperature=0.0, ignore_eos=True))
            t0, stamps = time.perf_counter(), []
            try:
                async for msg in stub.Generate(req, timeout=600):
                    stamps.extend([time.perf_counter()] * len(msg.token_ids))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1
                else:
                    failed += 1
                return
            ttft.append(stamps[0] - t0)
            tpot.append((stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1))

        tasks, t_start = [], time.perf_counter()
        for _ in range(requests):
            await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.create_task(one([rng.randrange(3, 500) for _ in range(isl)])))
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - t_start
    return {"ttft": ttft, "tpot": tpot, "refused": refused, "failed": failed, "seconds": seconds}


def idle_targets(perf: PerfModel, isl: Dist, osl: Dist, decode: int) -> Workload:
    """The bench's workload at 1 req/s with targets of 3× the planner's idle TTFT p90 and 2× its idle TPOT p90.
    The planner's own p90s at a vanishing rate (its p90 batch is above 1 even then): targets defined on them are
    met at low rates by construction, however noisy the profile's fit (targets from the batch-1 curve were not)."""
    idle = analytic(perf, Workload(1e-6, isl, osl, 1.0, 1.0), 1, decode)
    return Workload(1.0, isl, osl, 3 * idle.ttft_p90_s, 2 * idle.tpot_p90_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, default=2, help="decode instances (one prefill)")
    p.add_argument("--requests", type=int, default=80, help="requests per rate and policy")
    p.add_argument("--isl", type=int, default=64)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--loads", default="0.5,1,1.5", help="rates as multiples of the planner's capacity")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quick-profile", action="store_true", help="a coarse profile (smoke runs)")
    args = p.parse_args(argv)
    model = str(ensure_tiny_model("models/tiny-v32"))
    print("profiling the served system ...", flush=True)
    coarse = {"lengths": (16, 64), "batches": (1, 2), "contexts": (16, 32), "steps": 2} if args.quick_profile else {}
    with Cluster(model, num_decode=args.decode, dtype=args.dtype) as c:
        perf = profile_served(c.address, say=lambda s: print("  " + s, flush=True), **coarse)
    profile = OUT / "sla_router_profile.json"
    profile.parent.mkdir(parents=True, exist_ok=True)
    perf.save(profile)
    w = idle_targets(perf, Dist.parse(str(args.isl)), Dist.parse(str(args.osl)), args.decode)
    ttft_target, tpot_target = w.ttft_p90_s, w.tpot_p90_s

    def at(rate: float) -> Workload:
        return Workload(rate, w.isl, w.osl, w.ttft_p90_s, w.tpot_p90_s)

    capacity = goodput(lambda r: analytic(perf, at(r), 1, args.decode).meets(w), 200.0)
    if capacity <= 0:
        raise SystemExit(f"the planner meets no rate with the profile {profile}: {perf}")
    print(f"targets: TTFT p90 {ttft_target * 1e3:.0f} ms, TPOT p90 {tpot_target * 1e3:.0f} ms; planner capacity "
          f"(M=1, N={args.decode}): {capacity:.2f} req/s", flush=True)
    loads = [float(x) for x in args.loads.split(",")]
    rows, predicted_rows, series = [], [], {"sla": [], "round-robin": []}
    for policy in ("sla", "round-robin"):
        router_flags = ["--policy", policy, "--profile", str(profile), "--ttft-slo-ms", f"{ttft_target * 1e3:.1f}",
                        "--tpot-slo-ms", f"{tpot_target * 1e3:.1f}", "--load-interval", "0.1"]
        with Cluster(model, num_decode=args.decode, dtype=args.dtype, extra_router=router_flags) as c:
            for i, load in enumerate(loads):
                rate = load * capacity
                print(f"{policy}: {rate:.2f} req/s ...", flush=True)
                r = asyncio.run(open_loop(c.address, rate, args.requests, args.isl, args.osl, seed=i))
                met = sum(1 for a, b in zip(r["ttft"], r["tpot"]) if a <= ttft_target and b <= tpot_target)
                accepted = len(r["ttft"])
                att_acc = met / accepted if accepted else 0.0
                series[policy].append(100 * att_acc)
                rows.append([policy, f"{load:g}x", f"{rate:.2f}", f"{100 * att_acc:.0f}%",
                             f"{100 * met / args.requests:.0f}%", f"{met / r['seconds']:.2f}",
                             f"{100 * r['refused'] / args.requests:.0f}%", r["failed"],
                             f"{pct(r['ttft'], 0.9) * 1e3:.0f}", f"{pct(r['tpot'], 0.9) * 1e3:.0f}"])
                if policy == "sla":
                    a = analytic(perf, at(rate), 1, args.decode)
                    b = simulate(perf, at(rate), 1, args.decode, requests=max(500, args.requests), seed=i).prediction
                    predicted_rows.append([f"{rate:.2f}", f"{a.ttft_p90_s * 1e3:.0f}", f"{b.ttft_p90_s * 1e3:.0f}",
                                           f"{pct(r['ttft'], 0.9) * 1e3:.0f}", f"{a.tpot_p90_s * 1e3:.0f}",
                                           f"{b.tpot_p90_s * 1e3:.0f}", f"{pct(r['tpot'], 0.9) * 1e3:.0f}",
                                           f"{b.attainment:.0%}", f"{met / args.requests:.0%}"])
    print(f"\n{args.requests} requests per row, {args.isl} → {args.osl} tokens, 1 prefill + {args.decode} decode, "
          f"{args.dtype}")
    print(table(["policy", "load", "req/s", "attain (accepted)", "attain (all)", "goodput req/s", "refused",
                 "failed", "TTFT p90 ms", "TPOT p90 ms"], rows))
    print("\nplanner (A analytic, B simulated) vs measured, SLA policy")
    print(table(["req/s", "TTFT p90 A", "B", "measured", "TPOT p90 A", "B", "measured", "attain B", "measured"],
                predicted_rows))
    path = line_plot(OUT / "sla_router.png", "SLA attainment of accepted requests vs load",
                     [round(100 * x) for x in loads], series, "load (% of planner capacity)", "attainment %")
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
