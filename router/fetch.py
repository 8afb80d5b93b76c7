"""Cross-instance fetch, the router's choice: when the prefill instance a request goes to lacks a prefix another
prefill instance caches (the router's KV index says so), it is told to pull those blocks from that holder
(PrefillRequest.fetch_from / fetch_blocks; prefill_service.fetch does it) when moving them is predicted cheaper
than computing them: the compute the holder's blocks save (the performance model's prefill curve) against their
transfer (its KV bytes per token over its bandwidth) plus a round trip. Every choice is counted with its reason
(pdserve_router_kv_fetch_decisions_total{decision, reason})."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from router.perf import PerfModel
from router.pools import Instance
from shared import metrics
from shared.rpc.pdserve.v1 import internal_pb2

FETCH_RTT_S = 0.005  # the fetch's own round trips (ask, lease, adopt) beside the bytes


class Reason(enum.Enum):
    CHEAPER = "fetch_cheaper"  # the transfer is predicted shorter than the compute it saves
    COMPUTE_CHEAPER = "compute_cheaper"
    CACHED_HERE = "cached_here"  # no instance caches more of the prompt than the chosen one
    DISABLED = "disabled"  # --no-kv-fetch


@dataclass(frozen=True)
class FetchChoice:
    fetch: bool
    reason: Reason
    holder: str = ""
    blocks: int = 0


class FetchAdvisor:
    def __init__(self, perf: PerfModel, enabled: bool):
        self.perf, self.enabled = perf, enabled

    def choose(self, prompt_tokens: int, chosen: int, prefills: list[Instance], cached: list[int]) -> FetchChoice:
        """Whether prefill instance `chosen` should fetch, and from whom (`cached`: prompt tokens each caches)."""
        if not self.enabled:
            return FetchChoice(False, Reason.DISABLED)
        mine = cached[chosen] if chosen < len(cached) else 0
        holders = [i for i, inst in enumerate(prefills) if i != chosen and inst.view.up and i < len(cached)]
        best = max(holders, key=lambda i: cached[i], default=None)
        bs = prefills[best].view.block_size if best is not None else 0
        if best is None or bs <= 0 or cached[best] < mine + bs:
            return FetchChoice(False, Reason.CACHED_HERE)
        theirs = cached[best]
        saved = self.perf.prefill_seconds(prompt_tokens - mine) - self.perf.prefill_seconds(prompt_tokens - theirs)
        if saved <= self.perf.transfer_seconds(theirs - mine) + FETCH_RTT_S:
            return FetchChoice(False, Reason.COMPUTE_CHEAPER)
        return FetchChoice(True, Reason.CHEAPER, prefills[best].address, -(-theirs // bs))

    def request_for(self, req: internal_pb2.PrefillRequest, inst: Instance, prefills: list[Instance],
                    cached: list[int]) -> internal_pb2.PrefillRequest:
        """`req` as sent to `inst`: with the fetch hint when the choice is to fetch (counted either way)."""
        chosen = next((i for i, p in enumerate(prefills) if p is inst), len(prefills))
        choice = self.choose(len(req.prompt_token_ids), chosen, prefills, cached)
        metrics.KV_FETCH_DECISIONS.labels("fetch" if choice.fetch else "compute", choice.reason.value).inc()
        if not choice.fetch:
            return req
        out = internal_pb2.PrefillRequest()
        out.CopyFrom(req)
        out.fetch_from, out.fetch_blocks = choice.holder, choice.blocks
        return out
