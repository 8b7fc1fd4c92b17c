"""SIGTERM / SIGINT / SIGHUP: a checkpoint at the next safe point, one log line, a clean exit, then --resume.

Real ``moe-rl train`` subprocesses of a tiny run, signalled once the first step is logged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moe_rl.megatron.checkpoint import checkpoint_dirs, verify_checkpoint
from moe_rl.trainer.metrics import read_metrics
from moe_rl.trainer.signals import StopSignals
from tests.badinput.conftest import ROOT, run_cli, snapshot
from tests.badinput.test_outputs_checkpoints import recipe


def _start(path: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with log.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "moe_rl.cli", "train", str(path), *extra],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )


def _rows(folder: Path, stage: str) -> list[int]:
    metrics = folder / "run/metrics.jsonl"
    return [r["step"] for r in read_metrics(metrics, stage)] if metrics.exists() else []


def _signal_after_first_row(
    proc: subprocess.Popen, folder: Path, stage: str, *signums: int, group: bool = False
) -> int:
    """Send ``signums`` (50 ms apart) once ``stage`` logged a row, to the trainer or (``group``) to
    its whole process group, helper processes included, as Slurm and ``kill -- -PGID`` do; the
    exit code."""
    deadline = time.time() + 300
    while not _rows(folder, stage):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.05)
    for s in signums:
        (os.killpg if group else os.kill)(proc.pid, s)
        time.sleep(0.05)
    return proc.wait(timeout=300)


def _live_in_group(pgid: int) -> list[str]:
    """The processes of process group ``pgid`` that have not ended (zombies, ended but not yet
    reaped by their new parent, are not counted): ``pid command`` each."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while listed
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if int(rest[2]) == pgid and rest[0] != "Z":
            live.append(f"{stat.parent.name} {name}")
    return live


def _newest(folder: Path) -> tuple[Path, dict]:
    ckpt = checkpoint_dirs(folder / "run/checkpoints")[-1]
    return ckpt, json.loads((ckpt / "meta.json").read_text())


def _stop_line(log: Path, name: str) -> str:
    """The trainer's logged stop line; the command's own one ``moe-rl: stopped:`` line repeats it."""
    text = log.read_text()
    lines = [
        ln for ln in text.splitlines() if f"{name}: stopped after" in ln and not ln.startswith("moe-rl:")
    ]
    assert len(lines) == 1, text[-3000:]
    said = [ln for ln in text.splitlines() if ln.startswith("moe-rl:")]
    assert len(said) == 1 and said[0].startswith(f"moe-rl: stopped: {name}: stopped after"), said
    assert "Traceback" not in text
    return lines[0]


@pytest.mark.bad_input("signal")
def test_sigterm_in_sft_checkpoints_the_stop_step_and_resume_continues(tmp_path):
    path = recipe(tmp_path, sft_steps=400, checkpoint={"every": 0})
    log = tmp_path / "log"
    code = _signal_after_first_row(_start(path, log), tmp_path, "sft", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    ckpt, meta = _newest(tmp_path)
    stop = meta["extra"]["step"]
    assert meta["extra"]["stage"] == "sft" and 1 <= stop < 400
    assert verify_checkpoint(ckpt) is None
    assert f"stopped after sft step {stop}, checkpoint {ckpt} written" in _stop_line(log, "SIGTERM")
    assert _rows(tmp_path, "sft") == list(range(stop))

    res = run_cli("train", path, f"train.sft_steps={stop + 2}", "--resume", cwd=tmp_path)
    assert res.code == 0, res.err[-3000:]
    assert _rows(tmp_path, "sft") == list(range(stop + 2))


def _stops_like_sigterm(tmp_path, signum: int) -> None:
    path = recipe(tmp_path, sft_steps=400, checkpoint={"every": 0})
    log = tmp_path / "log"
    code = _signal_after_first_row(_start(path, log), tmp_path, "sft", signum)
    assert code == 128 + signum, log.read_text()[-3000:]
    ckpt, meta = _newest(tmp_path)
    assert verify_checkpoint(ckpt) is None
    assert f"sft step {meta['extra']['step']}" in _stop_line(log, signal.Signals(signum).name)


@pytest.mark.bad_input("signal")
def test_sigint_stops_the_same_way_with_exit_130(tmp_path):
    _stops_like_sigterm(tmp_path, signal.SIGINT)


@pytest.mark.bad_input("signal")
def test_sighup_a_closed_terminal_stops_the_same_way_with_exit_129(tmp_path):
    _stops_like_sigterm(tmp_path, signal.SIGHUP)


def _slow_tee(tmp_path: Path) -> Path:
    """A folder holding a ``tee`` that writes as the real one, then takes 1 s to exit."""
    folder = tmp_path / "slow-tee"
    folder.mkdir()
    tee = folder / "tee"
    tee.write_text(f'#!/bin/sh\n{shutil.which("tee")} "$@"\nrc=$?\nsleep 1\nexit $rc\n')
    tee.chmod(0o755)
    return folder


@pytest.mark.bad_input("signal")
@pytest.mark.parametrize("group", [True, False], ids=["process-group", "script-only"])
def test_torchrun_sh_waits_for_its_workers_stop_checkpoint(tmp_path, group):
    """SIGTERM to launch/torchrun.sh's process group (Slurm, ``kill -- -PGID``) or to the script
    alone: the script ends only after torchrun and its worker, which write the stop checkpoint;
    it used to exit 143 at once while the orphaned worker saved a second later. Exit 143.

    The log's ``tee`` is made to take 1 s to end after its input does: the script waits for it
    too (it used to end first, now and then in CI: the tee still ran, the log's last lines unwritten)."""
    path = recipe(tmp_path, sft_steps=400, checkpoint={"every": 0})
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["PYTHONWARNINGS"] = "ignore"
    env["PATH"] = f"{_slow_tee(tmp_path)}{os.pathsep}{env['PATH']}"
    log = tmp_path / "log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [str(ROOT / "launch/torchrun.sh"), str(path)], env=env, stdout=f, stderr=f, start_new_session=True
        )
    code = _signal_after_first_row(proc, tmp_path, "sft", signal.SIGTERM, group=group)
    # the moment the script has ended: nothing of its process group still runs, the save is done
    assert _live_in_group(proc.pid) == [], log.read_text()[-3000:]
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    ckpt, meta = _newest(tmp_path)
    assert meta["extra"]["stage"] == "sft" and verify_checkpoint(ckpt) is None
    assert "SIGTERM: stopped after sft step" in log.read_text()


FAKE_TORCHRUN = """#!{python}
# PYTHON for launch/torchrun.sh: the real interpreter, except that -m torch.distributed.run is a
# stand-in trainer that takes 1 s to write its stop checkpoint after a signal and records which
# signal it got.
import os, signal, sys, time
if sys.argv[1:3] != ["-m", "torch.distributed.run"]:
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
got = os.environ["FAKE_TRAINER_GOT"]
def stop(signum, frame):
    time.sleep(1.0)
    with open(got, "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(128 + signum)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, stop)
open(got + ".started", "w").close()
while True:
    signal.pause()
"""


@pytest.mark.bad_input("signal")
def test_torchrun_sh_forwards_sighup_as_sigterm_and_waits_for_the_save(tmp_path):
    """A closed terminal (SIGHUP to launch/torchrun.sh alone) reaches torchrun as SIGTERM, the
    trainers' stop signal, and the script ends only once torchrun has (after its stop
    checkpoint), with 143. torchrun is a stand-in here (``PYTHON``): a second, not a training run.
    Planted bug killed: SIGHUP forwarded as itself (or not trapped: the script ends at once)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_TORCHRUN.format(python=sys.executable))
    fake.chmod(0o755)
    got = tmp_path / "got"
    env = {**os.environ, "PYTHON": str(fake), "PYTHONPATH": str(ROOT), "FAKE_TRAINER_GOT": str(got)}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("NPROC", None)
    log = tmp_path / "log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [str(ROOT / "launch/torchrun.sh"), str(recipe(tmp_path))],
            env=env,
            stdout=f,
            stderr=f,
            start_new_session=True,
            # as started from a terminal: a shell cannot trap a signal ignored when it started, so a
            # test run under nohup (SIGHUP ignored, inherited) would otherwise see SIGHUP ignored
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
    deadline = time.time() + 120
    while not Path(f"{got}.started").exists():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGHUP)
    code = proc.wait(timeout=60)
    assert got.exists(), "the script ended before torchrun's stop checkpoint"
    assert got.read_text() == "SIGTERM"
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]


@pytest.mark.bad_input("signal")
def test_sigterm_in_rl_checkpoints_the_rl_step_and_resume_continues(tmp_path):
    rl = {"rl_steps": 200, "prompts_per_step": 2, "group_size": 2, "minibatches": 1, "max_new_tokens": 6}
    path = recipe(tmp_path, stages=["sft", "rl"], sft_steps=2, eval_prompts=2, **rl)
    log = tmp_path / "log"
    code = _signal_after_first_row(_start(path, log), tmp_path, "rl", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    ckpt, meta = _newest(tmp_path)
    stop = meta["extra"]["step"]
    assert meta["extra"]["stage"] == "rl" and 1 <= stop < 200 and meta["extra"]["done"] == ["sft"]
    assert verify_checkpoint(ckpt) is None
    assert f"stopped after rl step {stop}" in _stop_line(log, "SIGTERM")

    res = run_cli("train", path, f"train.rl_steps={stop + 1}", "--resume", cwd=tmp_path)
    assert res.code == 0, res.err[-3000:]
    assert _rows(tmp_path, "rl") == list(range(stop + 1))
    assert _newest(tmp_path)[1]["extra"]["done"] == ["sft", "rl"]


@pytest.mark.bad_input("signal")
def test_sigterm_to_the_whole_process_group_still_checkpoints(tmp_path):
    """The group includes megatron's checkpoint-writer queue server (started by the SFT stage's
    save); it used to die with the group and the stop's save failed with BrokenPipeError."""
    rl = {"rl_steps": 200, "prompts_per_step": 2, "group_size": 2, "minibatches": 1, "max_new_tokens": 6}
    path = recipe(tmp_path, stages=["sft", "rl"], sft_steps=2, eval_prompts=2, **rl)
    log = tmp_path / "log"
    code = _signal_after_first_row(_start(path, log), tmp_path, "rl", signal.SIGTERM, group=True)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    ckpt, meta = _newest(tmp_path)
    assert meta["extra"]["stage"] == "rl" and verify_checkpoint(ckpt) is None
    assert f"stopped after rl step {meta['extra']['step']}" in _stop_line(log, "SIGTERM")


@pytest.mark.bad_input("signal")
def test_a_second_signal_does_not_corrupt_the_checkpoint(tmp_path):
    path = recipe(tmp_path, sft_steps=400, checkpoint={"every": 0})
    log = tmp_path / "log"
    proc = _start(path, log)
    code = _signal_after_first_row(proc, tmp_path, "sft", signal.SIGTERM, signal.SIGTERM, signal.SIGINT)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    ckpts = checkpoint_dirs(tmp_path / "run/checkpoints")
    assert len(ckpts) == 1 and verify_checkpoint(ckpts[0]) is None
    assert not list((tmp_path / "run/checkpoints").glob(".tmp-*"))
    _stop_line(log, "SIGTERM")
    before = snapshot(tmp_path / "run/checkpoints")
    res = run_cli("train", path, "train.sft_steps=1", "--resume", cwd=tmp_path)
    assert res.code == 0, res.err[-3000:]
    assert set(before) <= set(snapshot(tmp_path / "run/checkpoints")) | {"latest"}


@pytest.mark.bad_input("signal")
def test_stop_signals_record_restore_and_ignore_a_repeat():
    """Inside, a signal is recorded and a second one ignored (the save is not interrupted); on a
    clean exit the handlers from before are back and the recorded signal, which no step loop acted
    on, is handed on to them once (the repeat is not)."""
    outside = []

    def record(signum, frame):
        outside.append(signum)

    old = signal.signal(signal.SIGTERM, record)
    old_int = signal.signal(signal.SIGINT, record)
    try:
        with StopSignals() as signals:
            assert signals.requested() == 0
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # noted, not raised: the save is not interrupted
            time.sleep(0.01)
            assert signals.requested() == signal.SIGTERM
            assert outside == []
        assert signal.getsignal(signal.SIGTERM) is record and signal.getsignal(signal.SIGINT) is record
        assert outside == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)


@pytest.mark.bad_input("signal")
def test_stop_signals_outside_the_main_thread_install_nothing():
    old = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with StopSignals() as signals:
            seen.append(signal.getsignal(signal.SIGTERM) is old and signals.signum is None)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [True]


@pytest.mark.bad_input("output")
def test_a_second_train_into_a_running_runs_folder_is_refused_naming_the_holder(tmp_path):
    """It used to be accepted while the first had no checkpoint yet: metrics.jsonl interleaved two
    runs and recipe.yaml was the second's. A real concurrent ``moe-rl train``."""
    path = recipe(tmp_path, sft_steps=4000, checkpoint={"every": 0})  # it must still run when stopped
    log = tmp_path / "log"
    first = _start(path, log)
    try:
        deadline = time.time() + 300
        while not _rows(tmp_path, "sft"):
            assert first.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        recipe_before = (tmp_path / "run/recipe.yaml").read_bytes()
        second = run_cli("train", path, "train.sft_steps=2", "--fresh", cwd=tmp_path, timeout=120)
        second.one_line(rf"train\.out_dir .*run is in use by another run: pid {first.pid} on .*wait for it")
        assert first.poll() is None  # the first run goes on
        assert (tmp_path / "run/recipe.yaml").read_bytes() == recipe_before
    finally:
        os.kill(first.pid, signal.SIGTERM)
        assert first.wait(timeout=300) == 128 + signal.SIGTERM
    rows = _rows(tmp_path, "sft")
    assert rows == list(range(len(rows)))  # one run's rows, in order


@pytest.mark.bad_input("output")
def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path):
    """``kill -9`` leaves the lock file; its flock died with the process, so the next run takes it."""
    path = recipe(tmp_path, sft_steps=400, checkpoint={"every": 0})
    log = tmp_path / "log"
    first = _start(path, log)
    while not _rows(tmp_path, "sft"):
        assert first.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert (tmp_path / "run/.moe-rl.lock").exists()
    res = run_cli("train", path, "train.sft_steps=2", "--fresh", cwd=tmp_path, timeout=300)
    assert res.code == 0, res.err[-3000:]
    assert "taking over the lock of a run that ended without releasing it" in res.err
    assert not (tmp_path / "run/.moe-rl.lock").exists()  # released at the end


@pytest.mark.bad_input("signal")
def test_a_stop_whose_weights_fail_the_checks_writes_no_checkpoint_and_still_stops(tmp_path, parallel_info):
    """The stop's checkpoint is written only if the weights pass the checks (docs/safety.md,
    Signals): a real SIGTERM after a step with good weights writes one; after a step that left a
    weight NaN it writes none, its one line says so and names the last good one, and the run still
    stops with 128 + the signal (not a TrainingStopped traceback). In process, on the run object."""
    import torch

    from moe_rl.config import load_recipe
    from moe_rl.trainer.context import Run
    from moe_rl.trainer.signals import StopRequested

    run = Run(load_recipe(recipe(tmp_path)))
    root = tmp_path / "run/checkpoints"
    try:
        run.make_optimizer("sft")
        with run.signals:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            with pytest.raises(
                StopRequested, match=r"SIGTERM: stopped after sft step 0, checkpoint .* written"
            ):
                run.stop_if_signalled("sft step 0")
            assert len(checkpoint_dirs(root)) == 1
            good = checkpoint_dirs(root)[0]
            with torch.no_grad():
                next(run.policy.model.parameters()).view(-1)[0] = float("nan")
            with pytest.raises(StopRequested) as stop:
                run.stop_if_signalled("sft step 1")
        assert stop.value.exit_code == 128 + signal.SIGTERM
        assert "stopped after sft step 1 without a checkpoint" in str(stop.value)
        assert f"the last good checkpoint is {good}" in str(stop.value)
        assert checkpoint_dirs(root) == [good] and verify_checkpoint(good) is None
    finally:
        run.close()
