"""Long runs are informative, not noisy (issue 33, item 11): a bar on a terminal, plain lines every
``train.log_every`` steps in a log file, flip rates marked as percentages, and under torchrun one
set of lines (rank 0's; other ranks warnings only, each line naming its rank)."""

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_rl.trainer import context
from moe_rl.trainer.context import Run

ROOT = Path(__file__).resolve().parents[2]
RL = {"reward/mean": 0.875, "reward/accuracy": 0.9, "flip/step/rate": 0.0012, "time/step": 2.06}


def _run(rank=0, log_every=2):
    return SimpleNamespace(
        info=SimpleNamespace(rank=rank),
        _bar=None,
        recipe=SimpleNamespace(train=SimpleNamespace(log_every=log_every)),
    )


def test_in_a_log_file_progress_is_plain_lines_every_log_every_steps(caplog, monkeypatch):
    monkeypatch.setattr(context, "_stderr_is_terminal", lambda: False)
    run = _run()
    with caplog.at_level(logging.INFO, logger=context.__name__):
        for step in range(5):
            Run.progress(run, "rl", step, 5, RL)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"rl step {s}/5 reward 0.875 acc 0.90 flip/step 0.12% s/step 2.1" for s in (1, 3, 5)]
    assert run._bar is None


def test_on_a_terminal_progress_is_one_bar_per_stage(monkeypatch):
    monkeypatch.setattr(context, "_stderr_is_terminal", lambda: True)
    run = _run()
    Run.progress(run, "sft", 0, 3, {"loss": 1.5, "grad_norm": 0.3, "step_s": 0.1})
    sft_bar = run._bar
    assert (
        sft_bar.desc == "sft"
        and sft_bar.n == 1
        and sft_bar.postfix == "loss=1.5000, grad_norm=0.300, s/step=0.10"
    )
    Run.progress(run, "rl", 0, 5, RL)
    assert run._bar is not sft_bar and run._bar.desc == "rl" and "flip/step=0.12%" in run._bar.postfix
    run._bar.close()


def test_only_rank_0_shows_progress(caplog, monkeypatch):
    monkeypatch.setattr(context, "_stderr_is_terminal", lambda: False)
    with caplog.at_level(logging.INFO, logger=context.__name__):
        Run.progress(_run(rank=1), "rl", 0, 5, RL)
    assert not caplog.records


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
