"""moe_rl.lab.report.story: the demo's ten-second picture and what it says."""

from __future__ import annotations

import math

from moe_rl.lab.report import differing_ingredient, story


def _arm(rewards, entropy, seq_lr=0.5, grad=1.0):
    rl = [
        {
            "step": t,
            "reward/mean": r,
            "entropy/mean": e,
            "ratio/seq_log_sum_min": -seq_lr,
            "ratio/seq_log_sum_max": seq_lr,
            "grad_norm": grad,
            "flip/step/rate": 0.001,
        }
        for t, (r, e) in enumerate(zip(rewards, entropy))
    ]
    return {"rl": rl, "eval": [{"step": 0, "eval/accuracy": 0.5}, {"step": len(rl), "eval/accuracy": 0.6}]}


def test_a_collapse_is_marked_and_its_precursor_named(tmp_path):
    n = 60
    held = [0.8] * n
    fall = [0.8] * 40 + [0.1] * 20  # falls at step 40, stays down
    calm = [0.01] * n
    rising = [0.01] * 25 + [0.05] * 35  # entropy x5 in the 20 steps before the fall
    arms = {"GRPO": _arm(fall, rising), "GRPO+R2": _arm(held, calm), "GSPO": _arm(held, calm)}
    told = story(arms, tmp_path / "story.png")
    assert (tmp_path / "story.png").read_bytes()[:4] == b"\x89PNG"
    assert told["verdicts"] == {"GRPO": "collapsed", "GRPO+R2": "fine", "GSPO": "fine"}
    assert told["ingredient"] == "entropy/mean" and "before the fall" in told["why"]
    assert told["title"].startswith("collapsed: GRPO (step") and "held: GRPO+R2, GSPO" in told["title"]


def test_without_a_collapse_the_sequence_log_ratio_is_shown():
    arms = {"GRPO": _arm([0.5] * 30, [0.01] * 30, seq_lr=3.0), "GSPO": _arm([0.5] * 30, [0.01] * 30)}
    verdicts = {}
    from moe_rl.lab.collapse import collapse_verdict

    for a, arm in arms.items():
        verdicts[a] = collapse_verdict([r["reward/mean"] for r in arm["rl"]])
    key, _, why = differing_ingredient(arms, verdicts)
    assert key == "ratio/seq_log_sum_abs" and why == "no arm collapsed"
    assert all(not v.collapsed and math.isfinite(v.best) for v in verdicts.values())


def test_the_shipped_demo_runs_every_arm_from_its_start(tmp_path):
    """``make demo`` (recipes/demo/dial_demo.yaml) starts every arm of DEMO_ARMS from the shipped
    countdown start (model.hf_path, no SFT stage) through ``moe-rl compare``: one short step each at the
    shipped policy's own size, every seed paired, and a rerun into its own folder keeps the runs
    that finished instead of retraining them."""
    import json
    from pathlib import Path

    from moe_rl.lab.arms import DEMO_ARMS, arm_dir
    from moe_rl.lab.demo import DEFAULT_RECIPE, run_demo

    root = Path(__file__).resolve().parents[2]
    ov = [
        f"model.hf_path={root / 'recipes/demo/dial_start'}",
        "train.rl_steps=1",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.minibatches=1",
        "train.max_new_tokens=8",
        "train.eval_prompts=2",
        "train.flip_probe_sequences=1",
    ]
    res = run_demo(root / DEFAULT_RECIPE, ov, out=tmp_path / "demo", jobs=1, seeds=1)
    assert not res["failed"] and [r["arm"] for r in res["rows"]] == list(DEMO_ARMS)
    doc = json.loads((tmp_path / "demo" / "compare.json").read_text())
    assert [r["arm"] for r in doc["rows"]] == list(DEMO_ARMS)
    assert not (tmp_path / "demo" / "starts").exists()  # no SFT ran: the arms loaded the start
    for arm in DEMO_ARMS:  # each arm ran its own overrides on the shipped start
        recipe = (tmp_path / "demo" / arm_dir(arm) / "s0" / "recipe.yaml").read_text()
        assert "dial_start" in recipe and ("start_jitter: 1.0e-07" in recipe) == (arm == "CHAOS"), arm
    rows = {p: p.read_bytes() for p in (tmp_path / "demo").glob("*/s0/metrics.jsonl")}
    assert len(rows) == 3
    run_demo(root / DEFAULT_RECIPE, ov, out=tmp_path / "demo", jobs=1, seeds=1)
    assert {p: p.read_bytes() for p in (tmp_path / "demo").glob("*/s0/metrics.jsonl")} == rows
