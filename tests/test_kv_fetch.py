"""Cross-instance fetch (prefill_service.fetch): a prefill instance pulls the cached blocks of a prefix
another instance holds over the transfer engine (TCP, or Mooncake one-sided writes), adopts them into its
prefix cache and computes only the rest; greedy tokens equal a fresh computation; nothing leaks, nothing
unwritten is adopted."""

from __future__ import annotations

import threading

import pytest

from prefill_service.fetch import AdoptFetch, FetchEndpoint, FetchPlan, OpenFetch, PushCachedBlocks, new_fetch_id
from prefill_service.worker import PrefillWorker
from shared.engine import LLM, SamplingParams
from shared.engine.core import RankCommand
from shared.protocol.prefix import prompt_block_hashes
from shared.transfer import TransferError, make_sender
from tests.helpers import TRANSPORTS, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def path(ckpt):
    return str(ckpt("v32_sparse"))


class Instance:
    """One prefill instance's engine and worker, commands applied here as its engine thread would."""

    def __init__(self, path: str, fetch: bool, transport: str = "tcp"):
        self.llm = LLM(path, dtype="float32", block_size=BS)
        self.answers: dict[str, object] = {}
        self.later: list = []
        self.answered = threading.Event()
        endpoint = FetchEndpoint("127.0.0.1", None, None, 3.0, 30.0, transport, "tcp", "") if fetch else None
        self.worker = PrefillWorker(self.llm.engine, lambda transport: make_sender(transport, self.llm.engine.kv),
                                    on_done=self._done, later=self.later.append, fetch=endpoint)

    def _done(self, rid: str, outcome: object) -> None:
        self.answers[rid] = outcome
        self.answered.set()

    def apply(self, command) -> object:
        return self.worker.apply(RankCommand(command, 0, 0))

    def settle(self) -> None:
        while self.later:
            self.apply(self.later.pop(0))
        self.llm.engine.kv.ledger.settle()


def _fetch(src: Instance, dst: Instance, keys: list[bytes]) -> tuple[FetchPlan, object, int]:
    plan = dst.apply(OpenFetch(tuple(keys)))
    assert plan.destination is not None
    fid = new_fetch_id()
    src.answered.clear()
    src.apply(PushCachedBlocks(fid, tuple(keys), plan.have, plan.destination))
    assert src.answered.wait(30)
    src.settle()
    adopted = dst.apply(AdoptFetch(plan.destination.lease_id, tuple(keys[plan.have:])))
    dst.settle()
    return plan, src.answers[fid], adopted


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fetched_prefix_serves_like_a_local_hit(path, transport):
    holder, fetcher = Instance(path, fetch=False), Instance(path, fetch=True, transport=transport)
    prompt = random_prompts(1, [37], 512, seed=71)[0]
    want = holder.llm.generate([prompt], GREEDY)[0].token_ids  # computes and caches 9 full blocks
    keys = prompt_block_hashes(prompt, BS, (len(prompt) - 1) // BS)
    plan, pushed, adopted = _fetch(holder, fetcher, keys)
    assert plan.destination.transport == transport
    assert plan.have == 0 and adopted == len(keys) == 9
    assert pushed.blocks == 9 and pushed.nbytes > 0
    assert fetcher.llm.engine.kv.allocator.cached_prefix(keys) == 9
    seqs: list = []
    add = fetcher.llm.engine.add_request
    fetcher.llm.engine.add_request = lambda *a, **kw: seqs.append(add(*a, **kw)) or seqs[-1]
    assert fetcher.llm.generate([prompt], GREEDY)[0].token_ids == want
    assert seqs[0].num_cached_prompt_tokens == 36  # computed only the last token
    for inst in (holder, fetcher):
        kv = inst.llm.engine.kv
        assert kv.allocator.num_free == kv.num_blocks  # every pin, lease and sequence gave its blocks back
        kv.ledger.check()


def test_fetch_adopts_only_what_the_holder_has(path):
    """The holder caches 4 of the 9 blocks asked for: 4 arrive and are adopted, the lease's other blocks go
    back unregistered; a second plan knows the 4 are here already."""
    holder, fetcher = Instance(path, fetch=False), Instance(path, fetch=True)
    prompt = random_prompts(1, [37], 512, seed=72)[0]
    holder.llm.generate([prompt[:17]], GREEDY)  # 4 full blocks cached
    keys = prompt_block_hashes(prompt, BS, (len(prompt) - 1) // BS)
    plan, pushed, adopted = _fetch(holder, fetcher, keys)
    assert (plan.have, pushed.blocks, adopted) == (0, 4, 4)
    again = fetcher.apply(OpenFetch(tuple(keys)))
    assert again.have == 4
    fetcher.apply(AdoptFetch(again.destination.lease_id, ()))  # nothing arrived: the lease is just given back
    fetcher.settle()
    kv = fetcher.llm.engine.kv
    assert kv.allocator.num_free == kv.num_blocks and kv.allocator.cached_prefix(keys) == 4


def test_a_push_to_a_bad_destination_pins_nothing(path):
    """Hostile: a destination with fewer blocks than the push needs, or an unknown lease, fails the push;
    every pinned block goes back."""
    holder, fetcher = Instance(path, fetch=False), Instance(path, fetch=True)
    prompt = random_prompts(1, [21], 512, seed=73)[0]
    holder.llm.generate([prompt], GREEDY)
    keys = prompt_block_hashes(prompt, BS, (len(prompt) - 1) // BS)
    plan = fetcher.apply(OpenFetch(tuple(keys[:2])))
    fid = new_fetch_id()
    holder.apply(PushCachedBlocks(fid, tuple(keys), 0, plan.destination))  # 5 blocks into a 2-block lease
    assert isinstance(holder.answers[fid], TransferError)
    forged = FetchPlan(0, plan.destination.__class__(**{**plan.destination.__dict__, "lease_id": "f" * 32}))
    fid = new_fetch_id()
    holder.answered.clear()
    holder.apply(PushCachedBlocks(fid, tuple(keys[:2]), 0, forged.destination))
    assert holder.answered.wait(30) and isinstance(holder.answers[fid], BaseException)
    holder.settle()
    fetcher.apply(AdoptFetch(plan.destination.lease_id, tuple(keys[:2])))
    fetcher.settle()
    for inst in (holder, fetcher):
        kv = inst.llm.engine.kv
        assert kv.allocator.num_free == kv.num_blocks
        kv.ledger.check()


# -- the router's choice -------------------------------------------------------------------------------------
def _instances(n: int) -> list:
    from router.policy import PrefillView
    from router.pools import Instance

    out = []
    for i in range(n):
        inst = Instance.__new__(Instance)
        inst.address = f"p{i}:1"
        inst.view = PrefillView(inst.address, block_size=BS)
        out.append(inst)
    return out


def test_the_router_fetches_only_where_moving_beats_computing():
    from router.fetch import FetchAdvisor, Reason
    from router.perf import PerfModel

    advisor, prefills = FetchAdvisor(PerfModel(), enabled=True), _instances(3)
    choice = advisor.choose(1000, 0, prefills, [0, 400, 96])
    assert choice.fetch and choice.reason is Reason.CHEAPER and (choice.holder, choice.blocks) == ("p1:1", 100)
    assert advisor.choose(1000, 0, prefills, [0, 4, 0]).reason is Reason.COMPUTE_CHEAPER  # a round trip for 1 block
    assert advisor.choose(1000, 1, prefills, [0, 400, 96]).reason is Reason.CACHED_HERE
    prefills[1].view.up = False
    assert advisor.choose(1000, 0, prefills, [0, 400, 96]).holder == "p2:1"  # a holder that is down is not asked
    assert FetchAdvisor(PerfModel(), enabled=False).choose(1000, 0, prefills, [0, 400, 96]).reason is Reason.DISABLED


# -- through the services ------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefill_instance_fetches_from_another_over_grpc(path, tmp_path, transport):
    """Two prefill instances, one decode: A prefills a prompt (caching it); B, told by the PrefillRequest to
    fetch from A, pulls A's blocks (PushCached; by Mooncake one-sided writes under --kv-transport mooncake) and
    computes only the rest; the streamed greedy tokens equal the
    in-process engine's. Hostile PushCached requests are INVALID_ARGUMENT naming the field."""
    import grpc

    from router.cluster import Cluster
    from shared.rpc.convert import sampling_to_proto
    from shared.rpc.pdserve.v1 import internal_pb2, internal_pb2_grpc

    prompt = random_prompts(1, [45], 512, seed=74)[0]
    longer = prompt + [5, 6, 7, 8, 9, 10, 11]
    want = LLM(path, dtype="float32", block_size=BS).generate([longer], GREEDY)[0].token_ids
    flags = ["--block-size", str(BS), "--kv-transport", transport]
    with Cluster(path, num_prefill=2, dtype="float32", log_dir=tmp_path / "logs", extra_decode=flags,
                 extra_prefill=flags) as c:
        a, b = c.prefill_addrs
        with c.channel(c.decode_addrs[0]) as dch, c.channel(a) as ach, c.channel(b) as bch:
            dec, pa, pb = (internal_pb2_grpc.DecodeStub(dch), internal_pb2_grpc.PrefillStub(ach),
                           internal_pb2_grpc.PrefillStub(bch))

            def prefill(stub, ids: list[int], rid: str, **fetch) -> tuple[internal_pb2.PrefillResponse, list[int]]:
                lease = dec.Reserve(internal_pb2.ReserveRequest(request_id=rid, num_prompt_tokens=len(ids),
                                                                max_tokens=8), timeout=30).destination
                first = stub.Prefill(internal_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=ids, sampling_params=sampling_to_proto(GREEDY),
                    destination=lease, **fetch), timeout=60)
                out = dec.Decode(internal_pb2.DecodeRequest(
                    request_id=rid, lease_id=lease.lease_id, prompt_token_ids=ids, first_token_id=first.first_token_id,
                    sampling_params=sampling_to_proto(GREEDY)), timeout=60)
                return first, [t for m in out for t in m.token_ids]

            prefill(pa, prompt, "on-a")
            first, got = prefill(pb, longer, "on-b", fetch_from=a, fetch_blocks=(len(prompt) - 1) // BS)
            assert first.fetched_prompt_tokens == first.cached_prompt_tokens == 44  # A's 11 blocks came over
            assert got == want
            with pytest.raises(grpc.RpcError) as err:  # KV goes only where this cluster's instances vouched
                pa.PushCached(internal_pb2.PushCachedRequest(prompt_token_ids=prompt[:8]), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            signed = dec.Reserve(internal_pb2.ReserveRequest(request_id="x", num_prompt_tokens=8, max_tokens=1),
                                 timeout=30).destination
            for bad, field in ((dict(prompt_token_ids=prompt[:6]), "prompt_token_ids"),
                               (dict(prompt_token_ids=[1 << 30] * 8), "prompt_token_ids"),
                               (dict(prompt_token_ids=prompt[:8], first_block=2), "first_block"),
                               (dict(prompt_token_ids=prompt[:8], cache_salt="x" * 257), "cache_salt")):
                with pytest.raises(grpc.RpcError) as err:
                    pa.PushCached(internal_pb2.PushCachedRequest(destination=signed, **bad), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
