"""A single-process run starts torch.distributed without a TCP port. It picked one with
``free_port()`` and bound it later; on the first lent GPU (H100, gpu_check's rl_step section, the
13th run of one process) another socket took the port in between and the run failed with
EADDRINUSE. Here the port ``free_port()`` returns is taken on purpose, as it was there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import socket
import torch.distributed as dist
import moe_rl.megatron.parallel as parallel
from moe_rl.config import ParallelConfig

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
port = taken.getsockname()[1]
parallel.free_port = lambda host="127.0.0.1": port  # the race, made certain
for _ in range(3):  # and again after a teardown, as one process running several runs does
    info = parallel.init_parallel(ParallelConfig(), seed=0)
    t = __import__("torch").ones(2)
    dist.all_reduce(t, group=info.dp_group)
    assert t.tolist() == [1.0, 1.0]
    parallel.destroy_parallel()
print("ok")
"""


def test_a_single_process_run_needs_no_free_port():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
