"""The collapse study's volatility and collapse drivers: smoke presets end to end, resume, and
their command lines."""

import json
from pathlib import Path

import pytest


def test_volatility_smoke(tmp_path, sft_cache, png, parallel_info):
    from studies.collapse.volatility import main

    out = tmp_path / "vol.json"
    main(["--preset", "smoke", "--out", str(out), "--cache", str(sft_cache)])
    doc = json.loads(out.read_text())
    png(out.with_suffix(".png"))
    assert doc["bench"] == "volatility" and doc["where_10pct"]["text"]
    cfgs = doc["configs"]
    assert {c["group"] for c in cfgs} == {"depth", "algo", "experts", "topk"}
    assert {c["algo"] for c in cfgs} == {"GRPO", "GRPO+R2", "GSPO"}
    m = doc["settings"]["base"]["train"]["minibatches"]
    for c in cfgs:
        assert len(c["drift_by_j"]) == m and len(c["flip_step"]["layers"]) == c["layers"]
        assert 0.0 <= c["flip_step"]["rate"] <= c["flip_step"]["token_any"] <= 1.0
    # real RL gradients move the routes: some configuration flips, and drift grows with the updates
    assert max(c["flip_step"]["rate"] for c in cfgs) > 0
    assert any(c["drift_by_j"][-1] >= c["drift_by_j"][0] > 0 for c in cfgs)


def test_collapse_smoke(tmp_path, sft_cache, png, parallel_info):
    from studies.collapse.collapse import main

    out = tmp_path / "collapse.json"
    main(
        [
            "--preset",
            "smoke",
            "--out",
            str(out),
            "--cache",
            str(sft_cache),
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
    )
    doc = json.loads(out.read_text())
    png(out.with_suffix(".png"))
    assert list(doc["arms"]) == ["GRPO", "GRPO+R2", "GRPO+R3", "GRPO+TIS", "GSPO", "GSPO+R2"]
    for run in doc["runs"]:
        assert run["status"] == "done" and len(run["reward"]) == 3
        assert run["verdict"]["state"] in ("fine", "never_good", "unresolved", "collapsed")
    for a in doc["arms"].values():
        assert a["runs"] == 1 and 0 <= a["clip_token"] <= 1 and 0 <= a["clip_seq"] <= 1
    assert doc["criterion"]["window"] == 10 and doc["table"]
    # resumable: every finished run left its status; a rerun skips them and reads the same runs
    assert all((Path(r["out_dir"]) / "status.json").exists() for r in doc["runs"])
    again = main(
        [
            "--preset",
            "smoke",
            "--out",
            str(tmp_path / "again.json"),
            "--cache",
            str(sft_cache),
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
    )
    assert [r["reward"] for r in again["runs"]] == [r["reward"] for r in doc["runs"]]
    assert again["wall_s"] < doc["wall_s"]


def test_collapse_report_only_counts_only_finished_runs(tmp_path):
    """``--report-only`` used to count an arm with no run folder as a finished run ("0/1
    collapsed"); a run that never finished is left out and listed."""
    from studies.collapse import collapse

    doc = collapse.main(
        [
            "--preset",
            "smoke",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--report-only",
            "--out",
            str(tmp_path / "c.json"),
        ]
    )
    assert doc["runs"] == [] and doc["arms"] == {}
    assert len(doc["runs_unfinished"]) == doc["runs_planned"] > 0


@pytest.mark.parametrize(
    "module, argv, flag",
    [
        ("collapse", ["--jobs", "0"], "--jobs"),
        ("collapse", ["--seeds", "-1"], "--seeds"),
        ("phase", ["--jobs", "x"], "--jobs"),
    ],
)
def test_a_count_flag_below_one_is_a_usage_error(module, argv, flag, capsys):
    """Every count a study takes is checked (a zero or negative count used to run nothing or
    fail later)."""
    import importlib

    mod = importlib.import_module(f"studies.collapse.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_the_collapse_curves_are_the_labs_panels():
    from moe_rl.lab.report import PANELS
    from studies.collapse import collapse

    assert set(collapse.CURVES) <= set(PANELS)
    assert collapse.PANELS is PANELS  # the lab's, not a copy
