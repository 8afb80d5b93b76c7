"""An endpoint picker's (prefill, decode) pair for one request, carried to the router in HTTP headers: the
Gateway API Inference Extension's EPP (router.epp) places the request with the router's own policy and KV index,
names the pair in these headers, and the router that serves the request puts that pair first where its policy
admits it (a hint only: a stale or hostile one changes nothing but the order of admitted pairs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared import metrics

PREFILL_HEADER = "x-pdserve-prefill"  # the prefill instance's address ("local": the decode instance prefills)
DECODE_HEADER = "x-pdserve-decode"
LOCAL = "local"


@dataclass(frozen=True)
class PairHint:
    prefill: str
    decode: str

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> PairHint | None:
        prefill, decode = headers.get(PREFILL_HEADER), headers.get(DECODE_HEADER)
        return cls(prefill, decode) if prefill and decode else None

    def headers(self) -> dict[str, str]:
        return {PREFILL_HEADER: self.prefill, DECODE_HEADER: self.decode}

    def first(self, pairs: list, prefills: list, decodes: list) -> list:
        """`pairs` (router.policy.Choice, indices into the instances `prefills` and `decodes`) with the hinted
        pair first when it is among them; unchanged otherwise. Counted either way."""
        for i, c in enumerate(pairs):
            prefill = LOCAL if c.local else prefills[c.prefill].address
            if prefill == self.prefill and decodes[c.decode].address == self.decode:
                metrics.EPP_HINTS.labels("followed").inc()
                return [c, *pairs[:i], *pairs[i + 1:]]
        metrics.EPP_HINTS.labels("not_admitted").inc()
        return pairs
