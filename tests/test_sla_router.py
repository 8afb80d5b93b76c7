"""The SLA-aware router on real services: load-aware choice of the decode instance, early refusal
before any prefill work, and an instance taken out when it dies and taken back after a restart."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest

from router.cluster import Cluster
from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.helpers import wait_for


def _generate(c: Cluster, prompt: list[int], tpot_ms: float = 0.0) -> list[int]:
    with c.channel(c.address) as ch:
        req = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt, sla=generation_pb2.Sla(tpot_ms=tpot_ms),
            sampling_params=generation_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        return [t for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60) for t in m.token_ids]


def _admitted(c: Cluster, address: str) -> int:
    with c.channel(address) as ch:
        load = internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=10)
    return sum(r.admitted for r in load.ranks)


def _prefill_prompt_tokens(c: Cluster) -> float:
    total = 0.0
    for addr in c.prefill_addrs:
        body = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_ports[addr]}/metrics", timeout=5).read().decode()
        key = 'pdserve_tokens_total{kind="prompt",service="prefill"}'
        total += sum(float(x.split()[-1]) for x in body.splitlines() if x.startswith(key))
    return total


@pytest.fixture(scope="module")
def cluster(served_model, tmp_path_factory):
    with Cluster(str(served_model), num_prefill=2, num_decode=2, dtype="float32",
                 log_dir=tmp_path_factory.mktemp("sla-logs"),
                 extra_prefill=["--metrics-port", "0"], extra_decode=["--lease-seconds", "60"],
                 extra_router=["--load-interval", "0.2"]) as c:
        yield c


def test_loaded_decode_is_avoided_and_an_unmeetable_tpot_is_refused_before_prefill(cluster):
    c = cluster
    busy, idle = c.decode_addrs
    with c.channel(busy) as ch:  # 20 reservations make `busy` a loaded instance in its load reports
        stub = internal_pb2_grpc.DecodeStub(ch)
        leases = [stub.Reserve(internal_pb2.ReserveRequest(request_id=f"load{i}", num_prompt_tokens=200,
                                                           max_tokens=200), timeout=10) for i in range(20)]
    try:
        wait_for(lambda: False, timeout=1.0)  # a few load polls
        before = (_admitted(c, busy), _admitted(c, idle))
        for i in range(6):
            assert len(_generate(c, [5 + i, 6, 7, 8])) == 4
        assert (_admitted(c, busy), _admitted(c, idle)) == (before[0], before[1] + 6)
    finally:
        with c.channel(busy) as ch:
            for lease in leases:
                internal_pb2_grpc.DecodeStub(ch).Release(internal_pb2.ReleaseRequest(
                    lease_id=lease.destination.lease_id), timeout=10)

    prompt_tokens = _prefill_prompt_tokens(c)
    with pytest.raises(grpc.RpcError) as err:  # 0.001 ms per token: no pair can, so no prefill starts
        _generate(c, [9, 9, 9], tpot_ms=0.001)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "SLA" in err.value.details()
    assert dict(err.value.trailing_metadata()).get("retry-after-ms")
    assert _prefill_prompt_tokens(c) == prompt_tokens
    with pytest.raises(grpc.RpcError) as err:
        _generate(c, [9, 9, 9], tpot_ms=float("nan"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sla.tpot_ms" in err.value.details()


def test_a_dead_instance_is_taken_out_and_back_in_after_restart(cluster):
    c = cluster
    first, second = c.decode_addrs
    os.kill(c.process(first).pid, signal.SIGKILL)
    c.process(first).wait(10)
    for i in range(4):  # every request succeeds on the live instance (fail-over covers the first poll gap)
        assert len(_generate(c, [20 + i, 3, 4])) == 4
    c.restart(first)
    assert wait_for(lambda: (_generate(c, [30, 3, 4]), _admitted(c, first) > 0)[1], timeout=30), \
        "the restarted instance was not taken back"
    assert _admitted(c, second) >= 4


def test_repeated_prefixes_go_to_the_prefill_instance_that_caches_them(cluster):
    """Each prefill instance streams its prefix cache's events to the router's index; with two instances a
    prompt sharing a cached prefix is sent to the one holding it (usage reports the hit every time)."""
    c = cluster
    system = [(7 * i) % 400 + 3 for i in range(80)]  # a shared "system prompt" of whole blocks
    with c.channel(c.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        def cached(suffix: list[int]) -> int:
            req = generation_pb2.GenerateRequest(prompt_token_ids=system + suffix, sampling_params=generation_pb2.
                                                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            return [m for m in stub.Generate(req, timeout=60)][-1].usage.cached_prompt_tokens

        assert cached([1]) == 0
        wait_for(lambda: False, timeout=1.0)  # the holder's events reach the router's index
        hits = [cached([2 + i, 9]) for i in range(6)]  # each a coin toss between the two, were the index not read
    assert all(h >= 64 for h in hits), hits


def test_dns_names_stand_for_every_address_they_resolve_to():
    """`dns:NAME:PORT` (a headless service): pods that appear are added, vanished ones dropped, a
    DNS failure keeps what is known, static addresses always stay; the real resolver works."""
    import asyncio

    from router.pools import Pool, resolve_addresses

    answers = [["10.0.0.1:7000"], ["10.0.0.1:7000", "10.0.0.2:7000"], OSError("no DNS"), ["10.0.0.2:7000"]]

    async def fake(host: str, port: str) -> list[str]:
        assert (host, port) == ("decode-headless", "7000")
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run() -> list[list[str]]:
        pool = Pool("decode", ["127.0.0.1:1", "dns:decode-headless:7000"], internal_pb2_grpc.DecodeStub)
        seen = [[x.address for x in pool.instances]]
        for _ in range(4):
            kept = {x.address: x for x in pool.instances}
            await pool.refresh(fake)
            seen.append([x.address for x in pool.instances])
            assert all(kept[a] is x for a, x in zip(seen[-1], pool.instances) if a in kept)  # views kept
        return seen

    assert asyncio.run(run()) == [["127.0.0.1:1"], ["127.0.0.1:1", "10.0.0.1:7000"],
                                  ["127.0.0.1:1", "10.0.0.1:7000", "10.0.0.2:7000"],
                                  ["127.0.0.1:1", "10.0.0.1:7000", "10.0.0.2:7000"], ["127.0.0.1:1", "10.0.0.2:7000"]]
    assert "127.0.0.1:7000" in asyncio.run(resolve_addresses("localhost", "7000"))


def test_an_empty_pool_file_is_read_again_at_once_and_a_missing_one_is_not(tmp_path, caplog):
    """A launcher starts the router beside its instances on an empty pool file and writes the addresses once they
    listen: the router lists them within EMPTY_FILES_POLL_S, not at its discovery period (5 s), and its load
    poller asks them at once. A pool file that does not exist is warned of once a period, not every 50 ms."""
    import asyncio

    from router.pools import EMPTY_FILES_POLL_S, Pool

    empty, missing = tmp_path / "decode", tmp_path / "absent"
    empty.write_text("")

    async def run() -> tuple[float, int, int]:
        pool = Pool("decode", [f"file:{empty}"], internal_pb2_grpc.DecodeStub)
        lost = Pool("decode", [f"file:{missing}"], internal_pb2_grpc.DecodeStub)
        tasks = [asyncio.create_task(p.discover(5.0)) for p in (pool, lost)]
        tasks.append(asyncio.create_task(pool.poll_loads(5.0, ())))
        await asyncio.sleep(0.3)
        assert pool.instances == [] and lost.instances == []
        empty.write_text("127.0.0.1:1\n")
        t0 = time.monotonic()
        while not pool.instances:
            await asyncio.sleep(0.005)
        listed = time.monotonic() - t0
        while pool.instances[0].failures == 0:  # its first GetLoad (nothing listens there): asked at once
            await asyncio.sleep(0.005)
        for task in tasks:
            task.cancel()
        return listed, time.monotonic() - t0, sum("cannot read" in r.getMessage() for r in caplog.records)

    listed, polled, warnings = asyncio.run(run())
    assert listed <= 1.0 and polled <= 2.5, (listed, polled)  # within 50 ms and one call, on a loaded machine
    assert warnings == 1  # the missing file: read once in 0.3 s, at its 5 s period
    assert EMPTY_FILES_POLL_S <= 0.05


def test_priority_classes_share_the_targets_differently():
    """An urgent request (priority < 0) may use its whole target, a normal one 90%, a background one
    (> 0) 63%: under the same prediction the background request is refused first."""
    from router.perf import PerfModel
    from router.policy import DecodeView, PrefillView, Rejected, Request, SlaPolicy

    perf = PerfModel(decode_base_s=0.02, decode_per_seq_s=0.0, decode_per_context_token_s=0.0)
    policy, pre, dec = SlaPolicy(perf, seed=0), [PrefillView("p")], [DecodeView("d")]
    for tpot_ms, admitted in ((21.0, {-1}), (25.0, {-1, 0}), (33.0, {-1, 0, 2})):  # the step is 20 ms
        for priority in (-1, 0, 2):
            req = Request(16, 8, 0.0, tpot_ms / 1e3, priority=priority)
            if priority in admitted:
                assert policy.choose(req, pre, dec)[0].decode == 0
            else:
                with pytest.raises(Rejected):
                    policy.choose(req, pre, dec)


def test_an_urgent_request_overtakes_queued_background_prompts(served_model, tmp_path):
    """GenerateRequest.priority reaches the prefill queue: behind eight long background prompts (priority
    5) on one prefill instance, an urgent prompt (priority -1) sent last gets its first token before most."""
    import threading
    import time

    from tests.helpers import random_prompts

    prompts = random_prompts(9, [160] * 9, 512, seed=71)
    done: dict[int, float] = {}
    # 4 tokens a step, 40 steps a prompt: on a loaded machine the eight still arrive while the first prefills
    # (at 8 a step they could trickle in about as fast as they drained, and never queue five deep)
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs",
                 extra_prefill=["--max-prefill-tokens", "4"],
                 extra_router=["--overflow-prefill-tokens", "0"]) as c:  # the queue is the test, not its overflow
        def send(i: int, priority: int) -> None:
            with c.channel(c.address) as ch:
                req = generation_pb2.GenerateRequest(prompt_token_ids=prompts[i], priority=priority,
                                                     sampling_params=generation_pb2.SamplingParams(max_tokens=1))
                list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))
            done[i] = time.perf_counter()

        def waiting() -> int:
            with c.channel(c.prefill_addrs[0]) as ch:
                return internal_pb2_grpc.PrefillStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=10).waiting

        background = [threading.Thread(target=send, args=(i, 5)) for i in range(8)]
        for t in background:
            t.start()
        assert wait_for(lambda: waiting() >= 5, 60)  # queued behind the one prefilling
        send(8, -1)
        for t in background:
            t.join()
    later = sum(1 for i in range(8) if done[i] > done[8])
    print(f"background prompts finished after the urgent one: {later} of 8")
    assert later >= 5


def test_admission_wait_holds_a_request_until_a_pair_fits_or_its_ttft_cannot_be_made(served_model, tmp_path):
    """--admission-wait-ms: while 30 reservations load the only decode past the TPOT target, a request is
    held (not refused) and served once they are released; one whose TTFT target waiting cannot make is
    refused as soon as that is so."""
    import threading
    import time

    flags = ["--tpot-slo-ms", "40", "--admission-wait-ms", "8000", "--load-interval", "0.1"]
    with Cluster(str(served_model), dtype="float32", log_dir=tmp_path / "logs", extra_router=flags) as c:
        assert len(_generate(c, [5, 6, 7])) == 4  # idle: admitted at once
        with c.channel(c.decode_addrs[0]) as ch:
            stub = internal_pb2_grpc.DecodeStub(ch)
            leases = [stub.Reserve(internal_pb2.ReserveRequest(request_id=f"load{i}", num_prompt_tokens=200,
                                                               max_tokens=200), timeout=10) for i in range(30)]
            time.sleep(0.5)  # a few load polls
            result: dict[str, object] = {}

            def held() -> None:
                t0 = time.perf_counter()
                result["tokens"], result["seconds"] = _generate(c, [8, 9, 10]), time.perf_counter() - t0

            t = threading.Thread(target=held)
            t.start()
            with c.channel(c.address) as gen:  # a TTFT of 250 ms cannot be made by waiting for 1.5 s
                req = generation_pb2.GenerateRequest(prompt_token_ids=[11, 12], sla=generation_pb2.Sla(ttft_ms=250),
                                                     sampling_params=generation_pb2.SamplingParams(max_tokens=2))
                t0 = time.perf_counter()
                with pytest.raises(grpc.RpcError) as err:
                    list(generation_pb2_grpc.GenerationStub(gen).Generate(req, timeout=30))
                refused_after = time.perf_counter() - t0
            time.sleep(1.5 - refused_after)
            assert t.is_alive()  # still held
            for lease in leases:
                stub.Release(internal_pb2.ReleaseRequest(lease_id=lease.destination.lease_id), timeout=10)
            t.join(30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and refused_after < 0.5
    assert len(result["tokens"]) == 4 and result["seconds"] >= 1.4
