"""Soak, overload and concurrency (issue: reliability), against real services on loopback.

* soak: PDSERVE_SOAK_REQUESTS (default 2,000) requests with random cancels, short deadlines and KV
  connections dropped at random by a proxy → no INTERNAL, and afterwards KV blocks, leases, open
  file descriptors and threads of every service are back to baseline;
* 512 concurrent streams through the router, while health and GetLoad keep answering;
* 2× overload for 20 s: the excess is refused with RESOURCE_EXHAUSTED, memory growth is bounded.

Every wait is bounded and fails on a hang. Latencies are printed (run with -s), never asserted.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import statistics
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.cluster import Cluster
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from shared.rpc.service import Credentials
from shared.transfer.tcp import split_endpoint
from tests.helpers import wait_for
from tests.kv_proxy import KVProxy

SOAK_REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "2000"))
ALLOWED = {"OK", "DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}


def _aio_channel(address: str, creds: Credentials | None = None) -> grpc.aio.Channel:
    from shared.rpc.service import aio_channel

    return aio_channel(address, creds)


SLACK = 2  # file descriptors / threads a process may gain over the soak without leaking


def _proc_counts(pid: int) -> tuple[int, int]:
    """(open file descriptors, threads) of a process."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _loads(c: Cluster) -> tuple[internal_pb2.LoadReport, internal_pb2.LoadReport]:
    async with _aio_channel(c.decode_addrs[0]) as dch, _aio_channel(c.prefill_addrs[0]) as pch:
        md = c.credentials.metadata
        dec = await internal_pb2_grpc.DecodeStub(dch).GetLoad(internal_pb2.LoadRequest(), timeout=5, metadata=md)
        pre = await internal_pb2_grpc.PrefillStub(pch).GetLoad(internal_pb2.LoadRequest(), timeout=5, metadata=md)
    return dec, pre


def _clean(c: Cluster) -> bool:
    dec, pre = asyncio.run(_loads(c))
    return (dec.free_blocks == dec.total_blocks and dec.active_leases == 0 and dec.running == 0
            and dec.waiting == 0 and pre.free_blocks == pre.total_blocks and pre.running == 0 and pre.waiting == 0)


async def _one(stub, rng: random.Random, outcomes: dict[str, int]) -> None:
    roll = rng.random()
    prompt = [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))]
    sp = generation_pb2.SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]),
                                       ignore_eos=True)
    timeout = rng.uniform(0.01, 0.4) if roll < 0.15 else 60
    cancel_after = rng.randint(0, 3) if 0.15 <= roll < 0.3 else None
    call = stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=sp),
                         timeout=timeout)
    outcome = "OK"
    try:
        if cancel_after == 0:
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
            outcome = "CANCELLED"
        else:
            n = 0
            async for msg in call:
                n += len(msg.token_ids)
                if cancel_after is not None and n >= cancel_after:
                    call.cancel()
                    outcome = "CANCELLED"
                    break
    except grpc.aio.AioRpcError as exc:
        outcome = exc.code().name
    except asyncio.CancelledError:
        outcome = "CANCELLED"
    outcomes[outcome] = outcomes.get(outcome, 0) + 1


async def _run_many(address: str, n: int, concurrency: int, seed: int) -> dict[str, int]:
    rng, outcomes = random.Random(seed), {}
    sem = asyncio.Semaphore(concurrency)
    async with _aio_channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def guarded() -> None:
            async with sem:
                await _one(stub, rng, outcomes)

        await asyncio.wait_for(asyncio.gather(*(guarded() for _ in range(n))), timeout=max(600, n * 0.5))
    return outcomes


def test_soak_with_cancels_deadlines_and_transport_errors(served_model, tmp_path):
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_decode=["--advertise-host", "127.0.0.2", "--lease-seconds", "5"]) as c:
        with c.channel(c.decode_addrs[0]) as ch:
            stub = internal_pb2_grpc.DecodeStub(ch)
            dest = stub.Reserve(internal_pb2.ReserveRequest(request_id="probe", num_prompt_tokens=4, max_tokens=4),
                                timeout=10).destination
            stub.Release(internal_pb2.ReleaseRequest(lease_id=dest.lease_id), timeout=10)
        proxy = KVProxy(split_endpoint(dest.endpoint)[1], drop_fraction=0.05, seed=1)
        try:
            pids = {addr: c.process(addr).pid for addr in [c.address, *c.prefill_addrs, *c.decode_addrs]}
            asyncio.run(_run_many(c.address, 200, 24, seed=0))  # warm-up: pools and caches reach their size
            assert wait_for(lambda: _clean(c), timeout=40)
            before = {addr: _proc_counts(pid) for addr, pid in pids.items()}
            t0 = time.monotonic()
            outcomes = asyncio.run(_run_many(c.address, SOAK_REQUESTS, 24, seed=1))
            seconds = time.monotonic() - t0
            print(f"\nsoak: {SOAK_REQUESTS} requests in {seconds:.0f}s, outcomes {outcomes}, "
                  f"KV connections dropped {proxy.dropped}")
            assert sum(outcomes.values()) == SOAK_REQUESTS
            assert set(outcomes) <= ALLOWED, outcomes  # never INTERNAL / UNKNOWN
            assert outcomes.get("OK", 0) > SOAK_REQUESTS // 2 and proxy.dropped > 0
            assert wait_for(lambda: _clean(c), timeout=60), asyncio.run(_loads(c))
            def settled() -> bool:
                # A leak per request would add hundreds over the soak; gRPC's own event-engine thread
                # pool resizes itself and a client's last connection may linger, so allow 2 of each.
                return all(all(now <= was + SLACK for now, was in zip(_proc_counts(pid), before[addr]))
                           for addr, pid in pids.items())

            assert wait_for(settled, timeout=60), {a: (before[a], _proc_counts(p)) for a, p in pids.items()}
            assert all(c.process(a).poll() is None for a in pids)  # nothing crashed
        finally:
            proxy.close()


# A probe's connection may be refused or dropped while its TCP handshake waits for a core (two cores,
# other programs beside the test: gRPC's "tcp handshaker shutdown"). That is UNAVAILABLE, and gRPC's own
# answer is to connect again: a probe retries it within this many seconds, counted in its latency (the
# answer still has to come, and every retry is reported). Any other status fails the test at once.
PROBE_BUDGET_S = 30.0


def _with_reconnects(call, retries: list[str], budget_s: float = PROBE_BUDGET_S):
    """`call()`, called again while it fails with UNAVAILABLE for at most `budget_s` seconds (each such
    failure's details appended to `retries`); the last error once the budget is spent."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                raise
            retries.append(exc.details() or "UNAVAILABLE")
            time.sleep(0.2)


async def _with_reconnects_async(call, retries: list[str], budget_s: float = PROBE_BUDGET_S):
    """`_with_reconnects` for a coroutine-returning `call`."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return await call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                raise
            retries.append(exc.details() or "UNAVAILABLE")
            await asyncio.sleep(0.2)


class _Failure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_probe_reconnects_on_unavailable_only_and_within_its_budget():
    """A dropped handshake (UNAVAILABLE) is retried and reported; any other status, or UNAVAILABLE past the
    budget, is the probe's answer."""
    answers = iter([_Failure(grpc.StatusCode.UNAVAILABLE, "tcp handshaker shutdown")] * 2 + ["load"])

    def flaky():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    retries: list[str] = []
    assert _with_reconnects(flaky, retries) == "load"
    assert retries == ["tcp handshaker shutdown"] * 2
    for code, budget in ((grpc.StatusCode.INTERNAL, 30.0), (grpc.StatusCode.UNAVAILABLE, 0.0)):
        calls: list[int] = []

        def failing(code: grpc.StatusCode = code, calls: list[int] = calls):
            calls.append(1)
            raise _Failure(code, "no")

        with pytest.raises(_Failure) as caught:
            _with_reconnects(failing, [], budget_s=budget)
        assert caught.value.code() == code and len(calls) == 1
    retries.clear()
    assert asyncio.run(_with_reconnects_async(lambda: asyncio.sleep(0, "load"), retries)) == "load" and not retries


def _probe_process(router: str, decode: str, token: str, ready, stop, out) -> None:
    """In its own process (the test's event loop is busy with 512 streams): probe the router's and
    decode's health and decode's GetLoad every 50 ms until `stop`; put each probe's latencies (a
    reconnect's wait included) and the reconnects on `out`, or the error that ended the probing."""
    from shared.rpc.service import channel

    seconds: dict[str, list[float]] = {"router health": [], "decode health": [], "decode GetLoad": []}
    retries: list[str] = []
    creds = Credentials(token)
    try:
        with channel(router) as rch, channel(decode, creds) as dch:
            probes = {"router health": lambda: health_pb2_grpc.HealthStub(rch).Check(
                          health_pb2.HealthCheckRequest(), timeout=10),
                      "decode health": lambda: health_pb2_grpc.HealthStub(dch).Check(
                          health_pb2.HealthCheckRequest(), timeout=10),
                      "decode GetLoad": lambda: internal_pb2_grpc.DecodeStub(dch).GetLoad(
                          internal_pb2.LoadRequest(), timeout=10)}
            for probe in probes.values():  # connect first: the numbers are answers, not handshakes
                _with_reconnects(probe, retries)
            ready.set()
            while not stop.is_set():
                for name, probe in probes.items():
                    t0 = time.perf_counter()
                    _with_reconnects(probe, retries)
                    seconds[name].append(time.perf_counter() - t0)
                time.sleep(0.05)
    except grpc.RpcError as exc:
        out.put(f"{exc.code().name}: {exc.details()}")
        ready.set()  # the test waits no longer: the error is on `out`
        return
    out.put((seconds, retries))


def test_512_concurrent_streams_and_prompt_health(served_model, tmp_path):
    streams = 512
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_decode=["--max-num-seqs", str(streams)]) as c:
        async def run() -> tuple[list[int], int, list[float]]:
            peak, stop = 0, asyncio.Event()
            async with _aio_channel(c.address) as ch, _aio_channel(c.decode_addrs[0]) as dch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                sp = generation_pb2.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

                async def stream(i: int) -> int:
                    req = generation_pb2.GenerateRequest(prompt_token_ids=[3 + i % 500, 7, 9], sampling_params=sp)
                    return sum([len(m.token_ids) async for m in stub.Generate(req, timeout=300)])

                async def watch() -> None:
                    nonlocal peak
                    while not stop.is_set():
                        load = await _with_reconnects_async(lambda: internal_pb2_grpc.DecodeStub(dch).GetLoad(
                            internal_pb2.LoadRequest(), timeout=10, metadata=c.credentials.metadata), reconnects)
                        peak = max(peak, load.running)
                        await asyncio.sleep(0.1)

                watcher = asyncio.create_task(watch())
                counts = await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(streams))), 400)
                stop.set()
                await watcher
                return counts, peak

        ctx = multiprocessing.get_context("spawn")
        probe_ready, probe_stop, probe_out = ctx.Event(), ctx.Event(), ctx.Queue()
        prober = ctx.Process(target=_probe_process, args=(c.address, c.decode_addrs[0], c.token, probe_ready,
                                                          probe_stop, probe_out))
        prober.start()
        reconnects: list[str] = []  # the watcher's GetLoad calls that met a dropped connection, retried
        try:
            connected = probe_ready.wait(120) and prober.is_alive()
            counts, peak = asyncio.run(run()) if connected else (None, 0)
        finally:
            probe_stop.set()
        probed = probe_out.get(timeout=60)
        prober.join(30)
        assert not isinstance(probed, str), f"a probe failed: {probed}"
        assert counts is not None, "the probes never connected"
        latencies, probe_reconnects = probed
        print(f"\n{streams} streams: peak running in decode {peak}; reconnects retried: watcher "
              f"{len(reconnects)} {sorted(set(reconnects))}, probes {len(probe_reconnects)} "
              f"{sorted(set(probe_reconnects))}; probes under load (ms):")
        for name, values in latencies.items():
            values.sort()
            print(f"  {name}: n={len(values)} p50 {1e3 * statistics.median(values):.1f} "
                  f"p99 {1e3 * values[int(0.99 * (len(values) - 1))]:.1f} max {1e3 * values[-1]:.1f}")
        assert counts == [64] * streams
        assert peak > 64  # more streams at once than the old one-thread-per-stream limit
        assert wait_for(lambda: _clean(c), timeout=40)


def _rejection_probe_process(router: str, stop, out) -> None:
    """In its own process: one Generate every 20 ms against the saturated router; put the answer
    times of the refusals (RESOURCE_EXHAUSTED) on `out`."""
    seconds: list[float] = []
    sp = generation_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(router) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                for _ in stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[4, 5], sampling_params=sp),
                                       timeout=60):
                    pass
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    seconds.append(time.perf_counter() - t0)
            time.sleep(0.02)
    out.put(seconds)


def test_overload_at_twice_capacity(served_model, tmp_path):
    """64 clients in a loop against a router that admits 32 requests at a time, for 20 s: the excess
    gets RESOURCE_EXHAUSTED (not a queue that grows), everything else finishes, memory stays bounded."""
    capacity, seconds = 32, 20.0
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_router=["--max-concurrent-requests", str(capacity)]) as c:
        pids = {addr: c.process(addr).pid for addr in [c.address, *c.prefill_addrs, *c.decode_addrs]}
        asyncio.run(_run_many(c.address, 64, capacity, seed=5))  # warm-up
        rss_before = {a: _rss_mb(p) for a, p in pids.items()}

        async def run() -> tuple[dict[str, int], list[float]]:
            outcomes: dict[str, int] = {}
            rejected: list[float] = []
            end = time.monotonic() + seconds
            async with _aio_channel(c.address) as ch:
                stub = generation_pb2_grpc.GenerationStub(ch)
                sp = generation_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

                async def client(i: int) -> None:
                    while time.monotonic() < end:
                        t0 = time.perf_counter()
                        try:
                            req = generation_pb2.GenerateRequest(prompt_token_ids=[3 + i, 5, 7], sampling_params=sp)
                            async for _ in stub.Generate(req, timeout=60):
                                pass
                            code = "OK"
                        except grpc.aio.AioRpcError as exc:
                            code = exc.code().name
                            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                                rejected.append(time.perf_counter() - t0)
                                await asyncio.sleep(0.01)  # a client backs off a little before retrying
                        outcomes[code] = outcomes.get(code, 0) + 1

                await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(2 * capacity))), seconds + 120)
            return outcomes, rejected

        ctx = multiprocessing.get_context("spawn")
        probe_stop, probe_out = ctx.Event(), ctx.Queue()
        prober = ctx.Process(target=_rejection_probe_process, args=(c.address, probe_stop, probe_out))
        prober.start()
        try:
            outcomes, rejected = asyncio.run(run())
        finally:
            probe_stop.set()
        probed = sorted(probe_out.get(timeout=120))
        prober.join(30)
        growth = {a: _rss_mb(p) - rss_before[a] for a, p in pids.items()}
        rejected.sort()

        def ms(values: list[float], q: float) -> str:
            return f"{1e3 * values[int(q * (len(values) - 1))]:.1f}" if values else "-"

        print(f"\noverload 2x for {seconds:.0f}s: {outcomes}; refusals seen by the 64 loaded clients p50 "
              f"{ms(rejected, 0.5)} / p99 {ms(rejected, 0.99)} ms, by a probe in its own process (n={len(probed)}) "
              f"p50 {ms(probed, 0.5)} / p99 {ms(probed, 0.99)} ms; RSS growth MB "
              f"{({a: round(g) for a, g in growth.items()})}")
        assert set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"}, outcomes
        assert outcomes["OK"] > 0 and outcomes["RESOURCE_EXHAUSTED"] > 0
        assert all(g < 256 for g in growth.values()), growth
        assert wait_for(lambda: _clean(c), timeout=40)
