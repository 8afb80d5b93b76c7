"""The MTP draft tuner (shared.engine.draft_tuner): each batch-size bucket settles on the draft count its steps
measured fastest (none where drafts lose), keeps trying the others now and then, stays under the cap (wired into
the engine: tests/test_speculative.py)."""

from __future__ import annotations

import pytest

from shared.engine.draft_tuner import EXPLORE_EVERY, HOLD, MIN_SAMPLES, DraftTuner

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
