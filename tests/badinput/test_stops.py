"""Issue 47, item 3: a stop signal in every phase of every command ends it with one
``moe-rl: stopped:`` line and 128 + the signal, nothing half-written left, and the same command
continues.

In this process (real signals to this process, raised where the phase runs); one subprocess case
for the phases before a step loop (``train`` building its model) is in the integration tier.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.badinput.conftest import ROOT, run_cli, snapshot
from tests.badinput.test_nothing_lost import compare, one_line

signal_case = pytest.mark.bad_input("signal")


@signal_case
def test_sigterm_while_the_sft_start_writes_its_last_checkpoint_stops_the_comparison(
    tmp_path, parallel_info, monkeypatch
):
    """The start's trainer logged the signal and dropped it: compare ran both arms and exited 0.
    Now the comparison starts no run, ends with 143 and one line, and the same command continues."""
    from moe_rl.trainer.context import Run

    save = Run.save

    def save_under_sigterm(self):
        if self.state.stage == "sft" and not getattr(save_under_sigterm, "sent", False):
            save_under_sigterm.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is written
        return save(self)

    monkeypatch.setattr(Run, "save", save_under_sigterm)
    out = tmp_path / "out"
    code, stdout, err = compare(out)
    assert code == 128 + signal.SIGTERM, err
    assert one_line(err).startswith("moe-rl: stopped: SIGTERM received")
    assert not list(out.glob("*/s0/status.json")) and ": started" not in stdout.split("SFT start: done")[-1]
    monkeypatch.setattr(Run, "save", save)
    code, stdout, err = compare(out)  # the same command continues
    assert code == 0, err
    assert len(list(out.glob("*/s0/status.json"))) == 2
    assert "SFT start: reusing" in stdout or "SFT start: done" in stdout


@signal_case
def test_sigterm_during_an_export_write_leaves_no_staging_and_is_one_line(cli, tmp_path, monkeypatch):
    """Killed by SIGTERM, export exited -15 with no line and left its staging folder."""
    from moe_rl.hf_io import ShardWriter
    from tests.badinput.test_outputs_checkpoints import recipe

    add = ShardWriter.add

    def add_under_sigterm(self, name, t):
        os.kill(os.getpid(), signal.SIGTERM)
        return add(self, name, t)

    monkeypatch.setattr(ShardWriter, "add", add_under_sigterm)
    r = recipe(tmp_path)
    res = cli("export", r, tmp_path / "hf", "--random-init")
    res.one_line(r"stopped: SIGTERM received", code=128 + signal.SIGTERM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # no export, no staging
    monkeypatch.setattr(ShardWriter, "add", add)
    assert cli("export", r, tmp_path / "hf", "--random-init").code == 0  # the same command continues


@signal_case
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_stop_signal_while_a_report_plots_is_one_line(cli, tmp_path, monkeypatch, signum):
    """Ctrl-C (or a closed terminal) in a command with no step loop: one line, 128 + the signal,
    and no half-written picture."""
    import moe_rl.lab.report as report

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"stage": "rl", "step": s, "reward/mean": 0.1 * s, "flip/step/rate": 0.01 * s} for s in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot = report.plot

    def plot_under_signal(arms, out_png):
        os.kill(os.getpid(), signum)
        return plot(arms, out_png)

    monkeypatch.setattr(report, "plot", plot_under_signal)
    before = snapshot(tmp_path)
    cli("report", run, "--out", tmp_path / "r.png").one_line(
        rf"stopped: {signal.Signals(signum).name} received", code=128 + signum
    )
    assert snapshot(tmp_path) == before


@signal_case
def test_bench_passes_a_stop_signal_on_and_ends_with_one_line(cli, monkeypatch):
    """``moe-rl bench``'s child gets the signal (it ends cleanly, by its own handler) and the
    command ends with 128 + the signal; a child killed outright still gives one line."""
    import moe_rl.lab.runner as runner

    def child_killed(cmd, env=None, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # forwarded to the live children: none here
        raise subprocess.CalledProcessError(-signal.SIGTERM, cmd)

    monkeypatch.setattr(runner, "run_child", child_killed)
    cli("bench", "startup").one_line(r"stopped: benchmark startup stopped \(exit status 143\)", code=143)


@pytest.mark.integration
@signal_case
def test_sigterm_while_train_builds_its_model_is_one_line_and_the_same_command_runs(tmp_path):
    """Before any step (imports, process group, policy): the default SIGTERM ended the process with
    -15 and no line. A real ``moe-rl train`` signalled as soon as it announces its run folder."""
    from tests.badinput.test_outputs_checkpoints import recipe

    r = recipe(tmp_path, sft_steps=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "moe_rl.cli", "train", str(r)],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (tmp_path / "run" / ".moe-rl.lock").exists():  # taken before the model is built
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert one_line(err).startswith("moe-rl: stopped: SIGTERM received")
    assert not list((tmp_path / "run").glob("**/.tmp-*"))
    assert run_cli("train", r, cwd=tmp_path).code == 0  # the same command runs
