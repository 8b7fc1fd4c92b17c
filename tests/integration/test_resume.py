"""kill -9 mid-run, then --resume: the run continues exactly (same rollouts and losses on CPU)."""

import os
import signal
import subprocess
import sys
import time

import yaml

from moe_rl.trainer.metrics import read_metrics
from tests.tiny import TINY_E2E

RECIPE = {
    **TINY_E2E,
    "algo": {"name": "grpo", "routing": "r2"},
    "train": {**TINY_E2E["train"], "sft_steps": 4, "rl_steps": 5, "temperature": 1.5},
    "checkpoint": {"every": 2},
}
KEYS = ("reward/mean", "loss/pg", "ratio/token_max", "grad_norm", "flip/step/rate", "response/len_mean")


def _train(recipe, *extra):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    # its own process group, so that kill -9 takes its helper processes down with it (as a
    # job scheduler does); megatron's checkpoint writer starts a multiprocessing Manager
    return subprocess.Popen(
        [sys.executable, "-m", "moe_rl.cli", "train", str(recipe), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _rl_rows(out):
    rows = {}
    for r in read_metrics(out / "metrics.jsonl", "rl"):
        rows[r["step"]] = r  # a step re-run after resume replaces the killed attempt's row
    return rows


def test_kill9_then_resume_continues_exactly(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    for d in (ref_dir, cut_dir):
        rec = {**RECIPE, "train": {**RECIPE["train"], "out_dir": str(d)}}
        (tmp_path / f"{d.name}.yaml").write_text(yaml.safe_dump(rec))
    ref = _train(tmp_path / "ref.yaml")
    assert ref.wait(timeout=600) == 0, ref.stderr.read()[-3000:]

    cut = _train(tmp_path / "cut.yaml")
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once RL step 2's checkpoint is down and step 3 started
        rows = _rl_rows(cut_dir) if (cut_dir / "metrics.jsonl").exists() else {}
        if 2 in rows:
            break
        assert cut.poll() is None, cut.stderr.read()[-3000:]
        time.sleep(0.2)
    os.killpg(cut.pid, signal.SIGKILL)
    cut.wait()
    res = _train(tmp_path / "cut.yaml", "--resume")
    assert res.wait(timeout=600) == 0, res.stderr.read()[-3000:]

    # --resume cut the rows the killed run wrote after its checkpoint: every step once
    steps = [r["step"] for r in read_metrics(cut_dir / "metrics.jsonl", "rl")]
    assert steps == [0, 1, 2, 3, 4], steps
    want, got = _rl_rows(ref_dir), _rl_rows(cut_dir)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3, 4]
    for step in want:
        for k in KEYS:
            assert got[step][k] == want[step][k], (step, k, got[step][k], want[step][k])
