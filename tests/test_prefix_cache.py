"""Prefix cache: reference-counted blocks keyed by a hash chain, LRU eviction, same tokens as without."""

from __future__ import annotations

import pytest

from shared.engine import LLM, SamplingParams
from shared.kvcache import BlockAllocator
from shared.protocol.prefix import block_hash, prompt_block_hashes
from tests.helpers import random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def sparse_path(ckpt):
    return str(ckpt("v32_sparse"))


def test_allocator_refcounts_and_lru_eviction():
    a = BlockAllocator(4)
    h = [block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])]
    b0, b1 = a.allocate(2)
    a.register(b0, h[0])
    a.register(b1, h[1])
    assert a.lookup(h) == [b0, b1]  # a second reference to each
    a._release_blocks([b0, b1])
    assert a.num_free == 2  # still referenced once
    a._release_blocks([b0, b1])
    assert a.num_free == 4 and a.num_cached == 2  # unreferenced, still cached
    assert a.lookup(h[:1]) == [b0]
    a._release_blocks([b0])
    with pytest.raises(ValueError):
        a._release_blocks([b0])  # double free is caught with refcounts too
    assert sorted(a.allocate(2)) == sorted(set(range(4)) - {b0, b1})  # free blocks go before cached ones
    [evicted] = a.allocate(1)
    assert evicted == b1  # least recently used cached block first (b0 was looked up after b1)
    assert a.lookup(h) == [b0]  # the chain breaks at the evicted block
    assert a.num_cached == 1


def test_hash_chain_depends_on_every_earlier_token():
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(block_hash(None, [1, 2]), [3, 4]) != block_hash(block_hash(None, [1, 5]), [3, 4])


def test_cached_prefix_gives_same_tokens_and_shares_blocks(sparse_path):
    system = random_prompts(1, [37], 512, seed=50)[0]
    questions = random_prompts(3, [5, 9, 3], 512, seed=51)
    prompts = [system + q for q in questions]
    plain = LLM(sparse_path, block_size=4, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = LLM(sparse_path, block_size=4, max_num_batched_tokens=16)  # chunked too
    engine = llm.engine
    first = llm.generate(prompts[:1], GREEDY)
    assert first[0].token_ids == plain[0].token_ids
    seqs = [engine.add_request(p, GREEDY) for p in prompts[1:]]
    engine.step()
    # both claimed the 9 full blocks of the system prompt: the same block ids, one reference each
    assert [s.num_cached_prompt_tokens for s in seqs] == [36, 36]
    assert seqs[0].block_table[:9] == seqs[1].block_table[:9]
    while engine.has_work:
        engine.step()
    assert [s.output_token_ids for s in seqs] == [o.token_ids for o in plain[1:]]
    alloc = engine.kv.allocator
    assert alloc.num_free == engine.kv.num_blocks  # every reference returned; cached blocks are evictable
    assert alloc.num_cached > 9


def test_eviction_under_pressure_recomputes(sparse_path):
    target = random_prompts(1, [40], 512, seed=52)[0]
    others = random_prompts(6, [40] * 6, 512, seed=53)
    llm = LLM(sparse_path, block_size=4, kv_cache_tokens=64)  # 16 blocks: one request at a time fits
    base = llm.generate([target], GREEDY)[0].token_ids
    again = llm.engine.add_request(target, GREEDY)
    while llm.engine.has_work:
        llm.engine.step()
    assert again.num_cached_prompt_tokens == 36 and again.output_token_ids == base
    for p in others:  # each needs 13 of the 16 blocks: the target's cached blocks get evicted
        llm.generate([p], GREEDY)
    evicted = llm.engine.add_request(target, GREEDY)
    while llm.engine.has_work:
        llm.engine.step()
    assert evicted.num_cached_prompt_tokens < 36 and evicted.output_token_ids == base


def test_preempted_request_resumes_from_its_cached_blocks(sparse_path):
    prompts = random_prompts(4, [30, 30, 30, 30], 512, seed=54)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(sparse_path, block_size=4, enable_prefix_caching=False).generate(prompts, params)
    tight = LLM(sparse_path, block_size=4, kv_cache_tokens=160)  # 40 blocks < 4 × 14: preemption
    assert [o.token_ids for o in tight.generate(prompts, params)] == [o.token_ids for o in roomy]


def test_event_log_finds_a_prompts_cached_prefix_from_the_prompt_alone(sparse_path):
    """The allocator's events, in a CacheEventLog, find a prompt's cached prefix from the prompt alone
    (the same chained hashes the scheduler uses), and nothing for an unrelated prompt."""
    from shared.kvcache.event_log import CacheEventLog

    llm = LLM(sparse_path, block_size=4)
    log = CacheEventLog()
    llm.engine.kv.allocator.listeners.append(log)
    prompt = list(range(3, 40))
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert log.leading_blocks(prompt_block_hashes(prompt + [1, 2], 4), 1) == [len(prompt) // 4]
    assert log.leading_blocks(prompt_block_hashes(prompt[:9] + [99] * 20, 4), 1) == [2]  # diverges in block 2
    assert log.leading_blocks(prompt_block_hashes(list(range(100, 140)), 4), 1) == [0]


def test_cache_salt_keeps_tenants_prefixes_apart(sparse_path):
    """Only a request with the same cache_salt claims a salted prompt's cached blocks; the empty salt
    keys blocks as before (the router's guess, prompt_block_hashes, chains them the same way)."""
    prompt = random_prompts(1, [41], 512, seed=54)[0]
    llm = LLM(sparse_path, block_size=4)
    engine = llm.engine
    llm.generate([prompt], GREEDY, cache_salt="tenant-a")

    def cached(salt: str) -> int:
        seq = engine.add_request(prompt, GREEDY, cache_salt=salt)
        while engine.has_work:
            engine.step()
        return seq.num_cached_prompt_tokens

    assert [cached("tenant-b"), cached(""), cached("tenant-a")] == [0, 0, 40]
    assert prompt_block_hashes(prompt, 4, 10, "tenant-a") == seq_hashes(engine, prompt, "tenant-a")
    assert prompt_block_hashes(prompt, 4, 10) == [block_hash(None, prompt[:4]), *prompt_block_hashes(prompt, 4, 10)[1:]]
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(prompt, GREEDY, cache_salt="x" * 257)
    with pytest.raises(ValueError, match="cache_salt: not valid Unicode"):
        engine.add_request(prompt, GREEDY, cache_salt="tenant-\ud800")


def seq_hashes(engine, prompt: list[int], salt: str) -> list[bytes]:
    """The engine scheduler's keys of a salted prompt's first 10 blocks."""
    seq = engine.make_sequence(prompt, GREEDY, cache_salt=salt)
    try:
        return engine.scheduler._hashes(seq, 10)
    finally:
        engine.abort(seq.request_id)
