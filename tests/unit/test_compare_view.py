"""What a user reads of ``moe-rl compare`` / ``demo`` / ``report`` (issue 49): one unit per quantity
(rates in percent with the unit named, differences in points), seeds as values besides a count, a
picture whose legend counts seeds in words, steps in whole numbers and identical arms visible, a
status line that tells slow from stuck, and the report's picture named with its ``.png``.

Before: the tables printed fractions (``0.270``, ``0.00680``) under unit-less headings, ``--seeds``
took only a count, the picture said "(1 seeds)", drew ticks at 0.25 steps and hid an arm equal to
another behind it, the status line read ``reward - acc -`` while a run loaded and evaluated, and
``moe-rl report --out x`` printed ``curves: x`` for the file ``x.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_rl.lab import compare, compare_plot
from moe_rl.lab.arms import DEMO, FIRST_SEED
from moe_rl.lab.stats import paired
from moe_rl.lab.status import StatusLines, run_status
from tests.tiny import COMPARE_TINY as TINY


def rows_of(values: dict) -> list[dict]:
    return compare.seed_table(values, list(values))


VALUES = {
    "GRPO": {
        0: {
            "reward": 0.30,
            "accuracy": 0.27,
            "auc": 0.25,
            "outlier_steps": 0.5,
            "flip_step": 0.0068,
            "flip_drift": 0.01,
        },
        1: {
            "reward": 0.32,
            "accuracy": 0.29,
            "auc": 0.27,
            "outlier_steps": 0.6,
            "flip_step": 0.0070,
            "flip_drift": 0.01,
        },
    },
    "GRPO+R2": {
        0: {
            "reward": 0.31,
            "accuracy": 0.28,
            "auc": 0.26,
            "outlier_steps": 0.1,
            "flip_step": 0.0066,
            "flip_drift": 0.0,
        },
        1: {
            "reward": 0.33,
            "accuracy": 0.31,
            "auc": 0.28,
            "outlier_steps": 0.05,
            "flip_step": 0.0064,
            "flip_drift": 0.0,
        },
    },
}


def test_the_tables_show_rates_in_percent_and_differences_in_points():
    rows = rows_of(VALUES)
    table = compare.format_table(rows)
    head, _, grpo, r2 = table.splitlines()
    for h in (
        "held-out acc (%)",
        "acc AUC (%)",
        "ratio-outlier steps (% of steps)",
        "flip/step (% of routers)",
    ):
        assert h in head, head
    assert "acc AUC - GRPO (pts) [95% CI]" in head and "reward - GRPO [95% CI]" in head  # a reward is no rate
    assert " 28.0 " in grpo and " 0.690 " in grpo  # accuracy 0.28 -> 28.0 %, flip 0.0069 -> 0.690 %
    d = paired([0.26 - 0.25, 0.28 - 0.27])
    assert f"+{100 * d['mean']:.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]" in r2, r2
    md = compare.markdown_table(rows)
    assert "| held-out acc (%) |" in md and "flip/drift - GRPO (pts) [95% CI]" in md
    assert "| GRPO | 2 | 0.310 | 28.0 | 26.0 | 55.0 | 0.690 | 1.000 |" in md, md
    # the data files keep fractions, as metrics.jsonl (read by programs)
    assert compare.csv_rows(rows)[0]["accuracy"] == pytest.approx(0.28)


def test_seeds_are_a_count_or_the_seeds_themselves():
    assert compare.parse_seeds("3") == [0, 1, 2]
    assert compare.parse_seeds("9001,9002,9003") == [9001, 9002, 9003]
    assert compare.parse_seeds("9001,") == [9001] and compare.parse_seeds(" 4, 7 ") == [4, 7]
    jobs = compare.plan_jobs(["GRPO", "GSPO"], [9001, 9002], Path("out"))
    assert [(j.arm, j.seed, j.out) for j in jobs] == [
        ("GRPO", 9001, Path("out/grpo/s9001")),
        ("GSPO", 9001, Path("out/gspo/s9001")),
        ("GRPO", 9002, Path("out/grpo/s9002")),
        ("GSPO", 9002, Path("out/gspo/s9002")),
    ]
    assert [j.seed for j in compare.plan_jobs(["GRPO"], 2, Path("o"))] == [0, 1]
    assert compare.seeds_text([0, 1, 2]) == "3 seeds (0-2)" and compare.seeds_text([9001]) == "1 seed (9001)"


def test_explicit_seeds_reach_the_runs(tmp_path, monkeypatch, capsys):
    """``--seeds 9001,9002`` runs seeds 9001 and 9002 of every arm: their folders, train.seed and
    task.seed; the demo takes them too."""
    from moe_rl.cli import main

    calls = []

    def fake_run(label, recipe, overrides, out, **kw):
        calls.append((label, out, overrides))
        return {"status": "failed", "reason": "not trained in this test"}

    monkeypatch.setattr(compare, "resumable_run", fake_run)
    monkeypatch.setattr(compare, "_start", lambda *a, **k: None)
    rl_only = [*TINY, "train.stages=[rl]", "checkpoint.load=somewhere"]
    argv = ["compare", str(DEMO), "--arms", "GRPO,GSPO", "--seeds", "9001,9002", "--jobs", "1", *rl_only]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 1
    assert [(label, out.relative_to(tmp_path)) for label, out, _ in calls] == [
        ("GRPO seed 9001", Path("out/grpo/s9001")),
        ("GSPO seed 9001", Path("out/gspo/s9001")),
        ("GRPO seed 9002", Path("out/grpo/s9002")),
        ("GSPO seed 9002", Path("out/gspo/s9002")),
    ]
    for label, _, ov in calls:
        s = int(label.rsplit(" ", 1)[1])
        assert f"train.seed={FIRST_SEED + s}" in ov and f"task.seed={s}" in ov
    assert "x 2 seeds (9001, 9002)" in capsys.readouterr().out
    calls.clear()
    argv = ["demo", "--seeds", "7,", "--jobs", "1", "--recipe", str(DEMO), *rl_only]
    assert main([*argv, "--out", str(tmp_path / "demo")]) == 1
    assert {out.name for _, out, _ in calls} == {"s7"}


def _arm(rewards, accs, outliers):
    rl = [
        {"stage": "rl", "step": i, "reward/mean": r, "ratio/token_frac_outside_0.5_2": o}
        for i, (r, o) in enumerate(zip(rewards, outliers))
    ]
    ev = [{"stage": "rl_eval", "step": i, "eval/accuracy": a} for i, a in enumerate(accs)]
    return {"rl": rl, "eval": ev}


def test_the_picture_counts_seeds_in_words_steps_in_whole_numbers_and_shows_identical_arms(
    tmp_path, monkeypatch
):
    import matplotlib.figure

    seen = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: seen.setdefault("fig", fig))
    same = _arm([0.1, 0.2, 0.3], [0.1, 0.2, 0.3, 0.4], [0.0, 0.01, 0.0])
    runs = {
        "GRPO": {0: same},
        "GRPO+R3": {0: same},
        "GSPO": {0: same, 1: _arm([0.2] * 3, [0.3] * 4, [0.0] * 3)},
    }
    compare_plot.plot(runs, tmp_path / "compare.png")
    axes = seen["fig"].axes
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert labels == ["GRPO (1 seed)", "GRPO+R3 (1 seed), = GRPO", "GSPO (2 seeds)"], labels
    lines = axes[0].get_lines()
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3  # each arm its own look
    assert lines[0].get_linewidth() > lines[1].get_linewidth()  # the arm beneath is wider: both show
    for ax in axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert "(%)" in axes[1].get_title() and max(axes[1].get_lines()[0].get_ydata()) == pytest.approx(40.0)


def test_the_status_line_tells_slow_from_stuck(tmp_path):
    """Per running run its phase (starting; the step-0 evaluation) or its step with s/step and ETA,
    reward and accuracy in percent; the comparison's ETA once a run has ended."""
    from moe_rl.trainer.progress import Progress

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    status = StatusLines(total=3, every=60, jobs=1)
    status.started("GRPO seed 0", a, "rl", 30, a / "log", quiet=True)
    assert (
        status.status()
        == "0/3 runs ended | GRPO seed 0: starting (process groups, the policy and its weights)"
    )
    Progress(a).phase("rl step-0 evaluation", "greedy accuracy")
    assert "GRPO seed 0: rl step-0 evaluation" in status.status()
    (a / "metrics.jsonl").write_text(
        json.dumps({"stage": "rl_eval", "step": 0, "eval/accuracy": 0.25})
        + "\n"
        + json.dumps({"stage": "rl", "step": 0, "reward/mean": 0.5})
        + "\n"
    )
    (a / "progress.json").write_text(
        json.dumps({"phase": "rl", "step": 1, "total": 30, "s_per_step": 2.0, "eta_s": 58})
    )
    assert run_status("GRPO seed 0", a, "rl", 30) == (
        "GRPO seed 0: rl 1/30, 2.00 s/step, ETA 0:58, reward 0.500, held-out acc 25.0%"
    )
    status.ended_run("GSPO seed 0", "done", wall_s=100.0)
    assert status.status().startswith("1/3 runs ended, ETA 3:20 |")  # 2 runs left, one at a time, 100 s each
    b.mkdir()
    status.started("SFT start", b, "sft", 300, b / "log", quiet=True)
    (b / "progress.json").write_text(
        json.dumps({"phase": "sft", "step": 12, "total": 300, "s_per_step": 0.5, "eta_s": 144})
    )
    (b / "metrics.jsonl").write_text(json.dumps({"stage": "sft", "step": 11, "loss": 1.25}) + "\n")
    assert "SFT start: sft 12/300, 0.50 s/step, ETA 2:24, loss 1.250" in status.status()


def test_report_names_the_picture_it_wrote(tmp_path, capsys):
    """``--out runs/x`` (no suffix): matplotlib writes runs/x.png, and that is the name printed; the
    report's table shows rates in percent."""
    from moe_rl.cli import main

    run = tmp_path / "grpo"
    run.mkdir()
    rows = [{"stage": "rl", "step": i, "reward/mean": 0.1 * i, "flip/step/rate": 0.0068} for i in range(3)]
    rows.append({"stage": "rl_eval", "step": 3, "eval/accuracy": 0.27})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(run), "--out", str(tmp_path / "rep" / "x")]) == 0
    out = capsys.readouterr().out
    png = tmp_path / "rep" / "x.png"
    assert png.is_file() and f"curves: {png};" in out, out
    assert "27.0%" in out and "0.680%" in out, out
