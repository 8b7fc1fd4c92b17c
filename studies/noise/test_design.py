"""Issue 31 design (a): the plan's runs are what it says, the analysis is hand-checked, and the
committed pre-registration is the plan in studies/noise/noise.plan.yaml."""

from __future__ import annotations

import json
import math

import pytest

from moe_rl.lab.stats import kaplan_meier, log_rank_p, paired, sign_flip_p
from studies.noise import design as noise

PLAN = noise.load_plan()


def test_the_committed_preregistration_is_the_plan():
    from studies.noise.noise import PLAN_FILE

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


def test_a_runs_routing_share_pools_its_steps_so_one_flat_step_cannot_swing_it():
    """Design (a)'s R3 + gates arm once read -4.3 from one step at natural variance 4e-9 (its
    share -2,149): the run's share pools the two variances over the steps."""
    steps = [(4e-4, 2e-4)] * 9 + [(4e-9, 8.6e-6)]  # (natural, replayed) per step
    rl = [
        {
            "reward/mean": 0.5,
            "ratio/log_rho_var_natural": n,
            "ratio/log_rho_var_replayed": v,
            "ratio/routing_share": 1 - v / n,
        }
        for n, v in steps
    ]
    rl.append({"reward/mean": 0.5})  # a step the probe skipped
    gauges = noise.summarize_run({"rl": rl, "eval": []})["gauges"]
    pooled = 1 - (9 * 2e-4 + 8.6e-6) / (9 * 4e-4 + 4e-9)
    assert gauges["ratio/routing_share"] == pytest.approx(pooled)
    assert 0.49 < gauges["ratio/routing_share"] < 0.5
    assert gauges["ratio/routing_share_step_mean"] == pytest.approx((9 * 0.5 + 1 - 8.6e-6 / 4e-9) / 10)
    assert math.isnan(noise.routing_share([{"reward/mean": 0.5}]))


def test_a_runs_outlier_gauge_is_the_fraction_of_steps_with_a_ratio_outside_half_to_two():
    rl = [{"reward/mean": 0.5, "ratio/token_frac_outside_0.5_2": f} for f in (0.0, 1e-4, 0.0, 0.02)]
    rl.append({"reward/mean": 0.5})  # no ratio metrics that step: not counted
    gauges = noise.summarize_run({"rl": rl, "eval": []})["gauges"]
    assert gauges["ratio/steps_outside_0.5_2"] == 0.5
    assert gauges["ratio/token_frac_outside_0.5_2"] == pytest.approx((1e-4 + 0.02) / 4)


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


def _contrast_results(arm: str, gains: dict[str, float]) -> dict:
    """Six seeds of GRPO, CHAOS (+-0.01) and ``arm`` (GRPO + the cell's gain) in every cell."""
    results = {}
    for s in range(6):
        for cell, gain in gains.items():
            results[(cell, "GRPO", s)] = _result(0.5)
            results[(cell, "CHAOS", s)] = _result(0.5 + (0.01 if s % 2 else -0.01))
            results[(cell, arm, s)] = _result(0.5 + gain + 0.001 * s)
    return results


def test_the_success_rule_reads_the_contrast_against_the_chaos_spread():
    results = _contrast_results("GRPO+R3", {"moe-noise": 0.05, "moe-quiet": 0.0, "dense-noise": 0.0})
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


@pytest.mark.parametrize(
    "recipe, design, cell, start, arms",
    [
        # make demo: design (b)'s deciding cell (the strongest contrast measured)
        ("recipes/demo/dial_demo.yaml", "b", "moe-dial30", "dial_start", ("GRPO", "GRPO+R2", "CHAOS")),
        # the first demo (studies/noise/README.md; moe-rl compare --arms GRPO,GRPO+R3,CHAOS): design (a)'s
        ("recipes/demo/noise_demo.yaml", "a", "moe-noise", "noise_start", ("GRPO", "GRPO+R3", "CHAOS")),
    ],
)
def test_a_demo_recipe_is_its_designs_deciding_cell_in_short(recipe, design, cell, start, arms):
    """A demo recipe is its design's deciding cell but for its length, held-out size, out_dir and
    its start (the cell's SFT start, shipped); its arms are the cell's deciding ones, defined as the
    pre-registered plans define them; ``make demo`` is the first."""
    import hashlib
    from pathlib import Path

    from moe_rl.cli import build_parser
    from moe_rl.config import load_recipe, to_dict
    from moe_rl.lab.arms import DEMO, DEMO_ARMS, VARIANTS, arm_overrides
    from moe_rl.lab.demo import DEFAULT_RECIPE
    from moe_rl.lab.starts import sft_key

    plan = noise.load_plan(design)
    root = Path(__file__).resolve().parents[2]
    demo = to_dict(load_recipe(root / recipe))
    want = to_dict(load_recipe(DEMO, noise.cell_overrides(plan, cell)))
    for sec, keys in {
        "train": ("rl_steps", "eval_prompts", "out_dir", "stages"),
        "model": ("hf_path",),
    }.items():
        for k in keys:
            demo[sec].pop(k), want[sec].pop(k)
    assert demo == want
    assert all(VARIANTS[a] == v for a, v in plan["extra_arms"].items())
    deciding = [e for e in plan["order"] if e["cell"] == cell and e.get("stage", 2) == 2]
    assert arms == tuple(deciding[0]["arms"][:3])
    for arm in arms:  # the same sections as the design's runs
        assert set(arm_overrides(arm)) <= set(noise.run_overrides(plan, cell, arm, plan["seeds"][0]))
    # the shipped start is the cell's SFT start: the same key as the design's cached one
    info = json.loads((root / f"recipes/demo/{start}.json").read_text())
    assert info["sft_key"] == sft_key(
        load_recipe(DEMO, [*noise.start_overrides_of(plan, cell), "train.stages=[sft]"])
    )
    files = {p.name: p for p in (root / "recipes/demo" / start).iterdir()}
    assert set(files) == set(info["sha256"])
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == info["sha256"][n] for n, p in files.items())
    assert VARIANTS == PLAN["extra_arms"]
    assert (DEFAULT_RECIPE, DEMO_ARMS) == ("recipes/demo/dial_demo.yaml", ("GRPO", "GRPO+R2", "CHAOS"))
    assert build_parser().parse_args(["demo"]).recipe == DEFAULT_RECIPE  # the CLI's default is it


# -- design (b): the router learning-rate dial on countdown ---------------------------------------
PLAN_B = noise.load_plan("b")


def test_design_b_preregistration_is_its_plan_and_its_runs_are_valid_recipes():
    from moe_rl.config import load_recipe
    from moe_rl.lab.arms import DEMO
    from studies.noise.noise import plan_file

    assert json.loads(plan_file("b").read_text())["plan"] == PLAN_B
    assert noise.runs_root(PLAN_B).name == "noise-b" and noise.runs_root(PLAN).name == "noise"
    specs = noise.run_specs(PLAN_B)
    assert len(specs) == len({(s.cell, s.arm, s.seed) for s in specs}) == 60  # gauge runs listed once
    assert [(s.cell, s.seed) for s in noise.run_specs(PLAN_B, stage=1)] == [
        ("moe-dial1", 200),
        ("moe-dial1", 201),
        ("moe-dial30", 200),
        ("moe-dial30", 201),
    ]
    assert not set(PLAN_B["seeds"]) & set(PLAN["seeds"])  # fresh seeds
    for spec in specs[::6]:
        r = load_recipe(DEMO, noise.run_overrides(PLAN_B, spec.cell, spec.arm, spec.seed))
        assert r.task.name == "countdown"
        assert r.train.router_lr_mult == (1.0 if spec.cell == "moe-dial1" else 30.0)
    # the dial is RL-only: both MoE cells share one SFT start, the dense cell has its own
    assert noise.start_overrides_of(PLAN_B, "moe-dial1") == noise.start_overrides_of(PLAN_B, "moe-dial30")
    assert "model.num_experts=2" in noise.start_overrides_of(PLAN_B, "dense-dial30")
    assert not any("router_lr_mult" in o for o in noise.start_overrides_of(PLAN_B, "dense-dial30"))


def _gauged(drift, share):
    r = _result(0.5)
    r["gauges"] = {**r["gauges"], "flip/drift/router_rate": drift, "ratio/routing_share": share}
    return r


def test_design_b_gate_reads_the_drift_ratio_and_routing_share():
    def verdict(drift1, drift30, share30, seeds=(200, 201)):
        results = {("moe-dial1", "GRPO", s): _gauged(drift1, 0.1) for s in seeds}
        results |= {("moe-dial30", "GRPO", s): _gauged(drift30, share30) for s in seeds}
        return noise.analyse(PLAN_B, results)["gate"]["passed"]

    assert verdict(0.01, 0.03, 0.2) is True
    assert verdict(0.01, 0.015, 0.2) is False  # the dial barely moves the routes
    assert verdict(0.01, 0.03, 0.01) is False  # routing does not reach the ratios
    assert verdict(0.01, 0.03, 0.2, seeds=(200,)) is None  # the gauge stage is not finished


def test_design_b_runs_its_deciding_stage_only_after_the_gate_passed(tmp_path, monkeypatch):
    import studies.noise.noise as bench
    from moe_rl.lab import runner

    ran: list[int] = []
    monkeypatch.setattr(bench, "execute", lambda plan, specs, **kw: ran.append(len(specs)))
    monkeypatch.setattr(runner, "stop_cleanly", lambda fn: fn())
    gauges = {}
    monkeypatch.setattr(bench, "collect", lambda specs: (gauges, []))
    assert bench.run_stages(PLAN_B, tmp_path, None, jobs=1, cache=tmp_path) is False
    assert ran == [4]  # stage 1 only: the gate is undecided
    gauges.update(
        {
            (c, "GRPO", s): _gauged(d, 0.2)
            for c, d in (("moe-dial1", 0.01), ("moe-dial30", 0.05))
            for s in (200, 201)
        }
    )
    ran.clear()
    assert bench.run_stages(PLAN_B, tmp_path, None, jobs=1, cache=tmp_path) is True
    assert ran == [4, 60]  # then stage 2, whose 60 hold the 4 gauge runs again (finished: skipped)


def test_design_b_success_rule_is_its_own_contrast():
    results = _contrast_results("GRPO+R2", {"moe-dial30": 0.05, "moe-dial1": 0.0, "dense-dial30": 0.0})
    assert noise.analyse(PLAN_B, results)["success"] == {
        "moe_dial30_separates": True,
        "moe_dial1_separates": False,
        "dense_dial30_separates": False,
        "met": True,
    }


# -- design (c): critical learning rates ----------------------------------------------------------
PLAN_C = noise.load_plan("c")


def test_design_c_preregistration_is_its_plan_and_its_ladder_shares_one_start_per_model():
    from moe_rl.config import load_recipe
    from moe_rl.lab.arms import DEMO
    from moe_rl.lab.starts import sft_key
    from studies.noise.noise import plan_file

    assert json.loads(plan_file("c").read_text())["plan"] == PLAN_C
    assert len(noise.run_specs(PLAN_C)) == 96
    assert not set(PLAN_C["seeds"]) & (set(PLAN["seeds"]) | set(PLAN_B["seeds"]))
    keys = {}
    for model, cells in PLAN_C["ladder"]["models"].items():
        for cell, lr in zip(cells, PLAN_C["ladder"]["lrs"]):
            r = load_recipe(DEMO, noise.run_overrides(PLAN_C, cell, "GSPO", 300))
            assert r.optim.lr == lr and r.train.minibatches == 8 and r.algo.name == "gspo"
            assert (r.model.num_experts == 2) == (model == "dense")
            keys.setdefault(model, set()).add(
                sft_key(load_recipe(DEMO, [*noise.start_overrides_of(PLAN_C, cell), "train.stages=[sft]"]))
            )
    assert all(len(k) == 1 for k in keys.values()) and keys["moe"] != keys["dense"]
    # the ladder is design (a)'s cell: its starts are design (a)'s (trained at base.yaml's SFT lr)
    for model, cell_a in (("moe", "moe-noise"), ("dense", "dense-noise")):
        assert keys[model] == {
            sft_key(load_recipe(DEMO, [*noise.start_overrides_of(PLAN, cell_a), "train.stages=[sft]"]))
        }


def _run(accs, collapsed=False):
    return {**_result(0.5), "collapsed": collapsed, "evals": [(10 * i, a) for i, a in enumerate(accs)]}


def test_design_c_critical_lr_is_the_lowest_rung_that_fell():
    lrs = [1.0, 2.0, 3.0]
    ok, fell_heldout, fell_reward = _run([0.8, 0.85, 0.7]), _run([0.8, 0.5, 0.9]), _run([0.8, 0.8], True)
    assert noise.fell(fell_heldout, 0.2) and noise.fell(fell_reward, 0.2) and not noise.fell(ok, 0.2)
    assert noise.critical_lr([ok, fell_heldout, ok], lrs, 0.2) == 2.0
    assert noise.critical_lr([ok, ok, ok], lrs, 0.2) == math.inf  # censored above the top
    assert noise.critical_lr([ok, None, fell_reward], lrs, 0.2) is None  # a lower rung is pending
    assert noise.critical_lr([fell_reward, None, None], lrs, 0.2) == 1.0  # the bottom fell: decided


def test_design_c_contrast_is_the_moe_margin_over_the_dense_one_paired_by_seed(tmp_path):
    lad = PLAN_C["ladder"]
    ok, bad = _run([0.8, 0.8, 0.8]), _run([0.8, 0.3, 0.3])
    results = {}

    def put(model, arm, seed, falls_at):  # falls_at: the rung index of the first fall (None: never)
        for i, cell in enumerate(lad["models"][model]):
            results[(cell, arm, seed)] = bad if falls_at is not None and i >= falls_at else ok

    for s in PLAN_C["seeds"]:
        put("moe", "GRPO", s, 1)  # 6e-5
        put("moe", "GSPO", s, None if s % 2 else 3)  # censored (1.25e-4) or 1e-4
        put("dense", "GRPO", s, 2)  # 8e-5
        put("dense", "GSPO", s, 2)
    out = noise.analyse(PLAN_C, results)
    lad_out = out["ladder"]
    moe = lad_out["models"]["moe"]
    assert moe["arms"]["GSPO"]["censored"] == [301, 303, 305]
    assert moe["margins"][300] == pytest.approx(math.log2(1e-4 / 6e-5))
    assert moe["margins"][301] == pytest.approx(math.log2(1.25e-4 / 6e-5))
    assert lad_out["models"]["dense"]["margins"][300] == 0.0
    assert lad_out["contrast"]["n"] == 6 and lad_out["contrast"]["p"] == pytest.approx(2 / 64)
    assert out["success"] == {"contrast_n": 6, "met": True}
    import studies.noise.noise as bench

    bench.plot(out, results, tmp_path / "c.png")  # the ladder's column draws censored seeds too
    assert (tmp_path / "c.png").stat().st_size > 0
    del results[("dense-lr4e-5", "GSPO", 305)]  # a seed's ladder unfinished: no verdict yet
    assert noise.analyse(PLAN_C, results)["success"] == {"contrast_n": 5, "met": None}


def test_design_d_preregistration_is_its_plan_on_fresh_seeds_from_design_as_start():
    """Design (d), the confirmation of design (a)'s R3 + gates lead: its committed plan, seeds no
    other design used, design (a)'s SFT start (same start overrides), the arm's effect switched on
    by its overrides, and its own success rule."""
    from studies.noise.noise import plan_file

    plan_d = noise.load_plan("d")
    assert json.loads(plan_file("d").read_text())["plan"] == plan_d
    used = {s for d in "abc" for s in noise.load_plan(d)["seeds"]}
    used |= {s for d in "abc" for e in noise.load_plan(d)["order"] for s in e.get("seeds", [])}
    assert not set(plan_d["seeds"]) & used and len(plan_d["seeds"]) == 8
    for cell in ("moe-noise", "moe-quiet"):
        assert noise.start_overrides_of(plan_d, cell) == noise.start_overrides_of(PLAN, "moe-noise")
    ov = noise.run_overrides(plan_d, "moe-noise", "GRPO+R3+gates", 400)
    assert (
        "algo.routing=r3" in ov and "algo.replay_gate_weights=true" in ov and "rollout.route_noise=0.07" in ov
    )
    assert not any("route_noise" in o for o in noise.run_overrides(plan_d, "moe-quiet", "GRPO+R3+gates", 400))
    specs = noise.run_specs(plan_d)
    assert len(specs) == len({(s.cell, s.arm, s.seed) for s in specs}) == 56
    assert noise.runs_root(plan_d).name == "noise-d"
    rule = plan_d["success_rule"]
    assert rule == {"arm": "GRPO+R3+gates", "decides": "moe-noise", "controls": ["moe-quiet"]}


def test_the_noise_plans_frozen_and_gates_arms_load_as_the_keys_they_name():
    """The pre-registered plan (studies/noise/noise.plan.yaml) names these arms by recipe keys: each
    loads, and sets what its name says."""
    from moe_rl.config import load_recipe
    from moe_rl.lab.arms import DEMO

    plan = noise.load_plan()
    frozen = load_recipe(DEMO, noise.run_overrides(plan, "moe-noise", "GRPO+frozen", 100))
    gates = load_recipe(DEMO, noise.run_overrides(plan, "moe-noise", "GRPO+R3+gates", 100))
    assert (
        frozen.train.freeze_router and frozen.algo.routing == "none" and not frozen.algo.replay_gate_weights
    )
    assert gates.algo.replay_gate_weights and gates.algo.routing == "r3" and not gates.train.freeze_router
