"""The MTP draft tuner (shared.engine.draft_tuner): each batch-size bucket settles on the draft count its steps
measured fastest (none where drafts lose), keeps trying the others now and then, stays under the cap (wired into
the engine: tests/test_speculative.py)."""

from __future__ import annotations

import pytest

from shared.engine.draft_tuner import EXPLORE_EVERY, HOLD, MIN_SAMPLES, TIE, DraftTuner

DRAFTED, ACCEPTED = [1000, 900, 800], [900, 720, 560]  # acceptance 0.9, 0.8, 0.7 per position


def _feed(tuner: DraftTuner, decoding: int, cost_of) -> list[int]:
    """Steps driven by the tuner's own choices, each costing `cost_of(d)` seconds per request."""
    chosen = []
    for _ in range(64 * EXPLORE_EVERY):
        d = tuner.choose(decoding, tuner.k, DRAFTED, ACCEPTED)
        chosen.append(d)
        tuner.observe(decoding, d, decoding * cost_of(d))
    return chosen


def test_each_bucket_settles_on_its_fastest_count_and_explores():
    tuner = DraftTuner(3)
    assert tuner.tokens_per_request(DRAFTED, ACCEPTED) == pytest.approx([1, 1.9, 2.7, 3.4])
    small = _feed(tuner, 1, lambda d: 1 + 0.2 * d)  # batch 1: every draft pays (3.4 tokens for 1.6x the time)
    large = _feed(tuner, 40, lambda d: 1 + 0.95 * d)  # batch 40: every draft costs more than it brings
    assert tuner.best(1, DRAFTED, ACCEPTED) == 3 and tuner.best(40, DRAFTED, ACCEPTED) == 0
    assert tuner.best(33, DRAFTED, ACCEPTED) == 0  # 32..63: one bucket
    for chosen, best in ((small, 3), (large, 0)):
        settled = chosen[MIN_SAMPLES * 4:]
        tries = [d for d in settled if d != best]
        assert set(tries) == {0, 1, 2, 3} - {best}  # round robin over the others, HOLD steps each
        assert len(tries) < 0.02 * len(settled)  # rarer as each try confirms the best
        assert settled[:EXPLORE_EVERY + HOLD].count(best) < EXPLORE_EVERY + HOLD  # but tries at first


def test_unmeasured_positions_are_taken_to_accept_like_the_one_before():
    tuner = DraftTuner(3)
    assert tuner.tokens_per_request([0, 0, 0], [0, 0, 0]) == [1, 2, 3, 4]  # nothing drafted: sure ones, tried
    assert tuner.tokens_per_request([100, 5, 0], [50, 5, 0]) == [1, 1.5, 2.0, 2.5]


def test_the_cap_bounds_every_choice_and_bad_samples_are_ignored():
    tuner = DraftTuner(3)
    assert tuner.choose(8, 0, DRAFTED, ACCEPTED) == 0
    assert all(tuner.choose(8, 1, DRAFTED, ACCEPTED) <= 1 for _ in range(3 * EXPLORE_EVERY))
    tuner.observe(8, 3, 0.0)  # no time, a count past K, a switch's first step: not samples
    tuner.observe(8, 7, 1.0)
    tuner.observe(8, 3, 1.0, steady=False)
    assert tuner.buckets[(8).bit_length()].samples[3] == 0


def test_a_tie_takes_the_fewest_drafts():
    """Counts within TIE of the fastest are as fast: the fewest drafts among them (switches cost)."""
    tuner = DraftTuner(1)
    gain = tuner.tokens_per_request([1000], [700])  # 1.7 tokens a step with one draft
    for d, cost in ((0, 1.0), (1, 1.7 / (1 + TIE / 2))):  # the draft's tokens a second: TIE / 2 more
        for _ in range(MIN_SAMPLES):
            tuner.observe(1, d, cost)
    assert gain[1] / tuner.buckets[1].costs[1] > 1 and tuner.best(1, [1000], [700]) == 0
    tuner.observe(1, 1, 1.7 / (1 + 3 * TIE))  # now clearly faster (the average follows)
    assert tuner.best(1, [1000], [700]) == 1


def test_a_counts_old_average_gives_way_to_a_new_tries_samples():
    """The machine's load drifts between tries: a count sampled again after a gap starts its average anew, so a
    try is compared with the best's current cost, not with the count's cost from another time."""
    tuner = DraftTuner(1)
    for _ in range(8):
        tuner.observe(1, 0, 1.0)
    bucket = tuner.buckets[1]
    assert bucket.costs[0] == pytest.approx(1.0)
    for _ in range(HOLD + 2):  # steps go by at another count
        tuner.choose(1, 1, DRAFTED[:1], ACCEPTED[:1])
    tuner.observe(1, 0, 2.0)
    assert bucket.costs[0] == pytest.approx(2.0)  # not 0.8 · 1.0 + 0.2 · 2.0
    tuner.observe(1, 0, 3.0)
    assert bucket.costs[0] == pytest.approx(2.5)  # then a running mean of the fresh samples
