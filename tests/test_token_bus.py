"""Token buses (decode_service.token_bus, router.token_bus): a router's one Tokens stream per decode instance
carries every request's messages, a step's in one batch; each request's Decode call stays for control. Real
router, prefill and decode processes; the product path (`pdserve up`) is in tests/test_migration.py."""

from __future__ import annotations

import concurrent.futures
import threading
import urllib.request

import grpc
import pytest

from router.cluster import Cluster
from shared.engine import LLM, SamplingParams
from shared.rpc.pdserve.v1 import generation_pb2, internal_pb2, internal_pb2_grpc
from tests.helpers import concurrent_greedy, random_prompts, wait_for

NUMERICS = dict(dtype="float32", indexer_numerics="transformers")


@pytest.fixture(scope="module")
def cluster(served_model, tmp_path_factory):
    c = Cluster(str(served_model), log_dir=tmp_path_factory.mktemp("logs-bus"), **NUMERICS,
                extra_decode=["--metrics-port", "0", "--block-size", "4"], extra_prefill=["--block-size", "4"])
    c.start()
    yield c
    c.stop()


def decode_metric(cluster, sample: str) -> float:
    """The sum of the decode instance's /metrics samples named `sample` (a name, or a name and its labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports[cluster.decode_addrs[0]]}/metrics",
                                  timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split(" ", 1)[0] == sample or line.startswith(sample + "{"))


def greedy(n: int) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def reserve(stub, tokens: int = 4, max_tokens: int = 40) -> str:
    return stub.Reserve(internal_pb2.ReserveRequest(request_id="r", num_prompt_tokens=tokens, max_tokens=max_tokens),
                        timeout=5).destination.lease_id


def test_a_routers_streams_share_one_bus_in_batches_with_the_same_tokens(cluster, served_model):
    prompts = random_prompts(8, [3, 9, 17, 30, 5, 12, 22, 40], 512, seed=7)
    want = [o.token_ids for o in LLM(str(served_model), block_size=4, **NUMERICS).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    # the router opens its bus once the instance is reachable: its very first requests ride it
    assert wait_for(lambda: decode_metric(cluster, "pdserve_decode_token_buses") == 1, 10)
    names = ("pdserve_decode_token_bus_messages_total", "pdserve_decode_token_bus_batches_total")
    before = [decode_metric(cluster, name) for name in names]
    assert concurrent_greedy(cluster.address, prompts, 10) == want
    sent, batches = (decode_metric(cluster, name) - b for name, b in zip(names, before))
    assert sent == sum(map(len, want))  # every stream's every message (one a token) went on the bus,
    assert batches < sent / 2  # several streams' a batch


def test_bad_bus_names_are_refused_and_a_decode_naming_one_lets_its_lease_go(cluster):
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        total = stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).total_blocks
        for name in ("", "x" * 65, "tab\there"):
            with pytest.raises(grpc.RpcError) as err:
                next(iter(stub.Tokens(internal_pb2.TokensRequest(token_bus=name), timeout=5)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_bus" in err.value.details()
        held = stub.Tokens(internal_pb2.TokensRequest(token_bus="mine"), timeout=30)
        assert not next(iter(held)).messages  # held: an empty first batch
        with pytest.raises(grpc.RpcError) as err:
            next(iter(stub.Tokens(internal_pb2.TokensRequest(token_bus="mine"), timeout=5)))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        held.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(internal_pb2.DecodeRequest(
                request_id="long", lease_id=reserve(stub), sampling_params=greedy(4), prompt_token_ids=[5, 6, 7],
                local_prefill=True, token_bus="y" * 65), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_bus" in err.value.details()
        assert wait_for(lambda: stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).free_blocks == total, 10)


def test_an_unknown_bus_streams_on_the_call_and_a_closed_one_fails_its_requests(cluster, served_model):
    """A request naming a bus the instance does not hold gets its messages on its own call (the same tokens);
    one whose bus closes under it ends UNAVAILABLE (the router moves it) and frees its blocks."""
    want = LLM(str(served_model), block_size=4, **NUMERICS).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    with cluster.channel(cluster.decode_addrs[0]) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        total = stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).total_blocks
        got = [t for m in stub.Decode(internal_pb2.DecodeRequest(
            request_id="lost", lease_id=reserve(stub), sampling_params=greedy(6), prompt_token_ids=[5, 6, 7],
            local_prefill=True, token_bus="nobody-holds-this"), timeout=30) for t in m.token_ids]
        assert got == want
        bus = stub.Tokens(internal_pb2.TokensRequest(token_bus="closing"), timeout=60)
        batches = iter(bus)
        assert not next(batches).messages
        call = stub.Decode(internal_pb2.DecodeRequest(
            request_id="riding", lease_id=reserve(stub, max_tokens=400), sampling_params=greedy(400),
            prompt_token_ids=[5, 6, 7], local_prefill=True, token_bus="closing"), timeout=60)
        ended: list[grpc.RpcError] = []
        waiter = threading.Thread(target=lambda: ended.extend(_error_of(call)))
        waiter.start()
        seen = []
        for batch in batches:
            seen += [m for m in batch.messages]
            if len(seen) >= 3:
                break
        assert {m.request_id for m in seen} == {"riding"} and all(len(m.token_ids) == 1 for m in seen)
        bus.cancel()
        waiter.join(30)
        assert ended and ended[0].code() == grpc.StatusCode.UNAVAILABLE and "token bus" in ended[0].details()
        assert wait_for(lambda: stub.GetLoad(internal_pb2.LoadRequest(), timeout=5).free_blocks == total, 10)


def _error_of(call) -> list[grpc.RpcError]:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return [exc]
    return []


def test_router_without_the_bus_streams_the_same(served_model, tmp_path):
    prompts = random_prompts(4, [3, 9, 17, 30], 512, seed=8)
    want = [o.token_ids for o in LLM(str(served_model), block_size=4, **NUMERICS).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
    with Cluster(str(served_model), log_dir=tmp_path, **NUMERICS, extra_router=["--no-token-bus"],
                 extra_decode=["--metrics-port", "0", "--block-size", "4"], extra_prefill=["--block-size", "4"]) as c:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = [f.result() for f in [pool.submit(concurrent_greedy, c.address, prompts, 8) for _ in range(2)]]
        assert all(out == want for out in outs)
        assert decode_metric(c, "pdserve_decode_token_bus_messages_total") == 0


def test_a_refused_bus_is_asked_for_again_later_and_later(monkeypatch):
    """An instance that refuses the bus (an older one without Tokens, say) is asked again 1, 2, 4 ... s on, at
    most every 60 s, not at every request; its requests stream on their own calls meanwhile (ready: None)."""
    import asyncio

    from router import token_bus
    from router.policy import DecodeView
    from router.pools import Instance

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNIMPLEMENTED

    class RefusingStub:
        asked = 0

        def Tokens(self, request, metadata):
            RefusingStub.asked += 1

            async def refuse():
                raise Refused()
                yield  # an async generator, as a stream call is iterated

            return refuse()

    now = [100.0]
    monkeypatch.setattr(token_bus, "monotonic", lambda: now[0])
    inst = Instance("10.0.0.9:7001", RefusingStub(), DecodeView("10.0.0.9:7001"))

    async def asked_at(times: list[float]) -> list[int]:
        buses, counts = token_bus.TokenBuses(()), []
        for t in times:
            now[0] = t
            assert buses.ready(inst) is None
            await asyncio.sleep(0)  # the subscription runs and is refused
            await asyncio.sleep(0)
            counts.append(RefusingStub.asked)
        return counts

    # asked at 100; again not before 101, then 103 (2 s on), 107 (4 s), 115, 131, 163, then 60 s on (not 64)
    assert asyncio.run(asked_at([100, 100.5, 101, 102, 103, 106, 107, 115, 131, 163, 222.9, 223])) == [
        1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 8]
