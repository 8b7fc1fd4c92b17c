"""Issue 31 design (a): the plan's runs are what it says, the analysis is hand-checked, and the
committed pre-registration is the plan in recipes/demo/noise.plan.yaml."""

from __future__ import annotations

import json
import math

import pytest

from moe_rl.lab import noise
from moe_rl.lab.stats import kaplan_meier, log_rank_p, paired, sign_flip_p

PLAN = noise.load_plan()


def test_the_committed_preregistration_is_the_plan():
    from benchmarks.noise import PLAN_FILE

    assert json.loads(PLAN_FILE.read_text())["plan"] == PLAN


def test_every_run_carries_its_cell_arm_and_seed():
    ov = noise.run_overrides(PLAN, "moe-noise", "CHAOS", 100)
    assert "rollout.route_noise=0.07" in ov and "train.route_noise=0.005" in ov
    assert "train.start_jitter=1e-07" in ov and "algo.routing=none" in ov
    assert "train.seed=1334" in ov and "task.seed=100" in ov
    assert "algo.routing=r3" in noise.run_overrides(PLAN, "moe-quiet", "GRPO+R3", 100)
    assert not any("route_noise" in o for o in noise.run_overrides(PLAN, "moe-quiet", "GRPO", 100))
    dense = noise.run_overrides(PLAN, "dense-noise", "GRPO", 100)
    assert "model.num_experts=2" in dense and "rollout.route_noise=0.07" in dense
    # one SFT start per model: the noise is RL-only, the dense model is not
    assert noise.start_overrides_of(PLAN, "moe-noise") == noise.start_overrides_of(PLAN, "moe-quiet")
    assert "model.num_experts=2" in noise.start_overrides_of(PLAN, "dense-noise")
    specs = noise.run_specs(PLAN)
    assert len({s.out for s in specs}) == len(specs)
    # the deciding runs first, seed by seed: a partial sweep holds whole paired sets
    assert [(s.cell, s.arm, s.seed) for s in specs[:4]] == [
        ("moe-noise", "GRPO", 100),
        ("moe-noise", "GRPO+R3", 100),
        ("moe-noise", "CHAOS", 100),
        ("moe-noise", "GRPO", 101),
    ]
    with pytest.raises(KeyError, match="unknown arm"):
        noise.arm_sections(PLAN, "GRPO+R9")


def test_every_run_of_the_plan_is_a_valid_recipe():
    from moe_rl.config import load_recipe
    from moe_rl.lab.arms import DEMO

    for spec in noise.run_specs(PLAN)[:: len(PLAN["seeds"])]:
        load_recipe(DEMO, noise.run_overrides(PLAN, spec.cell, spec.arm, spec.seed))


def test_auc_is_the_trapezoid_mean_accuracy():
    assert noise.auc([(0, 0.5), (10, 0.7), (20, 0.7)]) == pytest.approx((0.6 * 10 + 0.7 * 10) / 20)
    assert math.isnan(noise.auc([(0, 0.5)]))


def test_paired_statistics_by_hand():
    d = paired([0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    assert d["mean"] == pytest.approx(0.035)
    sd = math.sqrt(sum((x - 0.035) ** 2 for x in [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]) / 5)
    assert d["ci95"][0] == pytest.approx(0.035 - 2.571 * sd / math.sqrt(6))
    assert d["p"] == pytest.approx(2 / 64)  # all six positive: the two extreme sign patterns
    assert sign_flip_p([1.0, -1.0]) == 1.0


def test_kaplan_meier_and_log_rank_by_hand():
    assert kaplan_meier([3, 5, 5, 10], [True, True, False, False]) == [(0.0, 1.0), (3.0, 0.75), (5.0, 0.5)]
    assert log_rank_p([10] * 6, [False] * 6, [10] * 6, [False] * 6) == 1.0
    early = log_rank_p([2, 3, 3, 4, 5, 5], [True] * 6, [100] * 6, [False] * 6)
    assert early < 0.01


def _result(auc):
    return {
        "auc": auc,
        "final_acc": auc,
        "collapsed": False,
        "time": 100.0,
        "evals": [],
        "gauges": dict.fromkeys(noise.GAUGES, 0.1),
    }


def test_the_success_rule_reads_the_contrast_against_the_chaos_spread():
    results = {}
    for s in range(6):
        for cell, r3_gain in (("moe-noise", 0.05), ("moe-quiet", 0.0), ("dense-noise", 0.0)):
            results[(cell, "GRPO", s)] = _result(0.5)
            results[(cell, "CHAOS", s)] = _result(0.5 + (0.01 if s % 2 else -0.01))
            results[(cell, "GRPO+R3", s)] = _result(0.5 + r3_gain + 0.001 * s)
    out = noise.analyse(PLAN, results)
    assert out["cells"]["moe-noise"]["chaos_spread"] == pytest.approx(math.sqrt(6 * 0.01**2 / 5))
    assert out["success"] == {
        "moe_noise_separates": True,
        "moe_quiet_separates": False,
        "dense_noise_separates": False,
        "met": True,
    }
    # the same effect inside the chaos spread does not count
    for s in range(6):
        results[("moe-noise", "CHAOS", s)] = _result(0.5 + (0.2 if s % 2 else -0.2))
    assert noise.analyse(PLAN, results)["success"]["moe_noise_separates"] is False


def test_the_demo_is_the_deciding_cell_in_short():
    """``make demo``'s recipe is the moe-noise cell but for its length, held-out size, out_dir and
    its start (the cell's SFT start, shipped); its arms are the cell's deciding ones, defined as
    the pre-registered plan defines them."""
    import hashlib
    from pathlib import Path

    from moe_rl.config import load_recipe, to_dict
    from moe_rl.lab.arms import DEMO, DEMO_ARMS, VARIANTS, arm_overrides
    from moe_rl.lab.demo import DEFAULT_RECIPE

    root = Path(__file__).resolve().parents[2]
    demo = to_dict(load_recipe(root / DEFAULT_RECIPE))
    cell = to_dict(load_recipe(DEMO, noise.cell_overrides(PLAN, "moe-noise")))
    for sec, keys in {
        "train": ("rl_steps", "eval_prompts", "out_dir", "stages"),
        "model": ("hf_path",),
    }.items():
        for k in keys:
            demo[sec].pop(k), cell[sec].pop(k)
    assert demo == cell
    assert VARIANTS == PLAN["extra_arms"]
    assert DEMO_ARMS == tuple(PLAN["order"][0]["arms"])
    for arm in DEMO_ARMS:  # the same sections as the design's runs
        assert set(arm_overrides(arm)) <= set(noise.run_overrides(PLAN, "moe-noise", arm, 100))
    info = json.loads((root / "recipes/demo/noise_start.json").read_text())
    from moe_rl.lab.starts import sft_key

    # the shipped start is the cell's SFT start: the same key as the design's cached one
    assert info["sft_key"] == sft_key(
        load_recipe(DEMO, [*noise.start_overrides_of(PLAN, "moe-noise"), "train.stages=[sft]"])
    )
    files = {p.name: p for p in (root / "recipes/demo/noise_start").iterdir()}
    assert set(files) == set(info["sha256"])
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == info["sha256"][n] for n, p in files.items())
