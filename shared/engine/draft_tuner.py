"""How many MTP drafts a step makes, chosen from what steps cost on this machine: speculation never costs.

A draft pays when the tokens it adds per step outweigh what it costs: a verification row in the target's
forward and an MTP forward per draft position. Both depend on the machine, the model, the batch and the
acceptance, none of which a fixed K knows (at batch 1 a step is host overhead and drafts are nearly free; at
batch 64 every row costs arithmetic). So the tuner measures the cost, and the engine's counters give the
gain: per batch-size bucket (a power of two of the requests decoding) and per draft count d in 0..K, an
exponential average of a step's seconds per request with d drafts each (drafting plus verifying); with the
acceptance per draft position a_i (accepted / drafted over every step so far: many samples, so steady),
a step with d drafts yields 1 + a_0 + ... + a_{d-1} tokens per request, and each step uses the d with the
most tokens per second. A position not yet drafted enough is taken to accept like the one before it (the
first like a sure one), so it is tried. A d without `MIN_SAMPLES` cost samples is tried first; then now and
then a bucket tries another d for `HOLD` steps (round robin), first every `EXPLORE_EVERY` steps, less often
each time a try confirms the best (a try costs: its drafts run on an MTP cache with gaps); a try's samples
replace the tried count's old average (the machine's load drifts between tries), so a bucket
follows the machine as load changes; d = 0 (a plain step) is always one of the choices, so a bucket where
drafts lose settles on none, and one where they only tie (within `TIE`) on the fewest.

Measured span (shared.engine.speculative.MtpSpeculator): from the start of the step's catch-up that drafted
d tokens per request to the end of that catch-up, plus the next step's forward and verification (take_drafts
to its catch-up): exactly the work of d drafts, no idle time between steps. Drafts never change a greedy
output (verification decides), only how fast it comes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps of a bucket between tries of another draft count, at first ...
EXPLORE_EVERY_MOST = 512  # ... doubling each time a try leaves the best count where it was, up to this
HOLD = 3  # steps a try lasts: a switch's first step is not a sample (the MTP layer catches up on positions
# a plain step skipped, and its drafts were made under the previous count), the next ones are
MIN_SAMPLES = 2  # cost samples a draft count needs before its average is trusted
MIN_DRAFTED = 32  # drafts at a position before its measured acceptance is used
SMOOTHING = 0.2  # weight of a new sample in the average
TIE = 0.05  # counts within this share of the fastest are as fast: the fewest drafts among them is taken


@dataclass
class _Bucket:
    costs: list[float]  # average seconds per request of a step, per draft count
    samples: list[int]
    fresh: list[int]  # samples since the count's average restarted (its last sample came steps before)
    last: list[int]  # the bucket's step count at each count's last sample
    steps: int = 0
    explore_every: int = EXPLORE_EVERY
    next_try: int = 0  # round robin over the other draft counts
    trying: int | None = None  # the count being tried, and for how many more steps
    hold: int = 0
    best_before: int = 0  # the best count when the try began


@dataclass
class DraftTuner:
    """Drafts per request per step, by batch-size bucket (module doc)."""

    k: int  # the most drafts a request makes (--num-speculative-tokens)
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def _bucket(self, decoding: int) -> _Bucket:
        key = max(1, decoding).bit_length()
        if key not in self.buckets:
            self.buckets[key] = _Bucket(*([0.0] * (self.k + 1), [0] * (self.k + 1), [0] * (self.k + 1),
                                          [0] * (self.k + 1)))
        return self.buckets[key]

    def tokens_per_request(self, drafted: list[int], accepted: list[int]) -> list[float]:
        """A step's expected tokens per request for each draft count (the counters per draft position)."""
        out, total, rate = [1.0], 1.0, 1.0
        for i in range(self.k):
            if i < len(drafted) and drafted[i] >= MIN_DRAFTED:
                rate = accepted[i] / drafted[i]
            total += rate
            out.append(total)
        return out

    def choose(self, decoding: int, most: int, drafted: list[int], accepted: list[int]) -> int:
        """Drafts per request for a step with `decoding` requests, at most `most` (the cap), given the drafted
        and accepted counts per draft position so far."""
        if most <= 0:
            return 0
        b = self._bucket(decoding)
        b.steps += 1
        choices = list(range(min(most, self.k), -1, -1))
        untried = [d for d in choices if b.samples[d] < MIN_SAMPLES]
        if untried:
            return untried[0]
        best = _fastest(choices, self.tokens_per_request(drafted, accepted), b.costs)
        if b.trying is not None and b.trying in choices and b.hold > 0:
            b.hold -= 1
            return b.trying
        if b.trying is not None:  # a try just ended: back off while it confirms the best count
            b.explore_every = (min(2 * b.explore_every, EXPLORE_EVERY_MOST) if best == b.best_before
                               else EXPLORE_EVERY)
            b.trying = None
        if b.steps % b.explore_every == 0 and len(choices) > 1:
            others = [d for d in choices if d != best]
            b.next_try = (b.next_try + 1) % len(others)
            b.trying, b.hold, b.best_before = others[b.next_try], HOLD - 1, best
            return b.trying
        return best

    def observe(self, decoding: int, drafts: int, seconds: float, steady: bool = True) -> None:
        """A step with `drafts` per request over `decoding` requests took `seconds` (drafting and verifying);
        `steady`: the step before it drafted as many (a switch's first step is not a sample)."""
        if not steady or seconds <= 0 or decoding <= 0 or drafts > self.k:
            return
        b = self._bucket(decoding)
        if b.steps - b.last[drafts] > HOLD + 1:  # its average is from another time (the machine's load drifts):
            b.fresh[drafts] = 0  # start it again from this try's samples, compared with the best's current ones
        b.fresh[drafts] += 1
        weight = max(SMOOTHING, 1 / b.fresh[drafts])  # a running mean of the fresh samples, then an average
        b.costs[drafts] = (1 - weight) * b.costs[drafts] + weight * seconds / decoding
        b.samples[drafts] += 1
        b.last[drafts] = b.steps

    def best(self, decoding: int, drafted: list[int], accepted: list[int]) -> int | None:
        """The draft count a bucket settled on (None before every count has its samples): tests, benches."""
        b = self._bucket(decoding)
        if min(b.samples) < MIN_SAMPLES:
            return None
        return _fastest(list(range(self.k + 1)), self.tokens_per_request(drafted, accepted), b.costs)


def _fastest(choices: list[int], gain: list[float], costs: list[float]) -> int:
    """The draft count with the most tokens a second, or the fewest drafts among those within TIE of it: where
    drafts only tie a plain step (a batch where they just pay for themselves), the machine's noise would flip
    the choice back and forth, and every switch costs (the MTP cache has gaps, new shapes get recorded)."""
    rate = {d: gain[d] / costs[d] for d in choices}
    top = max(rate.values())
    return min(d for d in choices if rate[d] * (1 + TIE) >= top)
