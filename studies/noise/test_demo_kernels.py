"""studies/noise/demo_kernels.py (issue 31, item 8): the pre-registered claims (the mechanism, the
outcome) and the kernels' own spread, by hand; the committed pre-registration is the script's plan."""

import json
import math

from studies.noise import demo_kernels as dk


def _runs(cap: str, outliers: dict[str, list[float]], aucs: dict[str, list[float]]) -> dict:
    """(cap, arm, seed) -> a run's summary with its outlier-step share and AUC, per arm and seed."""
    return {
        (cap, arm, s): {"auc": aucs[arm][s], "gauges": {dk.OUTLIERS: outliers[arm][s]}}
        for arm in dk.DEMO_ARMS
        for s in range(dk.DEMO_SEEDS)
    }


AUC = {"GRPO": [0.30, 0.25, 0.20], "GRPO+R2": [0.31, 0.24, 0.20], "CHAOS": [0.32, 0.25, 0.19]}


def test_the_mechanism_claim_needs_r2_below_grpo_in_every_seed_by_more_than_a_no_op_moves_it():
    grpo, chaos = [0.60, 0.70, 0.50], [0.65, 0.60, 0.52]  # the no-op moves the share by up to 0.10
    ok = _runs("avx2", {"GRPO": grpo, "GRPO+R2": [0.10, 0.20, 0.05], "CHAOS": chaos}, AUC)
    assert dk.mechanism(ok, "avx2") is True
    one_seed_short = _runs("avx2", {"GRPO": grpo, "GRPO+R2": [0.10, 0.65, 0.05], "CHAOS": chaos}, AUC)
    assert dk.mechanism(one_seed_short, "avx2") is False  # seed 1: 0.05 below, inside the null's 0.10
    above = _runs("avx2", {"GRPO": grpo, "GRPO+R2": [0.9, 0.9, 0.9], "CHAOS": chaos}, AUC)
    assert dk.mechanism(above, "avx2") is False  # the wrong sign never counts
    del ok[("avx2", "CHAOS", 2)]
    assert dk.mechanism(ok, "avx2") is None and dk.mechanism(ok, "default") is None


def test_the_outcome_claim_reads_r2s_mean_against_the_largest_no_op_difference_or_the_kernel_spread():
    share = {arm: [0.5, 0.5, 0.5] for arm in dk.DEMO_ARMS}
    aucs = {"GRPO": [0.30, 0.25, 0.20], "CHAOS": [0.31, 0.27, 0.20]}  # the null moves AUC by up to 0.02
    inside = _runs("avx2", share, {**aucs, "GRPO+R2": [0.32, 0.26, 0.20]})  # mean +0.01
    assert dk.within_noise(inside, "avx2", 0.0) is True
    outside = _runs("avx2", share, {**aucs, "GRPO+R2": [0.26, 0.21, 0.16]})  # mean -0.04, either sign
    assert dk.within_noise(outside, "avx2", 0.0) is False
    assert dk.within_noise(outside, "avx2", 0.05) is True  # inside the kernels' own spread
    assert dk.within_noise(outside, "avx2", math.nan) is False
    assert dk.within_noise(outside, "default", 0.1) is None


def test_the_kernel_spread_is_the_range_of_one_run_across_kernel_sets():
    runs = {}
    for seed, aucs in enumerate([(0.80, 0.82, 0.81), (0.70, 0.70, 0.76), (0.9, 0.9, 0.9)]):
        for cap, a in zip(dk.CAPS, aucs):
            for arm in dk.DEMO_ARMS:
                runs[(cap, arm, seed)] = {"auc": a}
    got = dk.kernel_spread(runs, list(dk.CAPS))
    assert math.isclose(got["GRPO"]["mean_range"], (0.02 + 0.06 + 0.0) / 3) and got["GRPO"]["n"] == 3
    del runs[("avx2", "GRPO", 0)]  # a seed missing under one kernel set is left out
    assert dk.kernel_spread(runs, list(dk.CAPS))["GRPO"]["n"] == 2


def test_the_committed_preregistration_is_the_plan():
    assert json.loads(dk.PLAN_FILE.read_text())["plan"] == dk.PLAN


def test_run_caps_refuses_a_kernel_set_torch_does_not_run_and_records_only_whole_runs(monkeypatch, tmp_path):
    import pytest

    monkeypatch.setattr(dk, "capability", lambda cap: {"avx512": "AVX2"}.get(cap, cap.upper()))
    walls = tmp_path / "walls.json"
    with pytest.raises(SystemExit, match="avx512"):  # this machine would run AVX2 twice
        dk.run_caps(["avx512"], walls, lambda cap: 0)
    with pytest.raises(SystemExit, match="rerun"):
        dk.run_caps(["default"], walls, lambda cap: 143)  # stopped: no wall recorded
    assert not walls.exists()
    got = dk.run_caps(["default", "avx2"], walls, lambda cap: 0)
    assert got.keys() == {"default", "avx2"} and json.loads(walls.read_text()) == got
    assert dk.run_caps(["avx2"], walls, lambda cap: 0)["avx2"] == got["avx2"]  # kept, not remeasured
