"""The fixed collapse criterion (``moe_rl.lab.collapse``): what collapses, what recovers, what
cannot collapse."""

import random

import pytest

from moe_rl.lab.collapse import CRITERION, collapse_verdict, held_out_drop, smoothed


def _noise(n, scale, seed=0):
    rng = random.Random(seed)
    return [rng.uniform(-scale, scale) for _ in range(n)]


def test_collapse_rises_then_falls_and_stays_down():
    up = [0.1 + 0.02 * t for t in range(15)]  # 0.10 -> 0.38
    down = [max(0.02, 0.38 - 0.06 * t) for t in range(1, 8)]
    curve = up + down + [0.02] * 30
    v = collapse_verdict(curve)
    assert v.state == "collapsed" and v.collapsed
    assert 15 <= v.step <= 25, v  # the fall, not the end of the run
    assert v.best == pytest.approx(max(smoothed(curve, CRITERION.smooth)))


def test_a_dip_that_recovers_within_the_window_is_fine():
    curve = [0.3] * 20 + [0.05] * 5 + [0.3] * 30
    v = collapse_verdict(curve)
    assert v.state == "fine" and not v.collapsed
    # the same dip held for longer than the window collapses
    assert collapse_verdict(
        [0.3] * 20 + [0.05] * (CRITERION.window + CRITERION.smooth) + [0.3] * 30
    ).collapsed


def test_a_run_that_was_never_good_cannot_collapse():
    curve = [0.04, 0.0, 0.02, 0.0, 0.03] * 10
    v = collapse_verdict(curve)
    assert v.state == "never_good" and not v.collapsed
    assert collapse_verdict([]).state == "never_good"


def test_noisy_but_fine_and_one_lucky_first_batch():
    curve = [0.15 + e for e in _noise(80, 0.08)]
    assert collapse_verdict(curve).state == "fine"
    # a lucky first batch (3 sigma of a 64-sample mean) is averaged into the first full window
    assert collapse_verdict([0.3] + [0.15 + e for e in _noise(40, 0.05, 1)]).state == "fine"


def test_a_fall_at_the_very_end_is_unresolved_and_nan_counts_as_zero():
    v = collapse_verdict([0.3] * 30 + [0.0] * 8)
    assert v.state == "unresolved" and not v.collapsed
    assert collapse_verdict([0.3] * 20 + [float("nan")] * 20).collapsed
    assert smoothed([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]


def test_held_out_drop():
    assert held_out_drop([0.2, 0.15, 0.05])
    assert not held_out_drop([0.2, 0.15])
    assert not held_out_drop([0.02, 0.0])  # nothing to drop from
