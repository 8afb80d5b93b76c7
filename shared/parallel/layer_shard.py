"""Layer sharding: layer i's o_proj / q_b_proj weight lives only on rank i % K.

The other ranks keep one shared empty dummy in its place. Before layer i computes, its weight is
taken from a staging buffer filled by an async broadcast from the owner; the broadcast for layer
i+1 is issued before layer i computes and waited on just before layer i+1 uses it (two staging
buffers per linear alternate). `events` records the order, for tests and tracing.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn


class LayerSharder:
    def __init__(self, layers: nn.ModuleList, names: tuple[str, ...], rank: int, world: int, group=None):
        self.layers, self.names, self.rank, self.k, self.group = layers, names, rank, world, group
        self.events: deque[tuple[str, int]] = deque(maxlen=1024)  # the recent order only: bounded
        self._pending: dict[int, tuple[list, dict[str, torch.Tensor]]] = {}
        self.owned: dict[tuple[int, str], torch.Tensor] = {}
        self.staging: dict[str, list[torch.Tensor]] = {}
        self.dummy: dict[str, nn.Parameter] = {}
        for name in names:
            ref = self._module(0, name).weight
            self.staging[name] = [torch.empty_like(ref), torch.empty_like(ref)]
            self.dummy[name] = nn.Parameter(ref.new_empty(0), requires_grad=False)  # one, shared by all layers
            for i in range(len(layers)):
                module = self._module(i, name)
                if self.owner(i) == rank:
                    self.owned[(i, name)] = module.weight.data
                else:
                    module.weight = self.dummy[name]

    def owner(self, layer: int) -> int:
        return layer % self.k

    def _module(self, layer: int, name: str) -> nn.Module:
        return getattr(self.layers[layer].self_attn, name)

    def prefetch(self, layer: int) -> None:
        """Issue the async broadcasts of `layer`'s weights from their owner."""
        if layer >= len(self.layers) or layer in self._pending:
            return
        works, bufs = [], {}
        for name in self.names:
            buf = self.owned.get((layer, name), self.staging[name][layer % 2])
            src = dist.get_global_rank(self.group, self.owner(layer)) if self.group is not None else self.owner(layer)
            works.append(dist.broadcast(buf, src=src, group=self.group, async_op=True))
            bufs[name] = buf
        self._pending[layer] = (works, bufs)
        self.events.append(("broadcast_issued", layer))

    def acquire(self, layer: int) -> None:
        """Wait for `layer`'s weights and point its linears at them."""
        self.prefetch(layer)
        works, bufs = self._pending.pop(layer)
        for work in works:
            work.wait()
        self.events.append(("broadcast_waited", layer))
        for name, buf in bufs.items():
            self._module(layer, name).weight = nn.Parameter(buf, requires_grad=False)

    def release(self, layer: int) -> None:
        """After layer `layer` computed: a non-owner drops the staged weight for the shared dummy."""
        for name in self.names:
            owned = self.owned.get((layer, name))
            weight = self.dummy[name] if owned is None else nn.Parameter(owned, requires_grad=False)
            self._module(layer, name).weight = weight
