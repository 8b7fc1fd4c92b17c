"""megatron-core's checkpoint-writer queue server survives SIGTERM and ends with its parent."""

import os
import signal
import subprocess
import sys
import time

CHILD = """
import os, signal, sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from moe_rl.megatron import ckpt_writer
ckpt_writer.signal_proof_writer_queue()
ckpt_writer.signal_proof_writer_queue()  # idempotent: one server
q, pid = fa._results_queue, ckpt_writer._WRITER_MANAGER._process.pid
# the queue megatron-core's writer takes (its getter renamed in 0.17)
assert (getattr(fa, "get_write_results_queue", None) or fa._get_write_results_queue)() is q
os.kill(pid, signal.SIGTERM)
time.sleep(0.5)
q.put("alive")
print(pid, q.get(), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_the_writer_queue_server_ignores_sigterm_and_exits_with_its_parent():
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid, answer = child.stdout.readline().split()
        assert answer == "alive"  # the server took the SIGTERM and still serves the queue
        pid = int(pid)
        assert not _gone(pid)
    finally:
        child.kill()
        child.wait()
    deadline = time.time() + 30
    while not _gone(pid) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert _gone(pid), "the server outlived its parent"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
