"""Cold start as a user meets it: `pdserve up` (the command, a fresh process tree each start) against vLLM's
OpenAI server (`--peer vllm`), started alternately `--starts` times each. Per start: the seconds until the server
is ready (pdserve up: its "Ctrl-C to stop" line, printed once every instance serves; vLLM: /health answers),
then `--rounds` rounds of `--streams` concurrent streamed `/v1/completions` (the same client for both,
bench/peers `stream_completion`; new random prompts every round, so no round reads another's prefix cache).
A round's TTFT is its slowest stream's; the first round is the cold one, and its TTFT over the median of the
later rounds' is the start's cold/warm ratio. One round is as noisy as this shared machine (±20 % between
rounds), so the medians over starts are the result.

    python bench/cold_start.py [--starts 3] [--rounds 5] [--streams 4] [--prompt-len 24] [--max-tokens 8]
                               [--peer vllm] [--model models/demo-v32]

Without `--peer` pdserve serves `--model`; with it both serve the tiny DeepSeek-V3 vLLM's CPU build accepts
(bench/peers). Saves bench/out/cold_start.png (median ready seconds and cold/warm ratio per system).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse  # noqa: E402
import asyncio  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Coroutine  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from bench.common import OUT, bar_plot, table  # noqa: E402
from bench.fleet_faults import UpProcess  # noqa: E402
from bench.peers import VLLM_CONFIG, VllmServer, stream_completion  # noqa: E402
from shared.loader.tiny import ensure_tiny_model, write_checkpoint  # noqa: E402

PDSERVE, VLLM = "pdserve up", "vLLM server"
Stream = Callable[[list[int], int], Coroutine[Any, Any, list[float]]]  # (prompt, max tokens) → token arrivals


@dataclass(frozen=True)
class Start:
    """One fresh start of a system: seconds to ready, and each round's TTFT (its slowest stream's), ms."""

    ready_s: float
    rounds_ms: list[float]

    @property
    def cold_ms(self) -> float:
        return self.rounds_ms[0]

    @property
    def warm_ms(self) -> float:
        return statistics.median(self.rounds_ms[1:])

    @property
    def ratio(self) -> float:
        return self.cold_ms / self.warm_ms


def measure_rounds(stream: Stream, rounds: int, streams: int, prompt_len: int, max_tokens: int,
                   rng: random.Random) -> list[float]:
    """`rounds` rounds of `streams` concurrent streams, new prompts each: each round's slowest TTFT (ms)."""

    async def one_round() -> float:
        prompts = [[rng.randrange(2, 1000) for _ in range(prompt_len)] for _ in range(streams)]

        async def ttft(prompt: list[int]) -> float:
            t0 = time.perf_counter()
            stamps = await stream(prompt, max_tokens)
            return stamps[0] - t0

        return max(await asyncio.gather(*(ttft(p) for p in prompts))) * 1e3

    return [asyncio.run(one_round()) for _ in range(rounds)]


def start_pdserve(model: str, log_dir: Path) -> tuple[float, Stream, Callable[[], object]]:
    t0 = time.monotonic()
    up = UpProcess(["--model", model, "--port", "0", "--http-port", "0"], log_dir).start()
    ready = time.monotonic() - t0
    host, port = up.http_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    return ready, lambda prompt, n: stream_completion(host, int(port), up.model, prompt, n), up.stop


def start_vllm(model: str, log_dir: Path) -> tuple[float, Stream, Callable[[], object]]:
    t0 = time.monotonic()
    server = VllmServer(model, "bfloat16", log=log_dir / "vllm_server.log")
    return time.monotonic() - t0, server.stream, server.close


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default="models/demo-v32", help="without --peer (vLLM needs deepseek_v3)")
    p.add_argument("--peer", action="append", choices=["vllm"], default=[])
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2: the first round is the cold one")
    tmp = tempfile.TemporaryDirectory()
    if "vllm" in args.peer:
        model = str(write_checkpoint(Path(tmp.name) / "v3", "deepseek_v3", **VLLM_CONFIG))
    else:
        model = str(Path(ensure_tiny_model(args.model)).resolve())  # pdserve up runs from the repository
    systems = {PDSERVE: start_pdserve, **({VLLM: start_vllm} if "vllm" in args.peer else {})}
    starts: dict[str, list[Start]] = {name: [] for name in systems}
    rng = random.Random(0)
    try:
        for i in range(args.starts):
            for name, start in (systems.items() if i % 2 == 0 else reversed(systems.items())):  # ABBA
                print(f"start {i + 1}/{args.starts}: {name} ...", flush=True)
                ready, stream, stop = start(model, Path(tmp.name) / f"logs-{i}-{name.split()[0]}")
                try:
                    rounds = measure_rounds(stream, args.rounds, args.streams, args.prompt_len, args.max_tokens,
                                            rng)
                finally:
                    stop()
                starts[name].append(Start(ready, rounds))
                print(f"  ready in {ready:.1f} s; rounds' TTFT {', '.join(f'{r:.0f}' for r in rounds)} ms",
                      flush=True)
    finally:
        tmp.cleanup()
    report(args, starts)


def report(args: argparse.Namespace, starts: dict[str, list[Start]]) -> None:
    print(f"\n{args.streams} concurrent streams of {args.prompt_len} → {args.max_tokens} tokens, "
          f"{args.rounds} rounds a start; a round's TTFT is its slowest stream's")
    print(table(["system", "start", "ready s", "cold TTFT ms", "warm TTFT ms (median)", "cold / warm"],
                [[name, i + 1, f"{s.ready_s:.1f}", f"{s.cold_ms:.0f}", f"{s.warm_ms:.0f}", f"{s.ratio:.2f}"]
                 for name, runs in starts.items() for i, s in enumerate(runs)]))
    summary = {name: (statistics.median(s.ready_s for s in runs), statistics.median(s.ratio for s in runs))
               for name, runs in starts.items()}
    print()
    print(table(["system", "ready s (median)", "cold / warm (median over starts)", "within 1.2x"],
                [[name, f"{ready:.1f}", f"{ratio:.2f}", "yes" if ratio <= 1.2 else "no"]
                 for name, (ready, ratio) in summary.items()]))
    names = list(summary)
    png = bar_plot(OUT / "cold_start.png", "cold start: medians over starts", names,
                   {"ready (s)": [summary[n][0] for n in names],
                    "cold / warm TTFT (%)": [100 * summary[n][1] for n in names]}, "seconds; percent")
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
