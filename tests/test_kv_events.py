"""Exact prefix-cache events: the per-rank log, the KvEvents stream of real services (resumable, snapshots,
hostile requests refused), the router's index built from it, and the policy that reads the index."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from decode_service.worker import DecodeRankReport, DecodeWorker
from router.kv_index import HOST_HIT_WEIGHT, CachedPrefix, KvIndex
from router.perf import PerfModel
from router.policy import DecodeView, PrefillView, Request, SlaPolicy
from router.servicer import GenerationServicer
from shared import metrics
from shared.engine.core import RankReport
from shared.kvcache import BlockAllocator, CacheEvent, CacheEventKind, Tier
from shared.kvcache.event_log import CacheEventLog, KvEventsNotice, RankKvEvents
from shared.kvcache.event_stream import serve_kv_events
from shared.protocol.load import RankLoad
from shared.protocol.prefix import prompt_block_hashes
from shared.rpc.pdserve.v1 import internal_pb2

STORED, REMOVED, CLEARED = CacheEventKind.STORED, CacheEventKind.REMOVED, CacheEventKind.CLEARED
H = [bytes([i]) * 32 for i in range(8)]


def test_the_log_numbers_events_keeps_the_stored_set_and_bounds_its_history():
    alloc = BlockAllocator(4)
    log = CacheEventLog(history=3)
    alloc.listeners.append(log)
    b = alloc.allocate(4)
    for block, h in zip(b, H):
        alloc.register(block, h)
    assert log.seq == 4 and log.epoch != 0
    assert [e.block_hash for e in log.since(2)] == H[2:4] and [e.seq for e in log.since(2)] == [3, 4]
    assert log.since(0) is None  # event 1 fell out of the 3 kept: a snapshot instead
    assert log.since(4) == [] and log.since(5) is None
    alloc._release_blocks(b)
    alloc.allocate(1)  # evicts the least recently used cached block
    assert log.since(4)[0].kind is REMOVED
    snap = log.snapshot()
    assert snap.seq == 5 and sorted(snap.blocks[(0, Tier.DEVICE)]) == sorted(set(H[:4]) - {log.since(4)[0].block_hash})
    alloc.reset_prefix_cache()
    assert log.since(5)[0].kind is CLEARED and log.snapshot().blocks == {}
    assert CacheEventLog().epoch != CacheEventLog().epoch  # random per start


def test_drain_hands_each_event_over_once_and_resyncs_a_rank_that_fell_behind():
    log = CacheEventLog(rank=2, history=2)
    log(CacheEvent(STORED, Tier.DEVICE, H[0]))
    assert log.drain() == RankKvEvents(2, [CacheEvent(STORED, Tier.DEVICE, H[0])])
    assert log.drain() is None
    for h in H[1:5]:
        log(CacheEvent(STORED, Tier.HOST, h))
    resync = log.drain()  # 4 events, 2 kept: CLEARED per tier, then what is held
    assert resync.events[:2] == [CacheEvent(CLEARED, Tier.DEVICE), CacheEvent(CLEARED, Tier.HOST)]
    front = CacheEventLog(published=True)
    front.apply(KvEventsNotice([RankKvEvents(2, [CacheEvent(STORED, Tier.DEVICE, H[7])]), resync]))
    assert front.snapshot().blocks == {(2, Tier.DEVICE): [H[0]], (2, Tier.HOST): H[1:5]}
    assert front.leading_blocks([H[0], H[1]], 3) == [0, 0, 1]
    assert front.leading_blocks([H[0], H[1]], 3, (Tier.DEVICE, Tier.HOST)) == [0, 0, 2]


def test_a_decode_ranks_events_travel_to_rank_0_in_the_report():
    """A DP rank's cache events ride its fixed row (up to 64 a turn: no pickled collective); more, or a key
    that is not a SHA-256, ride the object part."""
    fake = types.SimpleNamespace(event_capacity=4, handles={}, _ended={}, names={})

    def carried(events: list[CacheEvent]) -> tuple[bool, list[CacheEvent]]:
        encoded = DecodeWorker.encode(fake, RankReport([], [], DecodeRankReport(RankLoad(3), kv_events=events)))
        return encoded.extra is None, DecodeWorker.decode(fake, encoded).load.kv_events

    few = [CacheEvent(STORED, Tier.DEVICE, H[1]), CacheEvent(REMOVED, Tier.HOST, H[2]), CacheEvent(CLEARED, Tier.HOST)]
    assert carried(few) == (True, few)
    assert carried([]) == (True, [])
    many = [CacheEvent(STORED, Tier.DEVICE, bytes([i % 256, i // 256]) * 16) for i in range(65)]
    assert carried(many) == (False, many)
    odd = [CacheEvent(STORED, Tier.DEVICE, b"short")]
    assert carried(odd) == (False, odd)


class _Context:
    """What serve_kv_events asks of a grpc.aio context."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(code, details)


async def _read(log: CacheEventLog, request: internal_pb2.KvEventsRequest, n: int) -> list:
    out = []
    stream = serve_kv_events(log, 4, request, _Context())
    async for batch in stream:
        out.append(batch)
        if len(out) == n:
            break
    await stream.aclose()
    return out


def test_the_stream_resumes_or_snapshots_and_refuses_hostile_requests():
    log = CacheEventLog(history=2, published=True)

    def store(*hs: bytes) -> None:
        log.apply(KvEventsNotice([RankKvEvents(0, [CacheEvent(STORED, Tier.DEVICE, h) for h in hs])]))

    published = metrics.REGISTRY.get_sample_value("pdserve_kv_events_total", {"kind": "stored", "tier": "device"})
    store(H[0], H[1], H[2])
    assert metrics.REGISTRY.get_sample_value("pdserve_kv_events_total",
                                             {"kind": "stored", "tier": "device"}) == (published or 0) + 3

    async def main() -> None:
        [snap] = await _read(log, internal_pb2.KvEventsRequest(), 1)
        assert snap.snapshot and snap.epoch == log.epoch and snap.last_seq == 3 and snap.block_size == 4
        assert [e.block_hash for e in snap.events] == H[:3]
        asyncio.get_running_loop().call_later(0.05, store, H[3])
        ack, live = await _read(log, internal_pb2.KvEventsRequest(epoch=log.epoch, last_seq=3), 2)  # waits for it
        assert not ack.snapshot and ack.last_seq == 3 and not ack.events  # resumed: live at once
        assert not live.snapshot and live.last_seq == 4 and [e.block_hash for e in live.events] == [H[3]]
        [stale] = await _read(log, internal_pb2.KvEventsRequest(epoch=log.epoch + 2, last_seq=4), 1)
        assert stale.snapshot and len(stale.events) == 4  # another epoch: a restart
        [old] = await _read(log, internal_pb2.KvEventsRequest(epoch=log.epoch, last_seq=1), 1)
        assert old.snapshot and old.last_seq == 4  # event 2 is no longer kept
        for bad, field in ((dict(epoch=log.epoch, last_seq=99), "last_seq"), (dict(last_seq=3), "last_seq"),
                           (dict(epoch=1 << 63), "epoch")):
            with pytest.raises(RuntimeError, match=field) as err:
                await _read(log, internal_pb2.KvEventsRequest(**bad), 1)
            assert err.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
    assert not log.wakers  # every stream let go


def _batch(epoch: int, seq: int, events: list[tuple], snapshot: bool = False) -> internal_pb2.KvEventBatch:
    return internal_pb2.KvEventBatch(epoch=epoch, last_seq=seq, snapshot=snapshot, block_size=4, events=[
        internal_pb2.KvBlockEvent(kind=k, tier=t, rank=r, block_hash=h) for k, t, r, h in events])


def test_the_index_replaces_on_snapshot_drops_on_leave_and_stays_bounded():
    S, R, C = internal_pb2.KvBlockEvent.STORED, internal_pb2.KvBlockEvent.REMOVED, internal_pb2.KvBlockEvent.CLEARED
    D, HOST = internal_pb2.KvBlockEvent.DEVICE, internal_pb2.KvBlockEvent.HOST
    index = KvIndex("test", max_entries=5)
    index.apply("a", _batch(1, 3, [(S, D, 0, H[0]), (S, D, 0, H[1]), (S, HOST, 0, H[2])], snapshot=True))
    index.apply("b", _batch(2, 1, [(S, D, 1, H[0])], snapshot=True))
    assert index.cached("a", H[:4]) == CachedPrefix(2, 1)
    assert CachedPrefix(2, 1).tokens(4) == int((2 + HOST_HIT_WEIGHT) * 4)
    assert index.cached("b", H[:2]) == CachedPrefix() and index.cached("b", H[:2], rank=1) == CachedPrefix(1, 0)
    assert index.best_rank("b", H[:2], 2) == CachedPrefix(1, 0)
    index.apply("a", _batch(1, 4, [(R, D, 0, H[0])]))
    assert index.cached("a", H[:3]) == CachedPrefix()  # the chain breaks at the evicted block
    index.apply("a", _batch(1, 5, [(C, HOST, 0, b"")]))
    assert index.entries("a") == 1 and index.size == 2
    index.apply("a", _batch(3, 0, [], snapshot=True))  # a restart: nothing stale survives
    assert index.entries("a") == 0 and index.size == 1
    index.apply("a", _batch(3, 5, [(S, D, 0, h) for h in H[:5]]))  # 6 entries > 5: a's oldest goes
    assert index.size == 5 and index.cached("a", H[:5]) == CachedPrefix() and index.entries("b") == 1
    index.drop("b")
    assert index.size == 4 and index.addresses() == ["a"]
    for bad, field in (((S, 7, 0, H[0]), "tier"), ((S, D, -1, H[0]), "rank"), ((S, D, 0, b"x" * 65), "block_hash"),
                       ((9, D, 0, H[0]), "kind")):
        with pytest.raises(ValueError, match=field):
            index.apply("a", _batch(3, 6, [bad]))


def test_the_policy_takes_the_pair_that_caches_the_prefix_decode_first():
    perf = PerfModel(kv_bytes_per_token=70_000, transfer_bytes_per_s=1e9)
    prefills = [PrefillView("p0"), PrefillView("p1")]
    decodes = [DecodeView("d0"), DecodeView("d1")]
    policy = SlaPolicy(perf, seed=1)

    def first(**cached) -> tuple[int, int]:
        c = policy.choose(Request(2000, 16, 10.0, 1.0, **cached), prefills, decodes)[0]
        return c.prefill, c.decode

    assert first(cached_by_prefill=[0, 1920])[0] == 1
    assert first(cached_by_decode=[0, 1920])[1] == 1
    assert first(cached_by_prefill=[1920, 0], cached_by_decode=[0, 1920]) == (0, 1)
    pushed = policy.predict(Request(2000, 16, 10.0, 1.0, cached_by_decode=[0, 1920]), prefills, decodes)
    by_decode = {c.decode: c for c in pushed if c.prefill == 0}
    assert by_decode[1].reused_tokens == 1920 and by_decode[1].ttft_raw_s < by_decode[0].ttft_raw_s


def test_the_router_counts_a_prompts_cached_tokens_per_instance_from_the_index():
    S, D = internal_pb2.KvBlockEvent.STORED, internal_pb2.KvBlockEvent.DEVICE
    prompt = list(range(3, 40))
    keys = prompt_block_hashes(prompt, 4, None, "tenant")
    pools = types.SimpleNamespace(prefill=types.SimpleNamespace(kv_index=KvIndex("prefill")),
                                  decode=types.SimpleNamespace(kv_index=KvIndex("decode")))
    pools.prefill.kv_index.apply("p1", _batch(1, 3, [(S, D, 0, h) for h in keys[:3]], snapshot=True))
    pools.decode.kv_index.apply("d0", _batch(1, 9, [(S, D, 1, h) for h in keys], snapshot=True))
    inst = [types.SimpleNamespace(address=a, view=v) for a, v in (("p0", PrefillView("p0")), ("p1", PrefillView("p1")))]
    dec = [types.SimpleNamespace(address="d0", view=DecodeView("d0", ranks=[None, None]))]
    assert GenerationServicer._cached_prefix(pools, prompt, inst, dec, "tenant") == ([0, 12], [36])
    assert GenerationServicer._cached_prefix(pools, prompt, inst, dec, "") == ([0, 0], [0])  # another salt's keys


# -- real services ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(served_model, tmp_path_factory):
    from router.cluster import Cluster

    with Cluster(str(served_model), num_decode=2, dtype="float32", log_dir=tmp_path_factory.mktemp("kv-events-logs"),
                 extra_router=["--load-interval", "0.2"]) as c:
        yield c


def _generate(c, prompt: list[int], max_tokens: int = 2) -> None:
    from shared.rpc.pdserve.v1 import generation_pb2, generation_pb2_grpc

    with c.channel(c.address) as ch:
        req = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=generation_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))


def _subscribe(c, address: str, stub_cls, request: internal_pb2.KvEventsRequest, until) -> list:
    """Batches of an instance's KvEvents until `until(batches)` holds (or 30 s)."""
    out: list = []
    with c.channel(address) as ch:
        stream = stub_cls(ch).KvEvents(request, timeout=30)
        try:
            for batch in stream:
                out.append(batch)
                if until(out):
                    break
        finally:
            stream.cancel()
    return out


def _stored(batches: list) -> set[bytes]:
    held: set[bytes] = set()
    for b in batches:
        if b.snapshot:
            held.clear()
        for e in b.events:
            if e.kind == internal_pb2.KvBlockEvent.STORED:
                held.add(e.block_hash)
            elif e.kind == internal_pb2.KvBlockEvent.REMOVED:
                held.discard(e.block_hash)
    return held


def test_a_prefill_instance_streams_the_keys_of_a_prompt_it_served(cluster):
    from shared.rpc.pdserve.v1 import internal_pb2_grpc

    c, prompt = cluster, [(11 * i) % 400 + 3 for i in range(70)]
    _generate(c, prompt)
    [address] = c.prefill_addrs
    first = _subscribe(c, address, internal_pb2_grpc.PrefillStub, internal_pb2.KvEventsRequest(), lambda b: True)
    assert first[0].snapshot
    bs = first[0].block_size
    keys = prompt_block_hashes(prompt, bs, (len(prompt) - 1) // bs)
    assert keys and set(keys) <= _stored(first)
    # resumed where it left off: the next prompt's keys come live, no snapshot
    epoch, seq = first[-1].epoch, first[-1].last_seq
    second = [(13 * i) % 400 + 5 for i in range(70)]
    _generate(c, second)
    more = prompt_block_hashes(second, bs, (len(second) - 1) // bs)
    resume = internal_pb2.KvEventsRequest(epoch=epoch, last_seq=seq)
    live = _subscribe(c, address, internal_pb2_grpc.PrefillStub, resume, lambda b: set(more) <= _stored(b))
    assert not any(b.snapshot for b in live) and set(more) <= _stored(live)
    stale = _subscribe(c, address, internal_pb2_grpc.PrefillStub,
                       internal_pb2.KvEventsRequest(epoch=epoch ^ 2, last_seq=seq), lambda b: True)
    assert stale[0].snapshot and set(keys + more) <= _stored(stale)
    with c.channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        list(internal_pb2_grpc.PrefillStub(ch).KvEvents(internal_pb2.KvEventsRequest(epoch=epoch, last_seq=1 << 40),
                                                        timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "last_seq" in err.value.details()
    # the decode instance keeps the prompt blocks prefill pushed: its stream names them, on DP rank 0
    decoded = _subscribe(c, c.decode_addrs[0], internal_pb2_grpc.DecodeStub, internal_pb2.KvEventsRequest(),
                         lambda b: set(keys) <= _stored(b))
    assert decoded[0].snapshot and decoded[0].block_size == bs and set(keys) <= _stored(decoded)
    assert {e.rank for b in decoded for e in b.events} == {0}


def test_a_stream_without_the_cluster_token_is_refused(cluster):
    from shared.rpc.pdserve.v1 import internal_pb2_grpc
    from shared.rpc.service import channel

    with channel(cluster.prefill_addrs[0]) as ch, pytest.raises(grpc.RpcError) as err:
        list(internal_pb2_grpc.PrefillStub(ch).KvEvents(internal_pb2.KvEventsRequest(), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_routers_index_holds_nothing_stale_after_an_instance_restarts(cluster):
    """The router's subscription (router.pools) on its own event loop; the instance restarts (from this
    thread: a service dies with the thread that started it) and comes back with another epoch."""
    import threading

    from router.pools import Pool
    from shared.rpc.pdserve.v1 import internal_pb2_grpc
    from tests.helpers import wait_for

    c, prompt = cluster, [(17 * i) % 400 + 7 for i in range(70)]
    [address] = c.prefill_addrs
    _generate(c, prompt)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def subscribe() -> Pool:
        pool = Pool("prefill", [address], internal_pb2_grpc.PrefillStub, c.credentials)
        pool.follow_kv_events(c.credentials.metadata)
        return pool

    pool = asyncio.run_coroutine_threadsafe(subscribe(), loop).result(30)
    try:
        assert wait_for(lambda: pool.kv_index.block_size.get(address, 0) > 0, timeout=30)
        bs = pool.kv_index.block_size[address]
        keys = prompt_block_hashes(prompt, bs, (len(prompt) - 1) // bs)
        assert wait_for(lambda: pool.kv_index.cached(address, keys).device_blocks == len(keys), timeout=30)
        before = pool.kv_index.entries(address)
        c.restart(address)
        assert wait_for(lambda: pool.kv_index.entries(address) == 0, timeout=30), "stale entries survived"
        _generate(c, prompt)  # the restarted instance's own cache comes back
        assert wait_for(lambda: pool.kv_index.cached(address, keys).device_blocks == len(keys), timeout=30)
    finally:
        for task in list(pool._kv_tasks.values()):
            loop.call_soon_threadsafe(task.cancel)
        loop.call_soon_threadsafe(loop.stop)
    assert before >= len(keys) > 0


def _dp_rank(rank: int, world: int, path: str) -> list | None:
    """A dp=2 decode group's turn: each rank's cache events reach rank 0 in its report, with its rank."""
    import torch

    from decode_service.server import DecodeConfig
    from shared.engine.core import RankLink, take_turn
    from shared.parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(world=world, dp=world, ep=world), rank, torch.device("cpu"))
    me = DecodeWorker(DecodeConfig(model=path, dtype="float32", block_size=4, kv_cache_tokens=256), rank, state)
    me.kv_events(CacheEvent(STORED, Tier.DEVICE, H[rank]))  # as the rank's allocator tells its listener
    reports = take_turn(me, RankLink(state), [])
    me.close()
    return None if reports is None else [(r.load.load.rank, r.load.kv_events) for r in reports]


def test_every_dp_ranks_events_reach_rank_0_and_place_by_rank(ckpt):
    from decode_service.engine import DecodeEngineCore
    from tests.dist_utils import run_ranks

    got, none = run_ranks(_dp_rank, 2, str(ckpt("v32_sparse")))
    assert none is None
    assert got == [(0, [CacheEvent(STORED, Tier.DEVICE, H[0])]), (1, [CacheEvent(STORED, Tier.DEVICE, H[1])])]
    core = types.SimpleNamespace(mirror=False, world=2, kv_events=CacheEventLog(published=True), on_kv_events=None)
    DecodeEngineCore._publish(core, [RankKvEvents(rank, events) for rank, events in got])
    assert DecodeEngineCore.prefix_blocks_by_rank(core, [H[1], H[2]]) == [0, 1]
    assert DecodeEngineCore.prefix_blocks_by_rank(core, [H[0]]) == [1, 0]


def test_the_router_sends_a_prefix_to_the_decode_instance_that_holds_it(cluster):
    """Decode's hits first: with both decode instances idle, a prompt whose prefix one of them keeps goes
    there (without the index the first instance would take it: equal cost, listed first)."""
    import threading

    from shared.rpc.pdserve.v1 import internal_pb2_grpc
    from tests.helpers import wait_for

    c = cluster
    first, second = c.decode_addrs

    def load(address: str) -> internal_pb2.LoadReport:
        with c.channel(address) as ch:
            return internal_pb2_grpc.DecodeStub(ch).GetLoad(internal_pb2.LoadRequest(), timeout=10)

    def serves() -> bool:
        try:
            _generate(c, [4, 4, 4])
            return True
        except grpc.RpcError:
            return False

    assert wait_for(serves, timeout=60)  # an earlier test restarted the prefill instance
    long = threading.Thread(target=_generate, args=(c, [5, 6, 7], 400))
    long.start()  # the first decode instance busy: the prefix's first request goes to the second
    assert wait_for(lambda: load(first).running + load(second).running > 0, timeout=30)
    busy = first if load(first).running else second
    other = second if busy == first else first
    system = [(19 * i) % 400 + 11 for i in range(80)]
    _generate(c, system + [1])
    long.join(120)
    held = _subscribe(c, other, internal_pb2_grpc.DecodeStub, internal_pb2.KvEventsRequest(), lambda b: True)
    keys = prompt_block_hashes(system, held[0].block_size, None)
    assert set(keys) <= _stored(held), "the prefix's first request did not land on the idle decode instance"
    wait_for(lambda: False, timeout=1.0)  # the router's own subscription takes the same events
    before = {a: sum(r.admitted for r in load(a).ranks) for a in (busy, other)}
    for i in range(3):
        _generate(c, system + [2 + i, 9])
    after = {a: sum(r.admitted for r in load(a).ranks) for a in (busy, other)}
    assert (after[busy] - before[busy], after[other] - before[other]) == (0, 3)


def test_a_ranks_log_hears_the_second_tier(ckpt, tmp_path):
    """The second tier's copies arrive as HOST events through the same listeners; a log attached to a cache
    that holds blocks already starts from them (listen_to)."""
    from shared.engine import LLM, SamplingParams
    from shared.kvcache.event_log import listen_to

    llm = LLM(str(ckpt("v32_sparse")), block_size=4, kv_cache_tokens=64, kv_tier_tokens=512, kv_tier_dir=str(tmp_path))
    log = listen_to(llm.engine.kv)
    prompt = list(range(3, 40))
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    llm.engine.kv.tier.flush()
    keys = prompt_block_hashes(prompt, 4, (len(prompt) - 1) // 4)
    assert log.leading_blocks(keys, 1, (Tier.HOST,)) == [len(keys)]
    late = listen_to(llm.engine.kv)  # attached after the fact: seeded from both tiers
    def held(x: CacheEventLog) -> dict:
        return {k: set(v) for k, v in x.snapshot().blocks.items()}

    assert held(late) == held(log)
