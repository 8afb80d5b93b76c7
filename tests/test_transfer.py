"""KV transfer: what decode receives is bitwise what the engine computes; leases guard every write."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from prefill_service.engine import PrefillEngineCore
from shared.device import get_device
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.kvcache import KVCache, KVLayout
from shared.kvcache.lease import LeaseTable
from shared.rpc import codegen
from shared.transfer import TcpReceiver, TransferError, make_sender
from shared.transfer import tcp as tcp_transport
from shared.transfer.base import cache_kinds
from shared.transfer.mooncake import MooncakeReceiver
from tests.helpers import TRANSPORTS, random_prompts


def _decode_side(layout, transport: str, ttl: float = 30.0):
    kv = KVCache(layout, 64, get_device())  # the CPU here; the accelerator with PDSERVE_DEVICE=cuda (README)
    leases = LeaseTable(kv.ledger, layout.block_size, layout.num_layers, cache_kinds(layout), ttl)
    tcp = TcpReceiver(kv, leases)
    receiver = MooncakeReceiver(kv, tcp) if transport == "mooncake" else tcp
    return kv, leases, receiver


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_received_kv_is_bitwise_local(ckpt, transport, kv_cache_dtype):
    """Also for the C8 cache: packed rows (int8 latent + scales + bf16 rope; FP8 keys + scale) move as bytes."""
    _check_received_kv(ckpt, transport, kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_received_kv_is_bitwise_local_through_host_staging(ckpt, kv_cache_dtype, monkeypatch):
    """An accelerator's pool (GPU, NPU) cannot be a socket buffer: TCP sends a host copy of its blocks and
    receives into a host buffer copied into the blocks. Forced here on CPU pools, the same bytes land (run
    on a GPU with PDSERVE_DEVICE=cuda, the other tests take this path for real)."""
    monkeypatch.setattr(tcp_transport, "on_host", lambda tensor: False)
    _check_received_kv(ckpt, "tcp", kv_cache_dtype)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mtp_layer_draft_state_arrives_with_its_own_index_keys(tmp_path, transport):
    """DeepSeek-V3.2's MTP layer has its own lightning indexer: decode's draft state for a pushed prompt is
    that layer's MLA latent rows and its own index-key rows (decode drafts from them; it never recomputes
    the prompt). After the handoff the main layers are bitwise the local computation, and the MTP layer's
    rows (the last one made with the first sampled token) are what one engine computes when it generates
    the same prompts itself, on prompts longer than the indexer's top-k (so the MTP indexer's picks read
    those keys). They are not another layer's rows: a transport that mixed up layers or cache kinds, or
    dropped the extra layer, fails here."""
    from shared.engine import LLM
    from shared.loader.tiny import write_checkpoint

    path = str(write_checkpoint(tmp_path / "mtp", "deepseek_v32", tokenizer=False, mtp=True, index_topk=8,
                                vocab_size=512, num_hidden_layers=2))
    received = _check_received_kv(None, transport, "auto", model=path, speculative="mtp")
    mtp_layer = received.layout.num_layers - 1  # the MTP layer's cache follows the main layers'
    assert mtp_layer == 2
    llm = LLM(path, block_size=4, speculative="mtp")
    engine, want, finish = llm.engine, {}, llm.engine.scheduler.finish

    def record(seq, reason: str) -> None:
        want[tuple(seq.prompt_token_ids)] = engine.kv.read_tokens(seq.block_table, len(seq.prompt_token_ids),
                                                                  mtp_layer)
        finish(seq, reason)

    engine.scheduler.finish = record
    llm.generate(received.prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    for prompt, rows in zip(received.prompts, received.rows):
        assert len(prompt) > 8 or prompt is received.prompts[1]  # past the indexer's top-8 (one short prompt)
        for kind in ("mla", "index"):
            got, ref = rows[mtp_layer][kind], want[tuple(prompt)][kind]
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), kind
            assert not any(torch.equal(got, rows[layer][kind]) for layer in range(mtp_layer))


@dataclass
class Received:
    """What decode holds after the handoff: per prompt, per layer, {cache kind: rows}."""

    layout: KVLayout
    prompts: list[list[int]]
    rows: list[list[dict[str, torch.Tensor]]]


def _check_received_kv(ckpt, transport: str, kv_cache_dtype: str, model: str | None = None,
                       speculative: str = "") -> Received:
    """Prefill pushes over `transport` into leases of a decode pool: every main layer's rows (both cache
    kinds) land bitwise as the same schedule computes them locally; returns what landed (the MTP layer's
    too, under `speculative`)."""
    config = EngineConfig(model=model or str(ckpt("v32_sparse")), block_size=4,
                          max_num_batched_tokens=9,  # chunked pushes
                          kv_cache_dtype=kv_cache_dtype, speculative=speculative)
    prefill = LLMEngine(config)
    worker = PrefillEngineCore(prefill, lambda t: make_sender(t, prefill.kv))
    kv, leases, receiver = _decode_side(prefill.layout, transport)
    prompts = random_prompts(3, [23, 6, 14], 512, seed=40)
    params = SamplingParams(max_tokens=4, temperature=0)
    futures, lease_of = [], {}
    for i, prompt in enumerate(prompts):
        lease = leases.reserve(f"r{i}", len(prompt) + 4, prompt_tokens=len(prompt))
        lease_of[i] = lease
        futures.append(worker.prefill(f"r{i}", prompt, params, receiver.destination(lease)))
    firsts = [f.result(timeout=60).first_token for f in futures]
    worker.stop()

    # The same schedule computed locally, without any transfer.
    local = LLMEngine(config)
    seqs = [local.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while any(s.num_cached < len(s.prompt_token_ids) for s in seqs):
        chunks = local.scheduler.schedule()
        local.sample(chunks, local.run_chunks(chunks))
    received = Received(kv.layout, prompts, [])
    for i, (seq, prompt) in enumerate(zip(seqs, prompts)):
        lease = leases.claim(lease_of[i].lease_id)  # complete: every layer of both caches arrived
        received.rows.append([kv.read_tokens(lease.blocks, len(prompt), layer)
                              for layer in range(kv.layout.num_layers)])
        for layer in range(local.model.config.num_hidden_layers):  # the main layers (run_chunks computes)
            got = received.rows[-1][layer]
            want = local.kv.read_tokens(seq.block_table, len(prompt), layer)
            assert set(got) == {"mla", "index"}
            for kind in got:
                assert torch.equal(got[kind].cpu(), want[kind].cpu()), (i, layer, kind)
    assert all(isinstance(t, int) for t in firsts)
    assert prefill.kv.allocator.num_free == prefill.kv.num_blocks  # prefill freed everything
    assert kv.mla.dtype == (torch.uint8 if kv_cache_dtype == "int8" else local.layout.dtype)
    return received


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_writes_need_a_live_lease_and_its_token(ckpt, transport):
    engine = LLMEngine(EngineConfig(model=str(ckpt("v32_sparse")), block_size=4))
    kv, leases, receiver = _decode_side(engine.layout, transport)
    sender = make_sender(transport, engine.kv)
    lease = leases.reserve("a", 8)
    dest = receiver.destination(lease)
    dest.token = b"\0" * 16
    push = sender.open(dest)
    push.send_layer(0, [0, 1], 0)
    with pytest.raises(TransferError, match="token"):
        push.finish()
    leases.release(lease.lease_id)
    push = sender.open(receiver.destination(lease))  # released: unknown lease (Mooncake: not writable)
    push.send_layer(0, [0, 1], 0)
    with pytest.raises(TransferError, match="unknown or expired|Mooncake write"):
        push.finish()
    assert kv.allocator.num_free == kv.num_blocks


def test_mooncake_writes_land_only_in_live_leases(ckpt):
    """Only a live lease's blocks are registered with Mooncake: a one-sided write aimed at other
    blocks, or at a released lease's, fails and leaves the memory untouched."""
    pytest.importorskip("mooncake.engine")
    engine = LLMEngine(EngineConfig(model=str(ckpt("v32_sparse")), block_size=4))
    engine.kv.mla.fill_(1)
    kv, leases, receiver = _decode_side(engine.layout, "mooncake")
    sender = make_sender("mooncake", engine.kv)
    lease = leases.reserve("a", 8)
    dest = receiver.destination(lease)
    outside = [b for b in range(kv.num_blocks) if b not in lease.blocks][:2]
    dest.block_ids = outside  # not this lease's blocks
    push = sender.open(dest)
    push.send_layer(0, [0, 1], 0)
    with pytest.raises(TransferError, match="Mooncake write"):
        push.finish()
    assert kv.mla[0, outside].abs().sum() == 0
    good = sender.open(receiver.destination(lease))
    good.send_layer(0, [0, 1], 0)
    good.finish(commit=False)
    assert kv.mla[0, lease.blocks].abs().sum() > 0  # the lease's own blocks take the write
    leases.release(lease.lease_id)
    kv.mla.zero_()
    late = sender.open(dest := receiver.destination(lease))  # released: no longer registered
    late.send_layer(0, [0, 1], 0)
    with pytest.raises(TransferError):
        late.finish(commit=False)
    assert kv.mla.abs().sum() == 0 and not receiver._engine.registered
    assert dest.lease_id == lease.lease_id


def test_lease_expiry_and_release_free_blocks(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt("v32_sparse")), block_size=4))
    kv, leases, _ = _decode_side(engine.layout, "tcp", ttl=0.0)
    leases.reserve("a", 30)
    assert kv.allocator.num_free == kv.num_blocks - 8
    assert leases.expire() == 1 and kv.allocator.num_free == kv.num_blocks


def test_layout_mismatch_is_refused(ckpt):
    a = LLMEngine(EngineConfig(model=str(ckpt("v32_sparse")), block_size=4))
    b = LLMEngine(EngineConfig(model=str(ckpt("v32_sparse")), block_size=8))
    kv, leases, receiver = _decode_side(b.layout, "tcp")
    with pytest.raises(TransferError, match="layout"):
        make_sender("tcp", a.kv).open(receiver.destination(leases.reserve("x", 4)))


def test_generated_stubs_are_current(tmp_path):
    fresh = {p.relative_to(tmp_path): p.read_text() for p in codegen.generate(tmp_path)}
    assert fresh, "no stubs generated"
    for rel, text in fresh.items():
        committed = codegen.OUT_DIR / rel
        assert committed.exists() and committed.read_text() == text, f"{rel} is stale: run python -m shared.rpc.codegen"


def test_a_bad_destination_fails_only_its_own_request(ckpt):
    """A lease too small for its prompt fails that prefill with TransferError before any work; a
    prompt batched with it is pushed and answered as usual, and every block comes back."""
    config = EngineConfig(model=str(ckpt("v32_sparse")), block_size=4)
    prefill = LLMEngine(config)
    core = PrefillEngineCore(prefill, lambda t: make_sender(t, prefill.kv))
    kv, leases, receiver = _decode_side(prefill.layout, "tcp")
    good, bad = random_prompts(2, [14, 23], 512, seed=41)
    params = SamplingParams(max_tokens=4, temperature=0)
    small = receiver.destination(leases.reserve("bad", 4, prompt_tokens=4))  # 1 block for a 23-token prompt
    ok = core.prefill("good", good, params, receiver.destination(leases.reserve("good", 18, prompt_tokens=14)))
    refused = core.prefill("bad", bad, params, small)
    with pytest.raises(TransferError, match="lease holds 1 blocks"):
        refused.result(timeout=60)
    result = ok.result(timeout=60)
    token, pushed = result.first_token, result.pushed_bytes
    core.stop()
    assert isinstance(token, int) and pushed > 0
    assert prefill.kv.allocator.num_free == prefill.kv.num_blocks


def _fake_sysfs(root, devices: dict[str, str]):
    """A /sys/class/infiniband look-alike: device → its port 1 state."""
    for name, state in devices.items():
        port = root / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(f"{state}\n")
    return root


def test_rdma_devices_are_resolved_or_refused_naming_the_flag(tmp_path):
    """--mooncake-protocol rdma: auto takes the devices with an active port, named devices must exist, and
    no device means an error that names the flag and what was found (never a silent fall back to tcp)."""
    from shared.transfer.rdma import mooncake_device_names

    sysfs = _fake_sysfs(tmp_path / "ib", {"mlx5_0": "4: ACTIVE", "mlx5_1": "1: DOWN", "mlx5_2": "4: ACTIVE"})
    assert mooncake_device_names("mooncake", "rdma", "auto", sysfs) == "mlx5_0,mlx5_2"
    assert mooncake_device_names("mooncake", "rdma", "mlx5_1", sysfs) == "mlx5_1"
    assert mooncake_device_names("mooncake", "tcp", "auto", sysfs) == ""
    with pytest.raises(ValueError, match=r"--mooncake-devices: mlx5_9 not found under .* \(found: mlx5_0 \(active\), "
                                         r"mlx5_1 \(no active port\), mlx5_2 \(active\)\)"):
        mooncake_device_names("mooncake", "rdma", "mlx5_0,mlx5_9", sysfs)
    down = _fake_sysfs(tmp_path / "down", {"mlx5_0": "1: DOWN"})
    with pytest.raises(ValueError, match=r"--mooncake-protocol rdma: no RDMA device with an active port .* "
                                         r"\(found: mlx5_0 \(no active port\)\)"):
        mooncake_device_names("mooncake", "rdma", "auto", down)
    with pytest.raises(ValueError, match="found: none"):
        mooncake_device_names("mooncake", "rdma", "auto", tmp_path / "absent")
    with pytest.raises(ValueError, match="--mooncake-protocol rdma needs --kv-transport mooncake"):
        mooncake_device_names("tcp", "rdma", "auto", sysfs)


@pytest.mark.parametrize("service", ["prefill_service", "decode_service"])
def test_a_service_asked_for_rdma_it_cannot_have_exits_at_start(service):
    """Started for real: asked for an RDMA NIC this machine does not have, the process exits at once, before
    loading the model, with one line naming the flag and what it found (whatever devices the machine has;
    the no-device wording is checked on the fake sysfs above)."""
    import subprocess
    import sys

    from shared.transfer.rdma import SYSFS, rdma_devices

    found = rdma_devices(SYSFS)
    listing = ", ".join(f"{n} ({'active' if up else 'no active port'})" for n, up in found.items()) or "none"
    proc = subprocess.run([sys.executable, "-m", service, "--model", "/nonexistent", "--insecure", "--kv-transport",
                           "mooncake", "--mooncake-protocol", "rdma", "--mooncake-devices", "pdserve_no_such_nic"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --mooncake-devices: pdserve_no_such_nic not found under {SYSFS} (found: {listing})")
