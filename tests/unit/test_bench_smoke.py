"""The volatility and collapse benchmarks: smoke presets end to end, and the collapse criterion."""

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks/ is a package there

from benchmarks.collapse import CRITERION, collapse_verdict, held_out_drop, smoothed


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


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_cache")


def _png(path):
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_volatility_smoke(tmp_path, cache, parallel_info):
    from benchmarks.volatility import main

    out = tmp_path / "vol.json"
    main(["--preset", "smoke", "--out", str(out), "--cache", str(cache)])
    doc = json.loads(out.read_text())
    _png(out.with_suffix(".png"))
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


def test_collapse_smoke(tmp_path, cache, parallel_info):
    from benchmarks.collapse import main

    out = tmp_path / "collapse.json"
    main(
        ["--preset", "smoke", "--out", str(out), "--cache", str(cache), "--runs-dir", str(tmp_path / "runs")]
    )
    doc = json.loads(out.read_text())
    _png(out.with_suffix(".png"))
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
            str(cache),
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
    )
    assert [r["reward"] for r in again["runs"]] == [r["reward"] for r in doc["runs"]]
    assert again["wall_s"] < doc["wall_s"]


def test_engine_throughput_smoke(tmp_path):
    """benchmarks/engine_throughput.py at a smoke size: both decoders, the naive loop, JSON + PNG."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.engine_throughput",
        "--batch",
        "4",
        "--new-tokens",
        "4",
        "--prompt-len",
        "4",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    res = subprocess.run(
        cmd,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (path,) = tmp_path.glob("engine_throughput-*.json")
    data = json.loads(path.read_text())
    assert path.with_suffix(".png").exists()
    assert data["naive_recompute_greedy"]["same_tokens_as_engine"]
    assert set(data["decoders"]) == {"lean", "megatron"}
    for case in ("engine_greedy", "megatron_engine_greedy", "engine_sampled"):
        assert data[case]["generated_tokens"] == 16 and data[case]["tokens_per_cpu_s"] > 0


def test_mismatch_smoke(tmp_path, cache, parallel_info):
    """benchmarks/mismatch.py: every cell measured, fp32 exact, bf16 not; a rerun reuses the cells."""
    from benchmarks.mismatch import main

    out = tmp_path / "mismatch.json"
    doc = main(["--preset", "smoke", "--out", str(out), "--cache", str(cache)])
    _png(out.with_suffix(".png"))
    assert json.loads(out.read_text())["headline"] == doc["headline"]
    assert set(doc["cells"]) == {"smoke-fp32-same-8", "smoke-bf16-same-8", "smoke-bf16-fp32-8"}
    fp32, bf16 = doc["headline"]["smoke/fp32"], doc["headline"]["smoke/bf16"]
    assert fp32["router_disagreement"] == 0 and fp32["abs_log_ratio"] < 1e-5
    assert bf16["abs_log_ratio"] > 100 * max(fp32["abs_log_ratio"], 1e-9) and bf16["tokens_per_cpu_s"] > 0
    again = main(["--preset", "smoke", "--out", str(tmp_path / "again.json"), "--cache", str(cache)])
    assert again["cells"] == doc["cells"]  # resumed from the saved cells


def test_collapse_report_only_counts_only_finished_runs(tmp_path):
    """``--report-only`` used to count an arm with no run folder as a finished run ("0/1
    collapsed"); a run that never finished is left out and listed."""
    from benchmarks import collapse

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
        ("step_time", ["--threads", "0"], "--threads"),
    ],
)
def test_a_count_flag_below_one_is_a_usage_error(module, argv, flag, capsys):
    """Every count a benchmark takes is checked (a zero or negative count used to run nothing or
    fail later)."""
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
