"""launch/slurm.sbatch on a real Slurm cluster: two CPU ranks (gloo) of recipes/tiny_ep2.yaml.

Skipped unless sbatch and slurmctld are installed and a cluster answers ``sinfo`` with an
idle node; CI makes one with ``sudo launch/ci_slurm_setup.sh`` (one node, localhost).
The job is submitted without --wait and polled with ``scontrol show job`` (the cluster keeps
no accounting) until it ends or the deadline passes, when it is cancelled.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).parents[2]
DEADLINE_S = 420
DONE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


@pytest.fixture(scope="module")
def slurm():
    missing = [c for c in ("sbatch", "slurmctld", "sinfo", "scontrol", "scancel") if shutil.which(c) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)}): run sudo launch/ci_slurm_setup.sh")
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.skip("sinfo did not answer in 15 s: no Slurm controller running")
    states = res.stdout.split()
    if res.returncode != 0 or not {"idle", "mixed"} & set(states):
        pytest.skip(f"no idle Slurm node (sinfo: {res.stdout.strip() or res.stderr.strip()})")


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def test_sbatch_runs_tiny_ep2_on_two_cpu_ranks(slurm, tmp_path):
    out = tmp_path / "run"
    env = {
        **os.environ,
        "NPROC": "2",
        "GPUS_PER_NODE": "0",
        "PYTHON": sys.executable,
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
    }
    for k in ("SGLANG_NODES", "MASTER_PORT"):
        env.pop(k, None)
    sub = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=1",
            "--gpus-per-node=0",
            "--time=10",
            "--job-name=moe-rl-test",
            f"--output={tmp_path}/%x-%j.out",
            "launch/slurm.sbatch",
            "recipes/tiny_ep2.yaml",
            "train.sft_steps=3",
            f"train.out_dir={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + DEADLINE_S
    fields = {}
    try:
        while time.monotonic() < deadline:
            fields = job_fields(job_id)
            if fields.get("JobState") in DONE:
                break
            time.sleep(1)
        else:
            pytest.fail(f"job {job_id} not done after {DEADLINE_S} s: {fields.get('JobState')}")
    finally:
        if fields.get("JobState") not in DONE:
            subprocess.run(["scancel", job_id])
    log_path = tmp_path / f"moe-rl-test-{job_id}.out"
    log = log_path.read_text() if log_path.exists() else "(no job log)"
    print(log)  # shown with pytest -s / on failure
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", (fields, log[-4000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [("sft", 0), ("sft", 1), ("sft", 2)]
    assert all(r["loss"] > 0 for r in rows)
    assert "world 2" in log and "sft step 3/3" in log
    assert "[rank0]:" in log and "[rank1]:" in log  # both ranks of the torchrun under srun
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "rng-0.pt").exists() and (ckpt / "rng-1.pt").exists()
    per_rank = out / "logs" / f"slurm-{job_id}" / "torchrun"
    assert len(list(per_rank.rglob("stderr.log"))) == 2
