"""The block ledger: every hand-off of a KV block, releases queued from other threads, and the debug
check that each block has exactly one owner (shared.kvcache.ledger)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from shared.kvcache import BlockAllocator, BlockLedger, Holder, Holding, LedgerViolation, OutOfBlocks, Owner
from shared.kvcache.lease import LeaseError, LeaseTable
from shared.kvcache.ledger import CHECK_ENV, check_from_env
from shared.protocol.prefix import block_hash


@dataclass
class Seq:
    request_id: str
    block_table: list[int] = field(default_factory=list)


class Requests:
    """A scheduler's part the ledger sees: the sequences holding blocks."""

    def __init__(self, ledger: BlockLedger):
        self.seqs: list[Seq] = []
        ledger.watch(self)

    def add(self, request_id: str) -> Seq:
        self.seqs.append(Seq(request_id))
        return self.seqs[-1]

    def holdings(self) -> list[Holding]:
        return [Holding(Holder(Owner.SEQUENCE, s.request_id), s.block_table) for s in self.seqs if s.block_table]


def _ledger(n: int = 8) -> tuple[BlockLedger, Requests]:
    ledger = BlockLedger(BlockAllocator(n), check=True)
    return ledger, Requests(ledger)


def test_sequence_hand_offs_keep_one_owner_per_block():
    ledger, reqs = _ledger()
    a, b = reqs.add("a"), reqs.add("b")
    ledger.grow(a, 3)
    hashes = [block_hash(None, [1]), block_hash(block_hash(None, [1]), [2])]
    for block, h in zip(a.block_table, hashes):
        ledger.register(block, h)
    assert ledger.retain_prefix(b, hashes) == 2  # shared: two references, two holders each
    assert b.block_table == a.block_table[:2]
    ledger.settle()
    ledger.preempt(a)
    assert a.block_table == [] and ledger.num_free == 8 - 2
    ledger.settle()
    hold = ledger.hand_to_push(b)  # sequence → push
    assert b.block_table == [] and ledger.num_free == 6
    ledger.settle()
    ledger.end_push(hold)
    ledger.settle()
    assert ledger.num_free == 8 and ledger.allocator.num_cached == 2  # evictable, still cached
    c = reqs.add("c")
    ledger.retain_prefix(c, hashes[:1])
    ledger.release_prefix(c)  # not admitted after all
    ledger.settle()
    assert ledger.num_free == 8


def test_lease_hand_offs_claim_release_expire():
    ledger, reqs = _ledger()
    leases = LeaseTable(ledger, block_size=4, num_layers=1, kinds=("mla",), ttl_seconds=30)
    lease = leases.reserve("r", 8, prompt_tokens=0)
    ledger.settle()
    claimed = leases.claim(lease.lease_id, require_complete=False)
    seq = reqs.add("r")
    ledger.seat(seq, claimed.blocks)  # lease → sequence: the same references, a new holder
    ledger.settle()
    ledger.finish(seq)
    other = leases.reserve("s", 4)
    assert leases.release(other.lease_id)
    gone = leases.reserve("t", 4)
    assert leases.expire(now=gone.expires_at + 1) == 1
    dropped = leases.claim(leases.reserve("u", 4, prompt_tokens=0).lease_id, require_complete=False)
    ledger.drop_claimed(dropped.blocks)  # claimed, but its request could not start
    ledger.settle()
    assert ledger.num_free == 8


def test_a_release_from_another_thread_is_queued_and_drained_on_the_engine_thread():
    """A dead lease's last write ends on a receiver thread: its blocks count as free at once, but their
    references are dropped only by the engine thread's next drain (or allocation)."""
    ledger, _ = _ledger()
    leases = LeaseTable(ledger, block_size=4, num_layers=1, kinds=("mla",))
    lease = leases.reserve("r", 8)
    held = leases.begin_write(lease.lease_id, lease.token, 0, "mla", 0, 2)
    assert leases.release(lease.lease_id)
    ledger.settle()  # fenced by the write: still the (dead) lease's
    assert ledger.num_free == 6
    writer = threading.Thread(target=leases.end_write, args=(held, 0, "mla", 0, 2, True))
    writer.start()
    writer.join()
    state = ledger.allocator.state()
    assert set(state.releasing) == set(lease.blocks) and all(state.refs[b] == 1 for b in lease.blocks)
    assert ledger.num_free == 8  # the next allocation drains first
    ledger.check()  # a queued release is an owner of its own
    assert ledger.drain() == 2 and not ledger.allocator.state().releasing
    ledger.settle()
    assert len(ledger.allocate(8)) == 8  # every block, the drained ones included


def test_an_allocation_drains_queued_releases_first():
    ledger, _ = _ledger(2)
    leases = LeaseTable(ledger, block_size=4, num_layers=1, kinds=("mla",))
    lease = leases.reserve("r", 8)
    assert leases.abandon(lease.lease_id)  # a receiver gave up on it: queued
    assert ledger.can_allocate(2) and len(ledger.allocate(2)) == 2


def test_probe_and_scratch_blocks_are_held():
    ledger, _ = _ledger(4)
    scratch = ledger.hold_scratch()
    probe = ledger.borrow_probe()
    ledger.settle()
    assert ledger.num_free == 2 and scratch[0] not in probe.blocks
    ledger.return_probe(probe)
    ledger.settle()
    assert ledger.num_free == 3  # the scratch block stays held


def test_the_check_catches_a_block_with_two_owners():
    ledger, reqs = _ledger()
    a, b = reqs.add("a"), reqs.add("b")
    ledger.grow(a, 2)
    b.block_table = a.block_table[1:]  # copied, not retained: one reference, two holders
    with pytest.raises(LedgerViolation, match="1 references for 2 holders") as err:
        ledger.settle()
    assert err.value.block == a.block_table[1] and err.value.owners == ["sequence a", "sequence b"]


def test_the_check_catches_a_freed_block_still_in_a_table():
    ledger, reqs = _ledger()
    a, b = reqs.add("a"), reqs.add("b")
    ledger.grow(a, 2)
    b.block_table = list(a.block_table)
    ledger.finish(a)
    with pytest.raises(LedgerViolation, match="more than one owner") as err:
        ledger.check()
    assert err.value.owners == ["free", "sequence b"]


def test_the_check_catches_a_leak_seen_twice():
    """A request dropped without giving its blocks back: nobody holds them. One check may see a hand-off
    made on another thread half done, so the second check in a row raises."""
    ledger, reqs = _ledger()
    a = reqs.add("a")
    ledger.grow(a, 2)
    reqs.seqs.remove(a)
    ledger.check()
    with pytest.raises(LedgerViolation, match="leaked: 1 references for 0 holders") as err:
        ledger.check()
    assert err.value.block == min(a.block_table) and err.value.owners == []


def test_the_check_is_off_unless_asked(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "0")
    assert not check_from_env() and not BlockLedger(BlockAllocator(1)).checking
    monkeypatch.setenv(CHECK_ENV, "1")
    assert check_from_env() and BlockLedger(BlockAllocator(1)).checking
    ledger = BlockLedger(BlockAllocator(2), check=False)
    ledger.allocate(1)  # held by nobody: not checked
    ledger.settle()
    ledger.settle()


def test_an_engine_step_checks_its_ledger(ckpt):
    """The scheduler is a holder the engine's ledger counts: a request dropped without finishing (its
    blocks held by nobody) fails the step after next, naming the block."""
    from shared.engine import LLM, SamplingParams

    engine = LLM(str(ckpt("v32_sparse")), dtype="float32", block_size=4, kv_cache_tokens=64).engine
    assert engine.kv.ledger.checking  # tests/conftest.py turns the check on for the suite
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seq = engine.add_request([5, 6, 7, 8, 9], params, "kept")
    engine.step()
    lost = engine.add_request([5, 6, 7], params, "lost")
    engine.step()
    engine.scheduler.running.remove(lost)  # dropped: no finish, no blocks given back
    engine.step()
    with pytest.raises(LedgerViolation, match="leaked") as err:
        engine.step()
    assert err.value.block in lost.block_table and seq.block_table


def _cached_prompt(ledger: BlockLedger, requests: Requests, n: int) -> list[bytes]:
    """A finished request's `n` prompt blocks, left in the prefix cache under their keys."""
    seq = requests.add("earlier")
    ledger.grow(seq, n)
    keys = []
    for i, block in enumerate(seq.block_table):
        keys.append(block_hash(keys[-1] if keys else None, [i] * 4))
        ledger.register(block, keys[-1])
    ledger.finish(seq)
    requests.seqs.remove(seq)
    return keys


def test_lease_starts_on_cached_prefix_read_only():
    """A reservation with its prompt's keys starts on the cached blocks (shared, read-only: a write below
    them is refused, completeness counts only the blocks after them); its end gives the shared references
    back, from the engine thread or queued from a receiver's, and the blocks stay cached."""
    ledger, requests = _ledger(8)
    keys = _cached_prompt(ledger, requests, 3)
    leases = LeaseTable(ledger, block_size=4, num_layers=1, kinds=("mla",))
    lease = leases.reserve("r", 20, prompt_tokens=16, prefix=keys + [b"x" * 32])
    assert lease.reused == 3 and lease.reused_hashes == tuple(keys) and lease.prompt_blocks == 4
    ledger.check()
    with pytest.raises(LeaseError, match="read-only"):
        leases.begin_write(lease.lease_id, lease.token, 0, "mla", 2, 2)
    held = leases.begin_write(lease.lease_id, lease.token, 0, "mla", 3, 1)
    leases.end_write(held, 0, "mla", 3, 1, True)
    assert leases.commit(lease)  # complete: the one block after the reused three
    twin = leases.reserve("twin", 16, prompt_tokens=16, prefix=keys)
    assert twin.blocks[:3] == lease.blocks[:3]  # two leases share the cached blocks
    assert leases.abandon(twin.lease_id)  # a receiver's thread: shared references queued
    ledger.check()
    assert leases.release(lease.lease_id)
    ledger.settle()
    assert ledger.allocator.lookup(keys) == lease.blocks[:3]  # still cached


def test_lease_prefix_gives_back_hits_when_the_pool_is_full():
    ledger, requests = _ledger(4)
    keys = _cached_prompt(ledger, requests, 2)
    leases = LeaseTable(ledger, block_size=4, num_layers=1, kinds=("mla",))
    with pytest.raises(OutOfBlocks):
        leases.reserve("r", 40, prompt_tokens=12, prefix=keys)
    ledger.check()
    assert ledger.num_free == 4
