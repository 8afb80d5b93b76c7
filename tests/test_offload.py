"""Weight offload (`--offload-layers`, shared.model.offload): same logits, copies overlap compute,
the device holds only the staging buffers."""

from __future__ import annotations

import pytest
import torch

from shared.device import accelerator, allocated_bytes, synchronize
from shared.kvcache import KVCache, KVLayout
from shared.loader.checkpoint import load_model
from shared.model import DeepseekForCausalLM, ForwardBatch, SeqChunk
from shared.model.offload import ALIGN, LayerOffloader, parse_layers
from tests.helpers import engine_logits, random_prompts

PROMPT = random_prompts(1, [11], 512, seed=3)[0]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def path(ckpt):
    return ckpt("v32_4layers")


@pytest.fixture(scope="module")
def baseline(path) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Prompt logits, a second prompt's logits, and greedy decode-step logits without offload."""
    model, _ = load_model(path, dtype="float32", device="cpu")
    return engine_logits(model, PROMPT), engine_logits(model, PROMPT[:7]), decode_logits(model, PROMPT, 4)


def decode_logits(model: DeepseekForCausalLM, ids: list[int], steps: int, block_size: int = 4,
                  device: torch.device = CPU) -> list[torch.Tensor]:
    """Prefill `ids`, then `steps` greedy one-token decode steps over the paged cache: each step's logits."""
    layout = KVLayout.from_model_config(model.config, block_size, model.dtype)
    kv = KVCache(layout, num_blocks=(len(ids) + steps) // block_size + 2, device=device)
    table = kv.allocator.allocate(kv.blocks_needed(len(ids) + steps))
    fb = ForwardBatch.build([SeqChunk(list(ids), 0, table)], block_size, device)
    out = [model(fb, kv)]
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(out[-1][-1].argmax()))
        fb = ForwardBatch.build([SeqChunk([seq[-1]], len(seq) - 1, table)], block_size, device)
        out.append(model(fb, kv))
    return out


def offloaded(path, layers: str, buffers: int = 2) -> DeepseekForCausalLM:
    model, _ = load_model(path, dtype="float32", device="cpu")
    model.enable_offload(parse_layers(layers, model.config.num_hidden_layers), buffers)
    return model


@pytest.mark.parametrize("spec,buffers", [("1,2,3", 2), ("all", 2), ("all", 1), ("0,2", 3)])
def test_offload_logits_identical(path, baseline, spec, buffers):
    prompt, second, decode = baseline
    model = offloaded(path, spec, buffers)
    off = model.offloader
    assert off is not None and sorted(off.offloaded) == parse_layers(spec, 4)
    for _ in range(2):  # the second call re-binds the (re-used) staging buffers
        assert torch.equal(engine_logits(model, PROMPT), prompt)
    assert torch.equal(engine_logits(model, PROMPT[:7]), second)
    for ours, ref in zip(decode_logits(model, PROMPT, 4), decode, strict=True):
        assert torch.equal(ours, ref)
    kept = [i for i in range(4) if i not in off.offloaded]  # untouched: no layer of theirs in host copies
    host = [(h.data_ptr(), h.data_ptr() + h.numel()) for h in off.host.values()]
    for i in kept:
        for p in model.model.layers[i].parameters():
            assert not any(lo <= p.data_ptr() < hi for lo, hi in host)
    off.close()


def test_inference_mode_weights(path, baseline):
    """Weights made under inference mode (as synthetic.random_model does) are inference tensors; the
    offloaded ones are re-wrapped once, so re-binding them never mixes inference and normal tensors."""
    with torch.inference_mode():
        model, _ = load_model(path, dtype="float32", device="cpu")
    assert model.model.layers[2].input_layernorm.weight.is_inference()
    model.enable_offload([0, 2, 3])
    for _ in range(2):
        assert torch.equal(engine_logits(model, PROMPT), baseline[0])
    assert model.model.layers[1].input_layernorm.weight.is_inference()  # not offloaded: untouched
    model.offloader.close()


def test_event_order(path):
    model = offloaded(path, "all")
    off = model.offloader
    engine_logits(model, PROMPT)
    events = list(off.events)
    for i in range(3):
        assert events.index(("copy_issued", i + 1)) < events.index(("compute_end", i)), events
    for i in range(4):
        assert events.index(("copy_done", i)) < events.index(("compute_start", i)), events
    # later steps: every compute of layer i follows a copy of layer i finished since its last compute
    engine_logits(model, PROMPT)
    engine_logits(model, PROMPT[:5])
    events = list(off.events)
    for k, (kind, i) in enumerate(events):
        if kind == "compute_start":
            last_end = max((j for j in range(k) if events[j] == ("compute_end", i)), default=-1)
            assert ("copy_done", i) in events[last_end + 1 : k], (k, events)
            assert ("copy_issued", (i + 1) % 4) in events[last_end + 1 : k], (k, events)
    off.close()


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_staging_is_bounded_and_separate(path, buffers):
    """The staging arenas are `buffers` × the largest offloaded layer, apart from the host copies;
    an offloaded layer's tensors sit in an arena only while it computes."""
    model = offloaded(path, "1,2,3", buffers)  # layers 1-3 are MoE; add the dense layer 0 below
    off = model.offloader
    assert len(off.staging) == buffers
    largest = max(off.layer_nbytes(i) for i in off.offloaded)
    assert sum(a.numel() for a in off.staging) == buffers * largest
    for i in off.offloaded:
        raw = [t for t in model.model.layers[i].parameters() if t.numel()]
        raw += [model.model.layers[i].self_attn.w_uk, model.model.layers[i].self_attn.w_uv_t]
        assert off.layer_nbytes(i) <= sum(t.nbytes for t in raw) + ALIGN * len(raw)

    arenas = [(a.data_ptr(), a.data_ptr() + a.numel()) for a in off.staging]
    hosts = {i: (h.data_ptr(), h.data_ptr() + h.numel()) for i, h in off.host.items()}

    def inside(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in spans)

    def tensors(i: int) -> list[torch.Tensor]:
        attn = model.model.layers[i].self_attn
        return [p for p in model.model.layers[i].parameters() if p.numel()] + [attn.w_uk, attn.w_uv_t]

    seen: list[int] = []

    def during(module, args) -> None:  # forward pre-hook: layer i is about to compute
        i = module.layer_idx
        seen.append(i)
        if i in off.offloaded:
            assert all(inside(t, arenas) for t in tensors(i))
            assert not any(inside(t, [hosts[i]]) for t in tensors(i))

    hooks = [layer.register_forward_pre_hook(during) for layer in model.model.layers]
    engine_logits(model, PROMPT)
    for h in hooks:
        h.remove()
    assert seen == [0, 1, 2, 3]
    for i in off.offloaded:  # after the step: back on the host copies, none in an arena
        assert all(inside(t, [hosts[i]]) and not inside(t, arenas) for t in tensors(i))
    off.close()

    mixed = offloaded(path, "all", buffers).offloader  # a dense layer and MoE layers share the arenas
    sizes = {mixed.layer_nbytes(i) for i in range(4)}
    assert len(sizes) == 2 and sum(a.numel() for a in mixed.staging) == buffers * max(sizes)
    mixed.close()


def test_parse_layers():
    assert parse_layers("3,5,7", 8) == [3, 5, 7]
    assert parse_layers("2-5", 8) == [2, 3, 4, 5]
    assert parse_layers(" 6, 0-1 ,1 ", 8) == [0, 1, 6]
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("", 4) == []
    for bad in ("4", "-1", "3-1", "a", "1,,2", "1-", "0-4"):
        with pytest.raises(ValueError, match="--offload-layers"):
            parse_layers(bad, 4)


def test_enable_offload_errors(path):
    model, _ = load_model(path, dtype="float32", device="cpu")
    model.enable_offload([])
    assert model.offloader is None
    with pytest.raises(ValueError, match="--offload-layers"):
        model.enable_offload([4])
    with pytest.raises(ValueError, match="--offload-layers"):
        LayerOffloader(model.model.layers, [0], CPU, buffers=0)


@pytest.mark.skipif(accelerator() is None, reason="needs an accelerator")
def test_offload_on_accelerator(path):
    """On a GPU/NPU: copies on a side stream, identical logits, and the device memory of the
    offloaded layers shrinks to the staging buffers."""
    dev = accelerator()
    ref, _ = load_model(path, dtype="float32", device=str(dev))
    expected = [t.cpu() for t in decode_logits(ref, PROMPT, 3, device=dev)]
    del ref
    model, _ = load_model(path, dtype="float32", device=str(dev))
    synchronize(dev)
    before = allocated_bytes(dev)
    model.enable_offload([0, 1, 2, 3], buffers=2)
    off = model.offloader
    synchronize(dev)
    layer_bytes = sum(off.layer_nbytes(i) for i in range(4))
    staged = sum(a.numel() for a in off.staging)
    assert before - allocated_bytes(dev) >= layer_bytes - staged - 4 * ALIGN * 64
    assert all(h.is_pinned() for h in off.host.values())
    for _ in range(2):
        got = [t.cpu() for t in decode_logits(model, PROMPT, 3, device=dev)]
        for ours, want in zip(got, expected, strict=True):
            assert torch.equal(ours, want)
    assert off.events.index(("copy_issued", 1)) < off.events.index(("compute_end", 0))
