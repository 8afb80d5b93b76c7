"""The second KV tier (shared.kvcache.tier): a prefix pushed out of the device pool comes back from the tier with
the same greedy output; an altered or truncated record is dropped, never served; capacity and LRU; every cache
kind's bytes round-trip; a fresh store per process; and host-tier hits through `pdserve up --kv-tier-tokens`."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import torch

from bench.fleet_faults import UpProcess
from prefill_service.worker import prefill_gauges
from shared.device import accelerator
from shared.engine import LLM, SamplingParams
from shared.kvcache import CacheEvent, CacheEventKind, KVCache, KVLayout, Tier
from shared.kvcache.tier import HostStore, TierStats, totals
from shared.metrics import LoadCollector
from shared.protocol.load import RankLoad
from shared.protocol.prefix import prompt_block_hashes
from tests.helpers import host_tier_hits, random_prompts, served_after_push_out

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def sparse_path(ckpt):
    return str(ckpt("v32_sparse"))


def _run(llm: LLM, prompt: list[int]):
    seq = llm.engine.add_request(prompt, GREEDY)
    while llm.engine.has_work:
        llm.engine.step()
    llm.engine.kv.tier.flush()
    return seq


def _push_out(llm: LLM, prompts: list[list[int]]) -> None:
    """Serve prompts that need most of the 16-block pool each: earlier prompts' cached blocks are evicted."""
    for p in prompts:
        _run(llm, p)


def test_an_evicted_prefix_comes_back_from_the_tier(sparse_path, tmp_path):
    target = random_prompts(1, [40], 512, seed=52)[0]
    others = random_prompts(3, [40] * 3, 512, seed=53)
    base = LLM(sparse_path, block_size=BS, kv_cache_tokens=64).generate([target], GREEDY)[0].token_ids
    llm = LLM(sparse_path, block_size=BS, kv_cache_tokens=64, kv_tier_tokens=1024, kv_tier_dir=str(tmp_path))
    assert llm.engine.kv.ledger.checking  # every step checks each block's owners (tests/conftest.py)
    tier = llm.engine.kv.tier
    assert tier is not None and len(tier) == 0  # the warm-up's blocks were forgotten with its prefix
    events: list[CacheEvent] = []
    llm.engine.kv.allocator.listeners.append(events.append)
    first = _run(llm, target)
    assert first.output_token_ids == base and first.num_cached_prompt_tokens == 0
    keys = prompt_block_hashes(target, BS, (len(target) - 1) // BS)
    assert all(k in tier for k in keys)  # written through off the engine thread
    assert {e.block_hash for e in events if e.tier is Tier.HOST and e.kind is CacheEventKind.STORED} >= set(keys)
    _push_out(llm, others)
    assert llm.engine.kv.allocator.lookup(keys[:1]) == []  # gone from the device
    read = tier.stats.read_bytes
    again = _run(llm, target)
    assert again.num_cached_prompt_tokens == again.num_host_cached_prompt_tokens == 36
    assert again.output_token_ids == base
    assert tier.stats.read_blocks == 9 and tier.stats.read_bytes - read == 9 * tier.block_nbytes
    assert totals(tier).read_bytes == tier.stats.read_bytes and totals(None) == TierStats()  # what a report carries
    once_more = _run(llm, target)  # now on the device again: a device hit
    assert once_more.num_cached_prompt_tokens == 36 and once_more.num_host_cached_prompt_tokens == 0
    assert once_more.output_token_ids == base


def test_an_altered_or_truncated_record_is_dropped_not_served(sparse_path, tmp_path):
    a, b = random_prompts(2, [40, 40], 512, seed=60)
    others = random_prompts(3, [40] * 3, 512, seed=61)
    plain = LLM(sparse_path, block_size=BS, kv_cache_tokens=64)
    base = [plain.generate([p], GREEDY)[0].token_ids for p in (a, b)]
    llm = LLM(sparse_path, block_size=BS, kv_cache_tokens=64, kv_tier_tokens=1024, kv_tier_dir=str(tmp_path))
    tier = llm.engine.kv.tier
    for p in (a, b):
        _run(llm, p)
    _push_out(llm, others)
    key_a, key_b = prompt_block_hashes(a, BS, 1)[0], prompt_block_hashes(b, BS, 1)[0]
    altered, truncated = Path(tier.handle(key_a)), Path(tier.handle(key_b))
    assert altered.parent.parent == tmp_path  # a fresh directory of this process under --kv-tier-dir
    data = bytearray(altered.read_bytes())
    data[-7] ^= 0x01  # one bit of the payload
    altered.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    for prompt, expected in zip((a, b), base):
        seq = _run(llm, prompt)
        assert seq.num_cached_prompt_tokens == 0 and seq.output_token_ids == expected  # a miss, computed
    assert tier.stats.dropped_corrupt == 2
    assert not altered.exists() and not truncated.exists()


def _cache(kv_cache_dtype: str, tier_blocks: int, tmp_path: Path, device: torch.device | None = None) -> KVCache:
    layout = KVLayout(num_layers=3, block_size=BS, kv_lora_rank=128, rope_dim=16, index_head_dim=32,
                      dtype=torch.float32, index_dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    kv = KVCache(layout, 8, device or torch.device("cpu"))
    kv.attach_tier(tier_blocks * BS, str(tmp_path))
    return kv


def _fill(kv: KVCache, block: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for pool in kv.pools():
        rows = torch.randint(0, 255, pool[:, block].shape, generator=g, dtype=torch.uint8) if pool.dtype == \
            torch.uint8 else torch.randn(pool[:, block].shape, generator=g)
        pool[:, block] = rows.to(pool.device)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_every_pool_of_a_block_round_trips(kv_cache_dtype, tmp_path):
    """MLA rows (C8: int8 latent + scales + bf16 rope key as bytes), indexer keys (C8: FP8 + scale), every layer
    (an MTP layer is one more): what a hit restores is byte for byte what was registered."""
    _round_trip(_cache(kv_cache_dtype, 4, tmp_path))


def test_an_accelerator_pool_spills_to_pinned_host_memory(tmp_path):
    """On an accelerator the tier is page-locked host memory (no files), and a hit copies back byte for byte."""
    device = accelerator()
    if device is None:
        pytest.skip("no accelerator")
    kv = _cache("int8", 4, tmp_path, device)
    assert isinstance(kv.tier.store, HostStore)
    _round_trip(kv)
    assert all(h.is_pinned() for h in kv.tier._index.values())


def _round_trip(kv: KVCache) -> None:
    [block] = kv.ledger.allocate(1)
    _fill(kv, block, 1)
    before = [p[:, block].clone() for p in kv.pools()]
    key = prompt_block_hashes(list(range(BS)), BS)[0]
    kv.ledger.register(block, key)
    kv.tier.flush()
    kv.ledger.end_lease([block])
    kv.ledger.allocate(8)  # every block: the cached one is evicted and overwritten
    for p in kv.pools():
        p.zero_()
    kv.ledger.end_lease(list(range(8)))
    restored = kv.ledger.lease_prefix([key])
    assert len(restored) == 1 and kv.ledger.last_restored == 1
    assert all(torch.equal(p[:, restored[0]], b) for p, b in zip(kv.pools(), before))
    assert kv.allocator.lookup([key]) == restored  # registered on the device again
    kv.ledger.end_lease(restored + restored)
    kv.ledger.check()


def test_capacity_bound_and_lru(tmp_path):
    kv = _cache("auto", 3, tmp_path)
    events: list[CacheEvent] = []
    kv.allocator.listeners.append(events.append)
    keys = prompt_block_hashes(list(range(5 * BS)), BS)
    blocks = kv.ledger.allocate(5)
    for i in range(3):
        _fill(kv, blocks[i], i)
        kv.ledger.register(blocks[i], keys[i])
        kv.tier.flush()
    assert kv.tier.keys() == keys[:3]
    assert len(kv.tier.fetch(keys[:1], 8)) == 1  # a read makes key 0 the most recently used
    kv.ledger.register(blocks[3], keys[3])
    kv.tier.flush()
    assert kv.tier.keys() == [keys[2], keys[0], keys[3]] and kv.tier.stats.dropped_full == 1
    assert CacheEvent(CacheEventKind.REMOVED, Tier.HOST, keys[1]) in events
    assert len(list(Path(kv.tier.store.dir).iterdir())) == 3  # the evicted record's file is gone too
    kv.ledger.end_lease(blocks)
    kv.ledger.check()


def test_a_block_reused_while_copied_is_discarded(tmp_path):
    """Copy-then-verify: an offer whose block was evicted (and even registered again under the same key) before
    the writer copied it is thrown away."""
    from shared.kvcache.tier import _Offer

    kv = _cache("auto", 4, tmp_path)
    key = prompt_block_hashes(list(range(BS)), BS)[0]
    [block] = kv.ledger.allocate(1)
    serial = kv.allocator.register(block, key)
    kv.ledger.end_lease([block])
    kv.allocator.allocate(8)  # evicts it
    kv.allocator._release_blocks(sorted(range(8), reverse=True))  # block 0 is the next handed out
    again = kv.allocator.allocate(1)[0]
    assert again == block and kv.allocator.register(again, key) not in (0, serial)
    kv.tier._write(_Offer(block, key, serial, kv.tier._epoch))
    assert len(kv.tier) == 0 and kv.tier.stats.discarded == 1
    kv.allocator._release_blocks([again])


def test_a_fresh_store_per_process_and_a_reset_forgets(tmp_path):
    """A new tier (a restarted process) serves nothing an old one wrote: its own fresh directory; closing removes
    it; a prefix-cache reset empties the tier at once (CLEARED for Tier.HOST)."""
    kv = _cache("auto", 4, tmp_path)
    key = prompt_block_hashes(list(range(BS)), BS)[0]
    [block] = kv.ledger.allocate(1)
    kv.ledger.register(block, key)
    kv.tier.flush()
    old_dir = Path(kv.tier.store.dir)
    later = _cache("auto", 4, tmp_path)
    assert Path(later.tier.store.dir) != old_dir and later.tier.fetch([key], 8) == []
    events: list[CacheEvent] = []
    kv.allocator.listeners.append(events.append)
    kv.allocator.reset_prefix_cache()
    assert len(kv.tier) == 0 and CacheEvent(CacheEventKind.CLEARED, Tier.HOST) in events
    kv.tier.close()
    assert not old_dir.exists()
    kv.ledger.end_lease([block])


@pytest.mark.parametrize("values", [{}, {"engine": {"kvTierTokens": 65536, "kvTierDir": "/var/cache/kv"}}])
def test_the_chart_and_pdserve_up_give_both_services_the_tier(values):
    """engine.kvTierTokens / kvTierDir reach prefill and decode alike, from the chart and from `pdserve up`
    (the same flags; none when the tier is off)."""
    helm = pytest.importorskip("helm_python")
    import yaml

    from decode_service.server import parse_args as decode_args
    from prefill_service.server import parse_args as prefill_args
    from router.cli import deployment_from_args
    from router.cli import parser as pdserve_parser

    want = (values["engine"]["kvTierTokens"], values["engine"]["kvTierDir"]) if values else (0, None)
    argv = ["up", "--kv-tier-tokens", str(want[0])] + (["--kv-tier-dir", want[1]] if want[1] else [])
    dep = deployment_from_args(pdserve_parser().parse_args(argv))
    parsers = {"prefill_service": prefill_args, "decode_service": decode_args}
    rendered = helm.Chart.load(ROOT / "helm" / "pdserve").render(values, name="d", namespace="n")
    seen = set()
    for doc in (d for p, t in rendered.items() if not p.endswith(".txt") for d in yaml.safe_load_all(t) if d):
        if doc["kind"] in ("Deployment", "StatefulSet") and doc["spec"]["template"]["spec"]["containers"][0][
                "command"][-1] in parsers:
            container = doc["spec"]["template"]["spec"]["containers"][0]
            module = container["command"][-1]
            chart = parsers[module]([a.replace("$(POD_IP)", "10.0.0.1") for a in container["args"]])
            up = parsers[module](["--model", "m", *dep.flags(module.removesuffix("_service"))])
            assert (chart.kv_tier_tokens, chart.kv_tier_dir) == (up.kv_tier_tokens, up.kv_tier_dir) == want
            assert ("--kv-tier-tokens" in container["args"]) == bool(values)
            seen.add(module)
    assert seen == set(parsers)


def test_a_ranks_tier_totals_become_front_counters():
    """The totals a rank reports every turn (RankLoad's tier_*) are the front's counters, by service and rank."""
    loads = [RankLoad(0, tier_written_bytes=900, tier_read_bytes=300, tier_dropped_corrupt=1),
             RankLoad(1, tier_dropped_full=4)]
    families = {f.name: f for f in LoadCollector("prefill", lambda: [prefill_gauges(r) for r in loads]).collect()}
    samples = {(f.name, *s.labels.values()): s.value for f in (families["pdserve_kv_tier_bytes"],
                                                              families["pdserve_kv_tier_dropped_blocks"])
               for s in f.samples if s.name.endswith("_total")}
    assert samples[("pdserve_kv_tier_bytes", "prefill", "0", "written")] == 900
    assert samples[("pdserve_kv_tier_bytes", "prefill", "0", "read")] == 300
    assert samples[("pdserve_kv_tier_dropped_blocks", "prefill", "0", "corrupt")] == 1
    assert samples[("pdserve_kv_tier_dropped_blocks", "prefill", "1", "full")] == 4
    assert families["pdserve_kv_tier_bytes"].type == "counter"


def _sample(url: str, name: str, **labels: str) -> float:
    """The sum of a /metrics family's samples that carry these labels (whatever order they are written in)."""
    total = 0.0
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1).split(",") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_host_tier_hits_through_pdserve_up(tmp_path):
    """`pdserve up --kv-tier-tokens` (small device pools, the engines in their own processes): a prompt pushed out
    of both services' pools by others is served from their host tiers, with the same greedy tokens: the prefill
    computes none of its 12 cached blocks, decode's reservation restores them (none pushed). Both fronts' /metrics
    count the hits by tier and each rank's tier bytes written and read (reported by the engine every turn)."""
    proc = UpProcess(["--model", "models/tiny-v32", "--port", "0", "--http-port", "0", "--kv-cache-tokens", "512",
                      "--kv-tier-tokens", "8192", "--kv-tier-dir", str(tmp_path / "tier")], tmp_path / "logs")
    try:
        up = proc.start()
        text, again, cached = served_after_push_out(up, [11 + i % 900 for i in range(200)], 13)
        assert again == text and cached == 192  # 12 whole blocks of 16
        assert host_tier_hits(up) == (192, 192)
        (prefill,) = [name for name in up.metrics if name.startswith("prefill")]
        (decode,) = [name for name in up.metrics if name.startswith("decode")]
        tier_bytes = {(svc, direction): _sample(up.metrics[name], "pdserve_kv_tier_bytes_total", service=svc,
                                                rank="0", direction=direction)
                      for svc, name in (("prefill", prefill), ("decode", decode)) for direction in ("written", "read")}
        block = tier_bytes["prefill", "read"] / 12  # one block's payload: the same layout on both sides
        assert block > 0 and block == int(block) and tier_bytes["decode", "read"] == 12 * block, tier_bytes
        # the 12 blocks read back were written first, each with its record's header (and others' blocks too)
        assert tier_bytes["prefill", "written"] > 12 * block and tier_bytes["decode", "written"] > 12 * block
        assert _sample(up.metrics[prefill], "pdserve_kv_tier_dropped_blocks_total", reason="corrupt") == 0
    finally:
        assert proc.stop() == 0, proc.output()
