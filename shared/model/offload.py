"""Weight offload (`--offload-layers`): chosen decoder layers keep their weights in host memory.

Each offloaded layer's tensors (parameters, buffers, plain tensor attributes such as MLA's absorbed
`w_uk` / `w_uv_t`) are packed into one host byte buffer (page-locked on accelerators), each tensor at a
256-byte aligned offset. The device holds only `buffers` staging arenas, each the size of the largest
offloaded layer, so dense and MoE layers share them. Before a layer runs, its host buffer is copied
into a free arena as one transfer, on a side stream (accelerators) or a worker thread (CPU), and its
tensors are pointed at views of that arena; the copy of the next offloaded layer is issued before the
current one computes, so the transfer hides behind compute. After the layer, its tensors point back
at the host copy (any stray use outside the loop sees correct values) and the arena is free again;
on accelerators the copy stream waits for an event recorded after that layer's kernels before it
overwrites the arena. After the last offloaded layer, the first one's copy is issued for the next
step. `events` records the order, for tests and tracing.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shared.device import copy_stream, current_stream, host_buffer, new_event, on_stream

FLAG = "--offload-layers"
ALIGN = 256  # bytes: each staged tensor starts where a fresh allocation would (same kernels, same results)

# one tensor of a layer's layout: byte offset, shape, dtype
Layout = tuple[tuple[int, torch.Size, torch.dtype], ...]


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """`--offload-layers` value → sorted layer indices: "3,5,7", "2-10" (inclusive), mixes of both,
    "all", or "" (none)."""
    spec = spec.strip()
    if not spec:
        return []
    if spec.lower() == "all":
        return list(range(num_layers))
    layers: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{FLAG}: {part.strip()!r} is not a layer index or range A-B "
                             f"(use e.g. '3,5,7', '2-10', 'all')") from None
        if first > last:
            raise ValueError(f"{FLAG}: range {first}-{last} is empty")
        if first < 0 or last >= num_layers:
            raise ValueError(f"{FLAG}: layer {first if first < 0 else last} is outside 0-{num_layers - 1} "
                             f"(the model has {num_layers} layers)")
        layers.update(range(first, last + 1))
    return sorted(layers)


@dataclass
class _Slot:
    """One tensor of a layer and where it is referenced. A parameter is replaced once, at packing, by
    a normal (non-inference) Parameter over its host copy, whose `.data` later binds swap: the same
    object stays registered, and `.data` never crosses inference-ness (that corrupts the tensor). A
    buffer or plain attribute is re-assigned on every owner."""

    param: nn.Parameter | None
    owners: list[tuple[nn.Module, str]]

    def bind(self, tensor: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = tensor
        else:
            for module, name in self.owners:
                setattr(module, name, tensor)

    def adopt(self, host: torch.Tensor) -> None:
        """Point every owner at `host`, through a new Parameter for a parameter (outside inference mode)."""
        if self.param is not None:
            self.param = nn.Parameter(host, requires_grad=False)
        for module, name in self.owners:
            setattr(module, name, self.param if self.param is not None else host)


def _layer_tensors(layer: nn.Module) -> tuple[list[_Slot], list[torch.Tensor]]:
    """Every non-empty tensor of `layer`, once each (shared ones keep all their owners)."""
    slots: dict[int, _Slot] = {}
    tensors: dict[int, torch.Tensor] = {}
    for module in layer.modules():
        named = [(n, t, True) for n, t in module._parameters.items()]
        named += [(n, t, False) for n, t in module._buffers.items()]
        named += [(n, t, False) for n, t in vars(module).items() if isinstance(t, torch.Tensor)]
        for name, t, is_param in named:
            if t is None or t.numel() == 0:  # e.g. kv_b_proj's weight after absorb()
                continue
            key = id(t)
            if key not in slots:
                slots[key] = _Slot(t if is_param else None, [])
                tensors[key] = t
            slots[key].owners.append((module, name))
    return list(slots.values()), list(tensors.values())


def _views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Typed, shaped views of a byte buffer, one per layout entry."""
    out = []
    for offset, shape, dtype in layout:
        nbytes = shape.numel() * dtype.itemsize
        out.append(flat[offset:offset + nbytes].view(dtype).view(shape))
    return out


class LayerOffloader:
    """Streams offloaded layers' weights through `buffers` device staging arenas. The forward loop
    calls `begin()` once per step, then `acquire(i)` before and `release(i)` after each offloaded layer."""

    def __init__(self, layers: nn.ModuleList, offload: list[int], device: torch.device, buffers: int = 2):
        if buffers < 1:
            raise ValueError(f"{FLAG}: need at least one staging buffer, got {buffers}")
        order = sorted(set(offload))
        if order and (order[0] < 0 or order[-1] >= len(layers)):
            raise ValueError(f"{FLAG}: layers {order} outside 0-{len(layers) - 1}")
        self.device, self.buffers = device, buffers
        self.offloaded = frozenset(order)
        # deque.append is atomic (thread-safe), so the CPU copy thread logs into it directly; bounded
        self.events: deque[tuple[str, int]] = deque(maxlen=1024)
        self._next = {i: order[(k + 1) % len(order)] for k, i in enumerate(order)}
        self._first = order[0] if order else None
        self._slots: dict[int, list[_Slot]] = {}
        self._layout: dict[int, Layout] = {}
        self.host: dict[int, torch.Tensor] = {}  # layer → its packed host bytes
        self._host_views: dict[int, list[torch.Tensor]] = {}
        with torch.inference_mode(False), torch.no_grad():  # normal tensors, bindable outside inference too
            for i in order:
                self._pack(i, layers[i])
            size = max((h.numel() for h in self.host.values()), default=0)
            self.staging = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(buffers)]
            self._staged_views = {(b, lay): _views(self.staging[b], lay)
                                  for b in range(buffers) for lay in set(self._layout.values())}
        self._free: deque[int] = deque(range(buffers))
        self._arena_of: dict[int, int] = {}  # layer → arena, from prefetch until release
        self._ready: dict[int, Any] = {}  # layer → Future (CPU) or event (accelerator) of its copy
        self._held: set[int] = set()
        self._deferred: int | None = None  # a prefetch that found no free arena; issued on the next release
        self._stream = copy_stream(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-offload") if self._stream is None else None
        self._copied = [new_event(device) for _ in range(buffers)] if self._stream is not None else []
        self._freed = [new_event(device) for _ in range(buffers)] if self._stream is not None else []

    def _pack(self, i: int, layer: nn.Module) -> None:
        """Copy layer i's tensors into one host buffer and point the layer at it (its device copies go)."""
        slots, tensors = _layer_tensors(layer)
        layout, offset = [], 0
        for t in tensors:
            layout.append((offset, t.shape, t.dtype))
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self._layout[i], self._slots[i] = tuple(layout), slots
        self.host[i] = host_buffer(offset, self.device)
        self._host_views[i] = _views(self.host[i], self._layout[i])
        for slot, src, dst in zip(slots, tensors, self._host_views[i]):
            dst.copy_(src)
            slot.adopt(dst)

    def layer_nbytes(self, i: int) -> int:
        """Bytes layer i takes in a staging arena (its tensors, each padded to ALIGN)."""
        return self.host[i].numel()

    def _bind(self, i: int, views: list[torch.Tensor]) -> None:
        for slot, view in zip(self._slots[i], views):
            slot.bind(view)

    def _copy(self, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """CPU worker: one memcpy (torch releases the GIL, so the compute thread runs on)."""
        dst.copy_(src)
        self.events.append(("copy_done", i))

    def begin(self) -> None:
        """Start of a step: free arenas a failed step left held, and make sure the first offloaded
        layer's copy is in flight (usually issued at the end of the last step)."""
        for i in sorted(self._held):
            self.release(i)
        if self._first is not None:
            self.prefetch(self._first)

    def prefetch(self, i: int) -> None:
        """Issue the async host→device copy of layer i into a free arena; returns at once. Without a
        free arena it is deferred to the next release()."""
        if i not in self.offloaded or i in self._arena_of:
            return
        if not self._free:
            self._deferred = i
            return
        arena = self._free.popleft()
        self._arena_of[i] = arena
        src = self.host[i]
        dst = self.staging[arena][: src.numel()]
        self.events.append(("copy_issued", i))
        if self._stream is None:
            self._ready[i] = self._pool.submit(self._copy, i, dst, src)
            return
        with on_stream(self._stream):
            self._stream.wait_event(self._freed[arena])  # the last layer staged here finished computing
            dst.copy_(src, non_blocking=True)
            self._copied[arena].record(self._stream)
        self._ready[i] = self._copied[arena]

    def acquire(self, i: int) -> None:
        """Before layer i computes: wait for its copy, point its tensors at the arena, and issue the
        next offloaded layer's copy so it flies while layer i computes."""
        if i not in self.offloaded:
            return
        self.prefetch(i)
        if i not in self._arena_of:
            raise RuntimeError(f"offload: no free staging buffer for layer {i} ({self.buffers} held; "
                               "release() each layer after it computes)")
        ready = self._ready.pop(i)
        if isinstance(ready, Future):
            ready.result()
        else:  # the compute stream waits on the device; the host runs on
            current_stream(self.device).wait_event(ready)
            self.events.append(("copy_done", i))
        self._bind(i, self._staged_views[(self._arena_of[i], self._layout[i])])
        self._held.add(i)
        self.prefetch(self._next[i])

    def release(self, i: int) -> None:
        """After layer i's compute is queued: its arena may be reused (on accelerators only once
        that compute has run), and its tensors point back at the host copy."""
        if i not in self._held:
            return
        self._held.discard(i)
        arena = self._arena_of.pop(i)
        if self._stream is not None:
            self._freed[arena].record(current_stream(self.device))
        self._bind(i, self._host_views[i])
        self._free.append(arena)
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self.prefetch(deferred)

    def close(self) -> None:
        """Wait for copies in flight and stop the CPU copy thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
