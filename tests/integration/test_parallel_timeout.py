"""``parallel.timeout_s`` bounds a hung rank in every group: torch's default group and
megatron-core's model-parallel groups, to the second (it was rounded to whole minutes)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import datetime
import megatron.core.parallel_state as ps
import torch.distributed.distributed_c10d as c10d
from moe_rl.config import ParallelConfig
from moe_rl.megatron.parallel import init_parallel

seen = []
real = c10d.new_group
def spy(*args, **kwargs):
    seen.append(kwargs.get("timeout"))
    return real(*args, **kwargs)
c10d.new_group = spy
ps.torch.distributed.new_group = spy
init_parallel(ParallelConfig(timeout_s=7.0), seed=0)
assert seen, "megatron-core made no group"
print(sorted({t.total_seconds() for t in seen if t is not None}))
"""


def test_megatron_groups_time_out_after_parallel_timeout_s():
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[7.0]", res.stdout
