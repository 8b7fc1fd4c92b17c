"""``moe-rl compare``: every arm's every seed from one SFT start, the seed-paired table in four forms,
a rerun that skips what finished, one-line errors, and signals passed on to the child runs."""

import contextlib
import csv
import io
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from moe_rl.cli import main
from moe_rl.lab import compare, compare_plot, runner
from moe_rl.lab.arms import ARMS, COMPARE_ARMS, DEMO, FIRST_SEED
from moe_rl.lab.stats import paired
from tests.tiny import COMPARE_TINY as TINY

ARMS_2 = ["GRPO", "GSPO"]


def _compare(out, *extra: str) -> tuple[int, str, str]:
    """``moe-rl compare`` of the two arms x 2 seeds, one at a time in this process: exit code,
    stdout, stderr."""
    argv = ["compare", str(DEMO), "--arms", ",".join(ARMS_2), "--seeds", "2", "--jobs", "1", *TINY]
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main([*argv, "--out", str(out), *extra])
    return code, o.getvalue(), e.getvalue()


@pytest.fixture(scope="module")
def compared(tmp_path_factory, parallel_info):
    out = tmp_path_factory.mktemp("compare") / "out"
    code, stdout, stderr = _compare(out)
    assert code == 0, stderr
    return out, stdout


def test_every_arm_and_seed_runs_from_one_start_and_the_table_is_written(compared):
    from moe_rl.config import load_recipe

    out, stdout = compared
    # one SFT start, trained once into the folder's cache; every run is RL from it, seed s the same
    # train.seed / task.seed in both arms
    starts = [p for p in (out / "starts").iterdir() if p.is_dir()]
    assert len(starts) == 1 and (starts[0] / "sft.json").is_file()
    for arm in ARMS_2:
        for s in (0, 1):
            run = out / arm.lower() / f"s{s}"
            r = load_recipe(run / "recipe.yaml")
            assert list(r.train.stages) == ["rl"]
            assert r.checkpoint.load == str(starts[0] / "checkpoints")
            assert (r.train.seed, r.task.seed) == (FIRST_SEED + s, s)
            assert r.algo.name == ARMS[arm]["algo"]["name"]
            assert json.loads((run / "status.json").read_text())["status"] == "done"
            assert f"{arm} seed {s}: started" in stdout and f"{arm} seed {s}: done" in stdout

    doc = json.loads((out / "compare.json").read_text())
    assert [r["arm"] for r in doc["rows"]] == ARMS_2 and doc["failed"] == []
    ref, other = doc["runs"]["GRPO"], doc["runs"]["GSPO"]
    assert sorted(ref) == sorted(other) == ["0", "1"]
    for m in compare.METRICS:  # JSON null: not measured
        assert all(run[m] is not None for run in (*ref.values(), *other.values())), m
        want = paired([other[s][m] - ref[s][m] for s in ("0", "1")])
        got = doc["rows"][1]["diff"][m]
        assert got["n"] == 2 and got["mean"] == pytest.approx(want["mean"], abs=1e-12), m
        assert doc["rows"][0][m] == pytest.approx((ref["0"][m] + ref["1"][m]) / 2, abs=1e-12), m
    assert "diff" not in doc["rows"][0]

    with open(out / "compare.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["arm"] for r in rows] == ARMS_2
    assert (
        rows[0]["d_reward_mean"] == "" and rows[1]["d_reward_vs"] == "GRPO" and rows[1]["d_reward_n"] == "2"
    )
    md = (out / "compare.md").read_text()
    assert sum(line.startswith(("| GRPO |", "| GSPO |")) for line in md.splitlines()) == 2
    assert (out / "compare.png").stat().st_size > 10_000
    table = stdout.split("reward - GRPO", 1)[1]
    assert "\nGRPO " in table and "\nGSPO " in table


def test_a_rerun_skips_the_finished_runs(compared, monkeypatch):
    out, _ = compared
    before = json.loads((out / "compare.json").read_text())["rows"]

    def no_training(*a, **k):
        raise AssertionError("a finished run or start trained again")

    monkeypatch.setattr(runner, "run_arm", no_training)
    monkeypatch.setattr("moe_rl.lab.starts.run_recipe", no_training)
    code, stdout, stderr = _compare(out)
    assert code == 0, stderr
    assert stdout.count("finished earlier, skipped") == 4 and "SFT start: reusing" in stdout
    assert ": started" not in stdout
    assert json.loads((out / "compare.json").read_text())["rows"] == before

    # a run whose status file is gone is run again (it resumes from its last checkpoint), alone
    (out / "gspo" / "s1" / runner.STATUS_FILE).unlink()
    calls = []
    monkeypatch.setattr(
        runner, "run_arm", lambda *a, **k: calls.append(a[2]) or {"status": "failed", "reason": "x"}
    )
    code, stdout, _ = _compare(out)
    assert calls == [out / "gspo" / "s1"] and code == 1
    assert stdout.count("finished earlier, skipped") == 3


def test_the_paired_difference_pairs_runs_by_seed():
    """Seed s of an arm is compared with seed s of the first arm: not by position in any order, and
    over the seeds both ran (seed 0 of GSPO failed here)."""

    def v(r, a):
        return {
            "reward": r,
            "accuracy": a,
            "auc": a,
            "outlier_steps": 0.1,
            "flip_step": 0.01,
            "flip_drift": 0.02,
        }

    values = {
        "GRPO": {0: v(0.05, 0.5), 1: v(0.1, 0.3), 2: v(0.5, 0.8), 3: v(0.4, 0.2)},
        "GSPO": {1: v(0.6, 0.1), 2: v(0.2, 0.9), 3: v(0.7, 0.4)},
        "GRPO+R3": {3: v(0.1, 0.1), 0: v(0.95, 0.6), 2: v(0.3, 0.7), 1: v(0.8, 0.2)},  # in no order
    }
    rows = compare.seed_table(values, ["GRPO", "GSPO", "GRPO+R3"])
    assert [r["arm"] for r in rows] == ["GRPO", "GSPO", "GRPO+R3"] and [r["seeds"] for r in rows] == [4, 3, 4]
    gspo, r3 = rows[1]["diff"], rows[2]["diff"]
    assert gspo["reward"]["n"] == gspo["accuracy"]["n"] == 3
    for m, diffs in {
        "reward": [0.6 - 0.1, 0.2 - 0.5, 0.7 - 0.4],
        "accuracy": [0.1 - 0.3, 0.9 - 0.8, 0.4 - 0.2],
    }.items():
        want = paired(diffs)
        assert gspo[m]["mean"] == pytest.approx(want["mean"]) and gspo[m]["sd"] == pytest.approx(
            want["sd"]
        ), m
        assert gspo[m]["ci95"] == pytest.approx(want["ci95"]), m
    want = paired([0.95 - 0.05, 0.8 - 0.1, 0.3 - 0.5, 0.1 - 0.4])
    assert r3["reward"]["ci95"] == pytest.approx(want["ci95"]) and r3["reward"]["p"] == pytest.approx(
        want["p"]
    )
    assert rows[0]["reward"] == pytest.approx((0.05 + 0.1 + 0.5 + 0.4) / 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arms", "GRPO,GRPO+R9"], "--arms: unknown arm 'GRPO+R9': use one of " + ", ".join(COMPARE_ARMS)),
        (["--arms", "GRPO,grpo"], "--arms: GRPO is named twice: give each arm once"),
        (["--arms", ""], "--arms '': give comma-separated arms of " + ", ".join(COMPARE_ARMS)),
        (["--seeds", "0"], "--seeds '0': give a whole number >= 1 (how many seeds each arm runs)"),
        (["--seeds", "two"], "--seeds 'two': give a whole number >= 1 (how many seeds each arm runs)"),
        (["--jobs", "-1"], "--jobs '-1': give a whole number >= 1 (how many runs train at a time)"),
        (
            ["--seeds", "9001,x"],
            "--seeds '9001,x': give a count (3) or seeds >= 0 separated by commas (9001,9002,9003)",
        ),
        (
            ["--seeds=-1,2"],
            "--seeds '-1,2': give a count (3) or seeds >= 0 separated by commas (9001,9002,9003)",
        ),
        (["--seeds", "5,5"], "--seeds '5,5' names a seed twice: give each once"),
    ],
)
def test_a_bad_arm_or_count_is_one_line(tmp_path, capsys, args, message):
    code = main(["compare", str(DEMO), *args, "--out", str(tmp_path / "out"), *TINY])
    err = capsys.readouterr().err
    assert code == 2 and err == f"moe-rl: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_a_recipe_without_a_start_is_refused(tmp_path, capsys):
    code = main(["compare", str(DEMO), "train.stages=[rl]", "--out", str(tmp_path / "out"), *TINY])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the arms would begin from random weights" in err


CHILD = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
def stop(signum, frame):
    out.write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
Path(str(out) + ".ready").write_text("")
time.sleep(30)
"""


@pytest.mark.integration
def test_a_stop_signal_is_passed_on_to_every_child_run(tmp_path):
    """SIGTERM to the command reaches each child run_child waits on (each ends as a trainer does on
    it: 128 + the signal), and one started after it gets it at once; the command records it."""

    def child(name):
        try:
            runner.run_child([sys.executable, "-c", CHILD, str(tmp_path / name)])
        except subprocess.CalledProcessError as e:
            return e.returncode
        return 0

    codes = {}
    with runner.forwarding_signals() as stop:
        threads = [threading.Thread(target=lambda n=n: codes.update({n: child(n)})) for n in ("a", "b")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"{n}.ready").exists() for n in ("a", "b")) and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.raise_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert stop.signum == signal.SIGTERM
        late = child("c")  # started after the stop: signalled at once (before its handler: killed)
    assert codes == {"a": 128 + signal.SIGTERM, "b": 128 + signal.SIGTERM}
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() == str(int(signal.SIGTERM))
    assert late in (128 + signal.SIGTERM, -signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is not None and not runner._LIVE


def test_a_runs_table_values_hold_its_accuracy_auc_and_its_share_of_ratio_outlier_steps(tmp_path):
    """The table reads, per run, the held-out accuracy averaged over training (the trapezoid over
    its evaluations) and the share of RL steps with any token ratio outside [0.5, 2] (steps that
    did not log it left out); the picture's running share ends at the table's value."""
    rows = [{"stage": "rl_eval", "step": 0, "eval/accuracy": 0.2}]
    fracs = [0.0, 1e-4, None, 0.0, 0.03]
    for step, f in enumerate(fracs):
        r = {"stage": "rl", "step": step, "reward/mean": 0.5}
        if f is not None:
            r["ratio/token_frac_outside_0.5_2"] = f
        rows.append(r)
    rows[3]["eval/accuracy"] = 0.4  # taken after step 2: the weights of 3 updates
    rows.append({"stage": "rl_eval", "step": 5, "eval/accuracy": 0.3})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    v = compare.run_values(tmp_path)
    assert v["outlier_steps"] == pytest.approx(2 / 4)
    assert v["auc"] == pytest.approx((3 * (0.2 + 0.4) / 2 + 2 * (0.4 + 0.3) / 2) / 5)
    xs, share = compare_plot.running_outlier_share(runner.read_arm(tmp_path)["rl"])
    assert xs == [0, 1, 3, 4] and share == pytest.approx([0, 1 / 2, 1 / 3, 2 / 4])
