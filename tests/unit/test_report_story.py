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


def test_the_demo_writes_its_picture_detail_and_verdicts(tmp_path):
    """``moe-rl demo`` end to end on a micro policy: SFT, three arms side by side, report.png (the
    story), report-detail.png (every metric) and report.json with the verdicts; a second demo
    reuses the SFT start."""
    import json
    from pathlib import Path

    from moe_rl.lab.arms import DEMO_ARMS
    from moe_rl.lab.demo import run_demo

    root = Path(__file__).resolve().parents[2]
    ov = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_attention_heads=2",
        "model.num_query_groups=2",
        "model.head_dim=16",
        "model.moe_ffn_hidden_size=32",
        "model.num_experts=4",
        "model.max_seq_len=48",
        "train.sft_steps=5",
        "train.rl_steps=3",
        "train.prompts_per_step=2",
        "train.group_size=4",
        "train.minibatches=2",
        "train.max_new_tokens=8",
        "train.eval_every=1",
        "train.eval_prompts=4",
        "train.flip_probe_sequences=2",
        f"train.out_dir={tmp_path / 'sft'}",
    ]
    text = run_demo(root / "recipes/demo/base.yaml", ov, out=tmp_path / "demo")
    out = tmp_path / "demo"
    for png in ("report.png", "report-detail.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    doc = json.loads((out / "report.json").read_text())
    assert set(doc["story"]["verdicts"]) == set(DEMO_ARMS) and len(doc["rows"]) == 3
    assert doc["story"]["title"] in text and doc["wall_s"] > 0
    assert all((out / f"{a.lower().replace('+', '_')}.log").stat().st_size > 0 for a in DEMO_ARMS)
    sft = sorted((tmp_path / "sft" / "checkpoints").iterdir())
    run_demo(root / "recipes/demo/base.yaml", [*ov, "train.rl_steps=1"], out=tmp_path / "again", jobs=1)
    assert sorted((tmp_path / "sft" / "checkpoints").iterdir()) == sft  # reused, not retrained
    assert json.loads((tmp_path / "again" / "report.json").read_text())["jobs"] == 1


def test_the_shipped_demo_start_runs_every_arm(tmp_path):
    """The default demo (recipes/demo/closest.yaml) starts every arm from the shipped SFT start
    (model.hf_path, no SFT stage): one short step each at the shipped policy's own size."""
    import json
    from pathlib import Path

    from moe_rl.lab.demo import DEFAULT_RECIPE, run_demo

    root = Path(__file__).resolve().parents[2]
    ov = [
        f"model.hf_path={root / 'recipes/demo/start'}",
        "train.rl_steps=1",
        "train.prompts_per_step=2",
        "train.group_size=2",
        "train.minibatches=1",
        "train.max_new_tokens=8",
        "train.eval_prompts=2",
        "train.flip_probe_sequences=1",
    ]
    run_demo(root / DEFAULT_RECIPE, ov, out=tmp_path / "demo")
    doc = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert doc["sft_s"] < 5 and len(doc["rows"]) == 3  # no SFT ran: the arms loaded the start
    assert not (tmp_path / "demo" / "sft").exists()
    # a rerun into the demo's own folder (after Ctrl-C, say) keeps the finished arms, not retrains them
    rows = {p: p.read_bytes() for p in (tmp_path / "demo").glob("*/metrics.jsonl")}
    assert len(rows) == 3
    run_demo(root / DEFAULT_RECIPE, ov, out=tmp_path / "demo")
    assert {p: p.read_bytes() for p in (tmp_path / "demo").glob("*/metrics.jsonl")} == rows
