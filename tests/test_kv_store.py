"""Mooncake Store as the cluster-wide second tier (`--kv-store-master`, shared.transfer.mooncake_store), against
a real mooncake_master: a prefix one engine spilled is a tier hit on another with the same greedy tokens; records
are named by the checkpoint's and layout's digest; a record altered in the store is dropped, never served; and
`pdserve up --kv-store-master auto` serves a pushed-out prompt from the store on both services."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fleet_faults import UpProcess
from router.kv_store import StoreMaster
from shared.engine import LLM
from shared.protocol.prefix import prompt_block_hashes
from shared.transfer.mooncake import mooncake_available
from shared.transfer.mooncake_store import MooncakeStore, store_namespace
from tests.helpers import host_tier_hits, random_prompts, served_after_push_out
from tests.test_kv_tier import BS, GREEDY, _run  # one engine run, then the tier's writer flushed

pytestmark = pytest.mark.skipif(not mooncake_available() and not os.environ.get("CI"),
                                reason="Mooncake not installed (make installs it; under CI a missing one fails)")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def master():
    m = StoreMaster.start()
    yield m.address
    m.stop()


@pytest.fixture(scope="module")
def sparse_path(ckpt):
    return str(ckpt("v32_sparse"))


@pytest.fixture
def engine(sparse_path, master):
    """engine() → an engine whose tier lives in the store; every one leaves the store (unmounts its segment)
    when the test ends, as a process does when it exits."""
    made: list[LLM] = []

    def make() -> LLM:
        made.append(LLM(sparse_path, block_size=BS, kv_cache_tokens=64, kv_tier_tokens=1024,
                        kv_store_master=master))
        return made[-1]

    yield make
    for llm in made:
        llm.engine.kv.tier.close()


def test_a_prefix_one_engine_spilled_is_a_hit_on_another(sparse_path, engine):
    target = random_prompts(1, [40], 512, seed=70)[0]
    base = LLM(sparse_path, block_size=BS, kv_cache_tokens=64).generate([target], GREEDY)[0].token_ids
    writer = engine()
    first = _run(writer, target)
    assert first.output_token_ids == base and first.num_cached_prompt_tokens == 0
    assert isinstance(writer.engine.kv.tier.store, MooncakeStore)
    reader = engine()  # another instance: nothing on its device, nothing in its own index
    assert len(reader.engine.kv.tier) == 0
    read = reader.engine.kv.tier.stats.read_blocks  # its warm-up's prompt may have been another's
    seq = _run(reader, target)
    assert seq.num_cached_prompt_tokens == seq.num_host_cached_prompt_tokens == 36  # 9 whole blocks of 4
    assert seq.output_token_ids == base
    assert reader.engine.kv.tier.stats.read_blocks - read == 9


def test_records_are_named_by_checkpoint_and_layout(sparse_path, tmp_path):
    """Two checkpoints of one architecture (one weight byte apart) and one checkpoint under two layouts never
    share a record name."""
    layout = {"block_size": BS, "dtype": "bfloat16"}
    same = store_namespace(sparse_path, layout)
    assert same == store_namespace(sparse_path, dict(layout))
    assert store_namespace(sparse_path, {**layout, "block_size": 8}) != same
    other = tmp_path / "other"
    shutil.copytree(sparse_path, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # the last tensor's last bytes
    weights.write_bytes(bytes(data))
    assert store_namespace(str(other), layout) != same


def test_a_record_altered_in_the_store_is_dropped_not_served(sparse_path, engine):
    target = random_prompts(1, [40], 512, seed=71)[0]
    base = LLM(sparse_path, block_size=BS, kv_cache_tokens=64).generate([target], GREEDY)[0].token_ids
    writer = engine()
    _run(writer, target)
    store = writer.engine.kv.tier.store
    first_key = prompt_block_hashes(target, BS, 1)[0]
    name = store.name(first_key)
    good = store._store.get(name)
    record = bytearray(good)
    record[-5] ^= 0x01  # one bit of the payload, rewritten under the same name (a bad replica, a bad actor)
    assert store._store.remove(name, True) == 0 and store._store.put(name, bytes(record)) == 0
    reader = engine()
    seq = _run(reader, target)
    assert seq.num_cached_prompt_tokens == 0 and seq.output_token_ids == base  # a miss at block 0: computed
    assert reader.engine.kv.tier.stats.dropped_corrupt == 1
    reader.engine.kv.tier.flush()  # removed for every reader, then written again as the reader computed it
    assert store._store.get(name) == good


def test_kv_store_master_needs_a_tier_size(tmp_path):
    """Hostile flags: a store without --kv-tier-tokens is refused in one line, before anything starts."""
    out = subprocess.run([sys.executable, "-m", "router.cli", "up", "--model", "models/tiny-v32", "--port", "0",
                          "--kv-store-master", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-tier-tokens" in out.stderr, out.stderr


def test_the_store_tier_through_pdserve_up(tmp_path):
    """`pdserve up --kv-store-master auto` starts a mooncake_master; both services keep their tiers in its
    store: a prompt pushed out of the 512-token device pools by others comes back from the store on prefill
    and on decode (none computed, none pushed), with the same text, counted as host-tier hits."""
    proc = UpProcess(["--model", "models/tiny-v32", "--port", "0", "--http-port", "0", "--kv-cache-tokens", "512",
                      "--kv-tier-tokens", "8192", "--kv-store-master", "auto"], tmp_path / "logs")
    try:
        up = proc.start()
        text, again, cached = served_after_push_out(up, [17 + i % 900 for i in range(200)], 7)
        assert again == text and cached == 192  # 12 whole blocks of 16
        assert host_tier_hits(up) == (192, 192)
        assert (tmp_path / "logs" / "kv-store-master.log").exists()
    finally:
        proc.stop()
