"""Design (e)'s analysis by hand: the exact sign-flip p for any n, the gate, the SE rule, the success
rule, the decisions the driver takes once, and the run-level prediction."""

from __future__ import annotations

import json
import math
import random

import pytest

from moe_rl.lab.stats import sign_flip_p
from studies.one_update import analysis as a
from studies.one_update import driver


def test_the_sign_flip_bounds_hold_the_enumerated_p_and_are_tight_for_many_states():
    rng = random.Random(3)
    for n in (3, 8, 12):
        for shift in (0.0, 0.5, 1.0):
            d = [rng.gauss(shift, 1) for _ in range(n)]
            lo, hi = a.sign_flip_bounds(d)
            assert lo - 1e-12 <= sign_flip_p(d) <= hi + 1e-12, (n, shift)
    d = [rng.gauss(0.4, 1) for _ in range(60)]
    lo, hi = a.sign_flip_bounds(d)
    assert 0 < lo <= hi and hi - lo < 1e-3
    got = a.paired_exact(d)
    assert got["p"] == hi and got["p_bounds"] == [lo, hi]
    assert a.sign_flip_bounds([1.0] * 30)[1] == pytest.approx(2 / 2**30)  # all positive: 2 patterns of 2^30
    assert a.sign_flip_bounds([0.0, 0.0]) == (1.0, 1.0)


def test_paired_exact_keeps_the_enumeration_up_to_twenty():
    d = [0.3, -0.1, 0.5, 0.2, 0.4]
    got = a.paired_exact(d)
    assert got["p"] == sign_flip_p(d) == got["p_bounds"][0] and got["positive"] == 4


def test_the_permutation_p_of_a_clear_and_of_no_difference():
    assert a.permutation_p([1.0] * 10, [0.0] * 10, n=2000) < 0.01
    assert a.permutation_p([0.0, 1.0] * 5, [1.0, 0.0] * 5, n=2000) > 0.5


def record(seed, step, arms: dict, m=16) -> dict:
    """A scored state: ``arms`` maps arm name to (dJ, kl, drift_slot, token_share)."""
    out = {"state": {"set": "moe", "seed": seed, "step": step}, "arms": {}}
    for name, (dj, kl, drift, share) in arms.items():
        out["arms"][f"{name}@M{m}"] = {
            "V1": {"dJ": dj, "kl": kl, "dJ_clip": dj},
            "drift_slot": drift,
            "token_out_final": share * 5,
            "train": {"ratio/token_frac_outside_0.5_2": share},
        }
    return out


def states(r2_gain, null_mean=0.0, n=12, drift=0.05, share=0.006):
    rng, out = random.Random(0), []
    for i in range(n):
        g = rng.gauss(0, 0.01)
        arms = {
            "GRPO": (g, 0.5, drift, share),
            "GRPO+R2": (g + r2_gain + rng.gauss(0, 0.001), 0.5, 0.0, share),
            "NULL-order": (g + null_mean + rng.gauss(0, 0.001), 0.5, drift, share),
            "NULL-jitter": (g, 0.5, drift, share),
        }
        out.append(record(500 + i % 3, 5 * (i + 1), arms))
    return out


def test_the_gate_reads_grpos_drift_and_the_trainers_token_share():
    gate = {"min_drift_slot": 0.04, "min_token_share": 0.005}
    assert a.gate_reading(states(0.01), 16, gate)["passed"]
    low_share = a.gate_reading(states(0.01, share=0.004), 16, gate)
    assert not low_share["passed"] and low_share["token_share_final"] == pytest.approx(0.02)
    assert not a.gate_reading(states(0.01, drift=0.03), 16, gate)["passed"]


def test_the_success_rule_needs_p_below_001_every_run_positive_and_small_nulls():
    assert a.success(states(0.01), 16)["met"]
    assert not a.success(states(-0.01), 16)["met"]
    assert not a.success(states(0.01, null_mean=0.006), 16)["met"]  # a null above a third of R2's gain
    few = a.success(states(0.01, n=6), 16)
    assert few["Delta_R2"]["p"] > 0.01 and not few["met"]  # 6 states cannot reach p < 0.01 (2/64)
    mixed = states(0.01)
    for r in mixed:
        if r["state"]["seed"] == 501:  # one run's block negative
            r["arms"]["GRPO+R2@M16"]["V1"]["dJ"] -= 0.03
    got = a.success(mixed, 16)
    assert got["blocks"][501] < 0 and not got["met"]


def test_the_se_rule_doubles_v_above_its_threshold():
    rule = {"max_se": 0.002}
    assert not a.se_reading(states(0.01), 16, rule)["double"]  # sd 0.001 / sqrt(12)
    noisy = states(0.01)
    for i, r in enumerate(noisy):
        r["arms"]["GRPO+R2@M16"]["V1"]["dJ"] += 0.02 * (-1) ** i
    reading = a.se_reading(noisy, 16, rule)
    assert reading["double"] and reading["se"] == pytest.approx(0.0201 / math.sqrt(12), rel=0.05)


def test_the_run_level_prediction_by_hand():
    got = a.run_level({"mean": 0.001, "ci95": [-0.001, 0.003]}, steps=100, sd=0.02)
    assert got["auc_gap"] == pytest.approx(0.05) and got["auc_gap_ci95"] == pytest.approx([-0.05, 0.15])
    assert got["seeds_for_80pct_power"] == pytest.approx((2.801585 * 0.02 / 0.05) ** 2, rel=1e-6)


class FakeScorer:
    """Scores from a table: state name -> record (the driver's decisions without training)."""

    def __init__(self, make):
        self.make, self.calls = make, []

    def score(self, state, cfg):
        self.calls.append((state.name, tuple(cfg["minibatches"]), cfg["v_per_prompt"]))
        return self.make(state, cfg)


class S:
    def __init__(self, seed, step):
        self.run = type("R", (), {"set": "moe", "seed": seed, "every": 5})()
        self.step, self.name = step, f"moe-s{seed}-step{step:03d}"


def test_the_gate_changes_the_cell_once_then_stops(tmp_path):
    plan = driver.load_plan()
    order = [S(500 + i % 3, 10 * (i + 1)) for i in range(12)]
    fail = FakeScorer(
        lambda s, cfg: record(s.run.seed, s.step, {"GRPO": (0.0, 0.1, 0.01, 0.001)}, cfg["minibatches"][-1])
    )
    dec = driver.decide(plan, order, fail, tmp_path)
    assert dec["stopped"] and [g["minibatches"] for g in dec["gate"]] == [16, 32]
    assert {c[1] for c in fail.calls} == {(4, 16), (4, 32)} and len(fail.calls) == 20  # the first 10, twice
    assert json.loads((tmp_path / "decisions.json").read_text()) == dec
    again = FakeScorer(fail.make)
    assert driver.decide(plan, order, again, tmp_path) == dec and not again.calls  # read once, kept


def test_a_passed_gate_then_the_se_rule_decides_v_and_the_states(tmp_path):
    plan = driver.load_plan()

    def make(s, cfg):
        m = cfg["minibatches"][-1]
        wobble = 0.05 * (-1) ** s.step if cfg["v_per_prompt"] == 64 else 0.0
        arms = {"GRPO": (0.0, 0.5, 0.05, 0.006), "GRPO+R2": (wobble, 0.5, 0.0, 0.006)}
        return record(s.run.seed, s.step, arms, m)

    order = [S(500 + i % 3, 5 * (i + 1)) for i in range(12)]
    dec = driver.decide(plan, order, FakeScorer(make), tmp_path)
    assert dec["gate_passed"] and dec["se"]["double"] and not dec.get("stopped")
    cfg = driver.scoring_config(plan, dec, "moe")
    assert cfg["v_per_prompt"] == 128 and cfg["heldout"] == [64, 16] and cfg["minibatches"] == [4, 16]
    kept = driver.scored_states(plan, order, dec)
    assert [s.step for s in kept] == [10, 20, 30, 40, 50, 60]  # every 10 steps only
