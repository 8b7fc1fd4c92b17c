"""DP=2 (gloo, two processes): the RL step's collectives get device tensors only (issue 27).

NCCL reduces CUDA tensors only; the cluster recipes run data_parallel 8. Each rank of a DP=2 run
keeps its policy on the pretend accelerator of :mod:`tests.device_ledger` and checks every
torch.distributed collective it makes during one RL step and the evaluation: no host tensor may
reach one, and no op may mix devices.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
WORKER = str(Path(__file__).with_name("device_worker.py"))
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("algo,routing", [("grpo", "r2"), ("gspo", "r3")])
def test_dp2_collectives_take_device_tensors(tmp_path, algo, routing):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        WORKER,
        str(tmp_path),
        algo,
        routing,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert r["dp_size"] == 2 and r["skipped"] == 0
        assert r["mixes"] == []
        assert r["off"] == []
