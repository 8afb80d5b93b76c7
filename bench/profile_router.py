"""Where the router spends its CPU per streamed token, gRPC API vs OpenAI-compatible HTTP API.

    python bench/profile_router.py [--streams 64] [--prompt-len 128] [--max-tokens 128] [--rounds 2]
                                   [--py-spy PATH] [--vllm-bench] [--top 25]

Starts router + 1 prefill + 1 decode (the tiny model) and runs the same concurrent streams through the
router's gRPC API and its HTTP API (bench/serving's own clients; with `--vllm-bench` also vLLM's
`vllm bench serve`, which sends text prompts), alternating. For every run: the CPU seconds per 1k
output tokens of the router, the prefill and the decode (/proc: all threads and child processes), and
of the load generator (this process for the own clients; `vllm bench serve`'s child process, its start
included), and TPOT p50. With py-spy (PyPI's `py-spy`, on PATH or given by --py-spy; not a project
dependency) the router is sampled during each run (on-CPU samples only; `--native` adds C frames and
stops the router for each sample, which slows it) and the functions with the most self and inclusive
samples are printed per API; the raw collapsed stacks are saved in bench/out/profile_router/.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import os
import resource
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch

from bench.common import OUT, pct, table
from bench.hostload import tree_seconds
from bench.peers import stream_completion, vllm_bench_serve
from bench.serving import from_vllm_bench, run_router, run_streams
from router.cluster import Cluster
from shared.loader.tiny import ensure_tiny_model


def frame_name(frame: str) -> str:
    """py-spy's `function (file.py:line)` without the line: samples of one function add up."""
    name, _, where = frame.partition(" (")
    path = where.rpartition(":")[0] or where.rstrip(")")
    parts = Path(path).parts
    short = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else "/".join(parts[-2:])
    return f"{name} ({short})"


def summarize(raw: Path) -> tuple[int, Counter, Counter]:
    """(samples, self samples per function, inclusive samples per function) of py-spy's raw output."""
    total, own, incl = 0, Counter(), Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")[1:]]  # the first is the thread
        if not frames:
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return total, own, incl


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/tiny-v32")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy binary (default: on PATH)")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too (grpc, json, h11)")
    p.add_argument("--vllm-bench", action="store_true", help="also the HTTP API driven by `vllm bench serve`")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    model = str(ensure_tiny_model(args.model))
    out = OUT / "profile_router"
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, 1000, (args.streams, args.prompt_len), generator=g).tolist()
    stats: dict[str, list[tuple[dict[str, float], dict]]] = {}  # path → per run (CPU s / 1k tokens, results)
    raws: dict[str, list[Path]] = {}
    with Cluster(model, dtype=args.dtype, extra_router=["--http-port", "0"],
                 extra_decode=["--max-num-seqs", str(args.streams)]) as cluster:
        pid = cluster.process(cluster.address).pid
        pids = {"router": pid, "prefill": cluster.process(cluster.prefill_addrs[0]).pid,
                "decode": cluster.process(cluster.decode_addrs[0]).pid}

        def cpu() -> dict[str, float]:
            own, children = os.times(), resource.getrusage(resource.RUSAGE_CHILDREN)
            return {**{k: tree_seconds(v) for k, v in pids.items()},
                    "load generator": own.user + own.system + children.ru_utime + children.ru_stime}
        host, _, port = cluster.http_address.rpartition(":")
        served = Path(model).resolve().name

        def http(prompt: list[int], n: int):
            return stream_completion(host, int(port), served, prompt, n)

        paths = {"gRPC [own client]": lambda n, mt, tag: run_router(cluster.address, prompts[:n], mt),
                 "HTTP [own client]": lambda n, mt, tag: run_streams(http, prompts[:n], mt)}
        if args.vllm_bench:
            paths["HTTP [vllm bench serve]"] = lambda n, mt, tag: from_vllm_bench(vllm_bench_serve(
                f"http://{cluster.http_address}", served, model, args.prompt_len, mt, n, n,
                out / f"vllm-bench-{tag}.json"))
        for run in paths.values():
            run(2, 4, "warmup")
        for r in range(args.rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                slug = name.split()[0].lower() + ("-vb" if "vllm" in name else "")
                raw = out / f"{slug}-r{r}.txt"
                raw.unlink(missing_ok=True)
                spy = None
                if args.py_spy:
                    spy = subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--rate", str(args.rate),
                                            "--format", "raw", "--output", str(raw),
                                            *(["--native"] if args.native else ["--nonblocking"])],
                                           stdout=subprocess.DEVNULL, stderr=open(f"{raw}.log", "w"))
                    time.sleep(1.0)  # attached before the first request
                print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
                c0 = cpu()  # the cluster idles while `vllm bench serve` starts
                res = paths[name](args.streams, args.max_tokens, f"r{r}")
                c1 = cpu()
                if spy is not None:
                    spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
                    spy.wait(60)
                    raws.setdefault(name, []).append(raw)
                tokens = args.streams * args.max_tokens
                stats.setdefault(name, []).append(({k: (c1[k] - c0[k]) / tokens * 1e3 for k in c0}, res))
    print()
    print(f"{args.streams} streams, {args.prompt_len} → {args.max_tokens} tokens, {args.rounds} round(s)")
    procs = ["router", "prefill", "decode", "load generator"]
    print(table(["path", *[f"{k} CPU s / 1k tok" for k in procs], "TPOT p50 ms", "tok/s"], [
        [name, *[" / ".join(f"{c[k]:.3f}" for c, _ in runs) for k in procs],
         " / ".join(f"{pct(r['tpot'], .5) * 1e3:.1f}" for _, r in runs),
         " / ".join(f"{r['tok/s']:.0f}" for _, r in runs)] for name, runs in stats.items()]))
    print("(one value per round)")
    for name, files in raws.items():
        own, incl = Counter(), Counter()
        n = 0
        for f in files:
            if f.exists():
                t, o, i = summarize(f)
                n += t
                own.update(o)
                incl.update(i)
        if not n:
            print(f"\n{name}: py-spy wrote no samples")
            continue
        print(f"\n{name}: {n} on-CPU samples of the router (all threads), top self time")
        print(table(["function (file)", "self %"], [[f, f"{c / n * 100:.1f}"] for f, c in own.most_common(args.top)]))
        print(f"\n{name}: top inclusive time")
        print(table(["function (file)", "incl %"], [[f, f"{c / n * 100:.1f}"] for f, c in incl.most_common(args.top)]))


if __name__ == "__main__":
    main()
