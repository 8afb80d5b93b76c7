"""What a streamed gRPC message costs: N concurrent server streams of one DecodeResponse a step (as decode
answered each request before the token bus) vs one stream of N-entry batches a step (the token bus), in lockstep.

    python bench/grpc_streams.py [--streams 64] [--steps 128] [--step-ms 10] [--rounds 2]

The server (grpc.aio, the Decode service's own messages) runs in a child process and releases every stream's
next message each `--step-ms` (a decode step); the client (grpc.aio) reads them. Prints the CPU µs per token of each
side (process time over the run / tokens), per mode and round. This is where bench/token_bus.py's saving comes from.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

_sys.path.insert(0, str(_Path(__file__).resolve().parents[1]))  # run as `python bench/X.py` too

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import grpc

from bench.common import OUT, bar_plot, table
from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc

MODES = ("per-request streams", "one batched stream")


class _Clock:
    """The steps: every stream's message s goes once step s has come."""

    def __init__(self) -> None:
        self.step, self._tick = -1, asyncio.Event()

    async def reached(self, s: int) -> None:
        while self.step < s:
            await self._tick.wait()

    async def run(self, steps: int, period_s: float) -> None:
        for s in range(steps):
            await asyncio.sleep(period_s)
            self.step, tick, self._tick = s, self._tick, asyncio.Event()
            tick.set()


class _Server(internal_pb2_grpc.DecodeServicer):
    def __init__(self, clock: _Clock, streams: int, steps: int):
        self.clock, self.streams, self.steps = clock, streams, steps

    async def Decode(self, request, context):
        batched = request.request_id == "batched"
        for s in range(self.steps):
            await self.clock.reached(s)
            if batched:  # a step's tokens for every request in one message, each naming its request
                yield internal_pb2.DecodeResponse(token_ids=list(range(self.streams)), text="abcd" * self.streams)
            else:
                yield internal_pb2.DecodeResponse(token_ids=[s], text="abcd")


def _serve(args: argparse.Namespace, ports: mp.Queue, runs: mp.Queue) -> None:
    async def main() -> None:
        server, clock = grpc.aio.server(), _Clock()
        internal_pb2_grpc.add_DecodeServicer_to_server(_Server(clock, args.streams, args.steps), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, runs.get):
            clock.step = -1
            start = time.process_time()
            await clock.run(args.steps, args.step_ms / 1e3)
            await asyncio.sleep(0.3)  # the last messages out
            ports.put(time.process_time() - start)
        await server.stop(0)

    asyncio.run(main())


async def _client(port: int, mode: str, streams: int, runs: mp.Queue) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = internal_pb2_grpc.DecodeStub(channel)
        await channel.channel_ready()

        async def read(rid: str) -> int:
            return sum([1 async for _ in stub.Decode(internal_pb2.DecodeRequest(request_id=rid))])

        start = time.process_time()
        runs.put(True)
        ids = ["batched"] if mode == MODES[1] else [f"r{i}" for i in range(streams)]
        await asyncio.gather(*(read(rid) for rid in ids))
        return time.process_time() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    ports, runs = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_serve, args=(args, ports, runs))
    server.start()
    port, rows, tokens = ports.get(timeout=60), [], args.streams * args.steps
    per_token: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    try:
        for r in range(args.rounds):
            for mode in MODES:
                client_s = asyncio.run(_client(port, mode, args.streams, runs))
                server_s = ports.get(timeout=600)
                per_token[mode].append((client_s / tokens * 1e6, server_s / tokens * 1e6))
                rows.append([r + 1, mode, *(f"{us:.1f}" for us in per_token[mode][-1])])
    finally:
        runs.put(False)
        server.join(30)
    print(f"\n{args.streams} streams × {args.steps} steps of {args.step_ms:g} ms; CPU µs per token "
          "(process time over the run, clock and all)")
    print(table(["round", "mode", "client µs / token", "server µs / token"], rows))
    plot = bar_plot(OUT / "grpc_streams.png", f"CPU per streamed token, {args.streams} streams (median of rounds)",
                    ["client (router)", "server (decode front)"],
                    {mode: [statistics.median(x[side] for x in per_token[mode]) for side in (0, 1)] for mode in MODES},
                    "CPU µs / token")
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
