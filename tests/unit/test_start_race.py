"""Two sweeps sharing the SFT-start cache: the second waits for the start the first is training
instead of clearing its folder (seen in issue 31's sweep: the first writer died with ENOENT)."""

from __future__ import annotations

import threading
import time

from moe_rl.lab.starts import wait_while_trained_elsewhere
from moe_rl.trainer.run_lock import held_by, hold_run_dir


def test_a_held_start_is_waited_for_and_a_free_one_is_not(tmp_path):
    root = tmp_path / "start"
    assert held_by(root) is None
    entered, release = threading.Event(), threading.Event()

    def trainer():
        with hold_run_dir(root, rank=0):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=trainer)
    t.start()
    entered.wait(5)
    try:
        assert held_by(root)["pid"] is not None
        threading.Timer(0.3, release.set).start()
        t0 = time.perf_counter()
        wait_while_trained_elsewhere(root, poll_s=0.05)
        assert time.perf_counter() - t0 >= 0.25  # waited for the holder
    finally:
        release.set()
        t.join()
    assert held_by(root) is None
    t0 = time.perf_counter()
    wait_while_trained_elsewhere(root, poll_s=5)
    assert time.perf_counter() - t0 < 1
