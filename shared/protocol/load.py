"""The one shape of a load report, from an engine rank to its front and the router: each rank's numbers and
the instance's (their totals and its KV block size; what its prefix cache holds streams apart: KvEvents).
shared.rpc.convert carries it over gRPC (GetLoad), less the second KV tier's totals: those are the front's
/metrics counters (shared.metrics.LoadCollector), which the router has no use for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLoad:
    """One engine rank after a turn (a DP rank of a decode instance, a CP rank or the one rank of a prefill)."""

    rank: int
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    active_leases: int = 0  # decode: reservations the prefill pushes into
    tokens: int = 0  # decode: context tokens held by running requests and reservations
    admitted: int = 0  # decode: requests admitted since start
    queued_prompt_tokens: int = 0  # prompt tokens waiting or not yet computed on this rank
    # the rank's second KV tier since its engine started (shared.kvcache.tier.TierStats; 0 without one): carried
    # every turn so the front, not the engine's process, exports them (integers: a decode row is all-gathered)
    tier_written_bytes: int = 0
    tier_read_bytes: int = 0
    tier_dropped_corrupt: int = 0  # blocks whose record failed its checks
    tier_dropped_full: int = 0  # blocks evicted for room
    # the rank's steps since start by how they ran (shared.engine.graphs; 0 without graphs): exported by the front
    graph_replayed: int = 0  # plain decode steps replayed from a recorded one
    graph_recorded: int = 0  # plain decode steps run eagerly while recorded (one per new batch size and context)
    graph_eager: int = 0  # other steps (prompt chunks, MTP, a context or batch no recording takes)


@dataclass(frozen=True)
class LoadReport:
    """An instance's load: its ranks, and what the router needs to read them."""

    ranks: tuple[RankLoad, ...]
    block_size: int = 0  # KV block size in tokens (free_blocks × block_size = room); 0: not said

    def total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.ranks)

    @property
    def running(self) -> int:
        return self.total("running")

    @property
    def waiting(self) -> int:
        return self.total("waiting")

    @property
    def free_blocks(self) -> int:
        return self.total("free_blocks")

    @property
    def total_blocks(self) -> int:
        return self.total("total_blocks")

    @property
    def active_leases(self) -> int:
        return self.total("active_leases")

    @property
    def queued_prompt_tokens(self) -> int:
        return self.total("queued_prompt_tokens")


__all__ = ["LoadReport", "RankLoad"]
