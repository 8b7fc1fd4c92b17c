"""Long runs are informative, not noisy (issue 33, item 11): a bar on a terminal, plain lines every
``train.log_every`` steps in a log file, flip rates marked as percentages, and under torchrun one
set of lines (rank 0's; other ranks warnings only, each line naming its rank). Issue 49: slow told
from stuck: every phase named as it begins, each step line with seconds per step and the time left."""

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_rl.trainer import progress
from moe_rl.trainer.context import Run

ROOT = Path(__file__).resolve().parents[2]
RL = {"reward/mean": 0.875, "reward/accuracy": 0.9, "flip/step/rate": 0.0012, "time/step": 2.06}


def _run(tmp_path, rank=0, log_every=2):
    phases = progress.Progress(tmp_path, enabled=rank == 0, log_every=log_every)
    return SimpleNamespace(phases=phases)


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock that advances 2 s per reading after the first: 2 s per step."""
    now = [100.0]

    def tick():
        now[0] += 2.0
        return now[0]

    monkeypatch.setattr(progress.time, "monotonic", tick)


def test_in_a_log_file_progress_is_plain_lines_every_log_every_steps(tmp_path, caplog, monkeypatch, clock):
    """Issue 49: each line has step / total, seconds per step and the time left; the phase is named
    when it begins; rates in percent."""
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: False)
    run = _run(tmp_path)
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        for step in range(5):
            Run.progress(run, "rl", step, 5, RL)
    lines = [r.getMessage() for r in caplog.records]
    eta = {1: "0:08", 3: "0:04", 5: "0:00"}
    assert lines == ["phase: rl, 5 steps"] + [
        f"rl step {s}/5 | 2.00 s/step | ETA {eta[s]} | reward 0.875 acc 90.0% flip/step 0.12%"
        for s in (1, 3, 5)
    ]
    assert run.phases._bar is None
    doc = progress.read_progress_file(tmp_path)
    assert (doc["phase"], doc["step"], doc["total"], doc["s_per_step"], doc["eta_s"]) == (
        "rl",
        5,
        5,
        2.0,
        0.0,
    )


def test_on_a_terminal_progress_is_one_bar_per_stage(tmp_path, monkeypatch, clock):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    run = _run(tmp_path)
    Run.progress(run, "sft", 0, 3, {"loss": 1.5, "grad_norm": 0.3, "step_s": 0.1})
    sft_bar = run.phases._bar
    assert sft_bar.desc == "sft" and sft_bar.n == 1 and sft_bar.postfix == "loss=1.5000, grad_norm=0.300"
    Run.progress(run, "rl", 0, 5, RL)
    bar = run.phases._bar
    assert (
        bar is not sft_bar
        and bar.desc == "rl"
        and "flip/step=0.12%" in bar.postfix
        and "acc=90.0%" in bar.postfix
    )
    assert bar.unit == "step"  # tqdm's own rate (s/step) and ETA
    run.phases.close()


def test_only_rank_0_shows_progress(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: False)
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        Run.progress(_run(tmp_path, rank=1), "rl", 0, 5, RL)
    assert not caplog.records and not (tmp_path / progress.PROGRESS_FILE).exists()


def test_every_phase_of_a_run_is_named(tmp_path, caplog, parallel_info):
    """A run from the start to the end names each phase as it begins: the start (process groups,
    policy), SFT, the checkpoint, the RL step-0 evaluation, RL, the final evaluation, done."""
    from moe_rl.trainer.run import run
    from tests.tiny import tiny_e2e as tiny

    with caplog.at_level(logging.INFO, logger=progress.__name__):
        run(tiny(tmp_path, train={"sft_steps": 2, "rl_steps": 1}))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("phase: ")]
    assert [s.split(" (")[0].split(",")[0] for s in said] == [
        "phase: start",
        "phase: sft",
        "phase: checkpoint",
        "phase: rl step-0 evaluation",
        "phase: rl",
        "phase: rl final evaluation",
        "phase: checkpoint",
        "phase: done",
    ], said
    assert not (tmp_path / "run" / progress.PROGRESS_FILE).exists()  # it lives as long as the run


@pytest.mark.integration
def test_under_torchrun_other_ranks_log_warnings_only_and_name_their_rank():
    code = (
        "import logging; from moe_rl.cli import _setup_logging; _setup_logging(False); "
        "logging.getLogger('moe_rl.x').info('info line'); logging.getLogger('moe_rl.x').warning('warning line'); "
        "logging.getLogger('moe_rl.rank').info('start line')"
    )
    out = {}
    for rank in ("0", "1"):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": rank, "PYTHONPATH": str(ROOT)}
        out[rank] = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        ).stderr
    assert "[rank 0] INFO moe_rl.x: info line" in out["0"] and "[rank 0] WARNING" in out["0"]
    assert "info line" not in out["1"] and "[rank 1] WARNING moe_rl.x: warning line" in out["1"]
    assert all(out[r].count("start line") == 1 for r in out)  # every rank's one start line
