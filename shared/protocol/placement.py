"""Which attention-DP rank of a decode instance a new request joins: one rule, which the router uses
to predict the instance's pace and the decode coordinator uses to place the reservation."""

from __future__ import annotations

from collections.abc import Sequence


def least_loaded_rank(tokens: Sequence[int], running: Sequence[int]) -> int:
    """The rank with the fewest context tokens (running contexts and leases), then the fewest running
    requests, then the lowest index (ties land deterministically)."""
    return min(range(len(tokens)), key=lambda r: (tokens[r], running[r], r))
