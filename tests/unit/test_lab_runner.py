"""moe_rl.lab.starts and moe_rl.lab.runner: an interrupted SFT start resumes and ends where an uninterrupted one does; a
run in a child process is timed alone."""

import json
import subprocess
import sys

import pytest
import torch

from moe_rl.lab import runner, starts
from moe_rl.lab.arms import DEMO, ROOT, flatten
from moe_rl.lab.starts import SMOKE_BASE

SFT = [*flatten(SMOKE_BASE), "train.sft_steps=5", "train.sft_batch_size=4"]


def _weights(ckpt) -> dict[str, torch.Tensor]:
    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.megatron.parallel import parallel_info
    from moe_rl.megatron.policy import build_policy

    recipe = load_recipe(DEMO, SFT)
    policy = build_policy(recipe.model, recipe.parallel, parallel_info())
    load_checkpoint(ckpt, policy.model, load_rng=False)
    return {
        k: v.detach().clone() for k, v in policy.model.state_dict().items() if isinstance(v, torch.Tensor)
    }


def _losses(root) -> list[float]:
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["stage"] == "sft"]


def test_an_interrupted_sft_start_resumes_to_the_same_weights(tmp_path, parallel_info, monkeypatch):
    from moe_rl.trainer import sft

    monkeypatch.setattr(starts, "SFT_CHECKPOINT_EVERY", 2)
    ref, info = starts.warm_start(DEMO, SFT, cache=tmp_path / "ref")
    assert not info["reused"] and info["steps"] == 5

    real, calls, kill_at = sft.sft_step, [], [4]

    def counted(*a, **k):  # the 4th step of the first attempt dies (its checkpoint: after step 2)
        calls.append(1)
        if len(calls) == kill_at[0]:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(sft, "sft_step", counted)
    with pytest.raises(KeyboardInterrupt):
        starts.warm_start(DEMO, SFT, cache=tmp_path / "cut")
    root = tmp_path / "cut" / ref.parent.name
    assert not (root / "sft.json").exists() and (root / "checkpoints").is_dir()

    calls.clear()
    kill_at[0] = 0
    cut, info = starts.warm_start(DEMO, SFT, cache=tmp_path / "cut")
    assert len(calls) == 3  # steps 2, 3, 4 only: resumed from the checkpoint after step 2
    assert not info["reused"] and info["steps"] == 5  # resumed: every step once in metrics.jsonl
    assert _losses(root) == _losses(ref.parent)
    want, got = _weights(ref), _weights(cut)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    again, info = starts.warm_start(DEMO, SFT, cache=tmp_path / "cut")
    assert info["reused"] and again == cut


def _rl_rows(out) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["stage"] == "rl"}


def test_a_stopped_rl_arm_resumes_and_ends_as_one_that_never_saved(tmp_path, parallel_info, monkeypatch):
    from moe_rl.trainer import loop

    start, _ = starts.warm_start(DEMO, SFT, cache=tmp_path / "sft")
    ov = [*SFT, "train.rl_steps=4", "checkpoint.every=2", "train.eval_prompts=4", "train.seed=7"]
    ref = runner.run_arm(DEMO, [*ov, "checkpoint.every=0"], tmp_path / "ref", start=start)  # never saves
    assert ref["status"] == "done" and not ref["resumed"]

    real, calls = loop.rl_step, []

    def stopped_in_step_3(*a, **k):  # the checkpoint after 2 steps is down; step 3 dies
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("stopped")
        return real(*a, **k)

    monkeypatch.setattr(loop, "rl_step", stopped_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        runner.run_arm(DEMO, ov, tmp_path / "cut", start=start)
    calls.clear()
    calls.append("no more stops")
    monkeypatch.setattr(loop, "rl_step", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    cut = runner.run_arm(DEMO, ov, tmp_path / "cut", start=start)
    assert cut["status"] == "done" and cut["resumed"] and len(calls) == 1 + 2  # steps 2 and 3 only
    want, got = _rl_rows(tmp_path / "ref"), _rl_rows(tmp_path / "cut")
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step, row in want.items():
        for k in ("reward/mean", "loss/pg", "grad_norm", "flip/step/rate", "eval/accuracy"):
            assert got[step].get(k) == row.get(k), (step, k)
    # another run's directory (a different recipe) is never resumed: it starts over
    other = runner.run_arm(DEMO, [*ov, "train.seed=8"], tmp_path / "cut", start=start)
    assert other["status"] == "done" and not other["resumed"]


@pytest.mark.integration
def test_a_child_run_is_timed_alone_while_others_end_beside_it():
    """Two runs side by side (the sweep's two jobs): the idle one's CPU seconds do not take in the
    busy one that ended during it, as the process-wide children totals would."""
    from concurrent.futures import ThreadPoolExecutor

    from moe_rl.lab.runner import run_child

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    idle = "import time; time.sleep(4)"
    with ThreadPoolExecutor(2) as pool:
        idle_s, busy_s = pool.map(lambda code: run_child([sys.executable, "-c", code]), (idle, busy))
    assert busy_s >= 0.95 and idle_s < 0.5, (busy_s, idle_s)
    with pytest.raises(subprocess.CalledProcessError) as e:
        run_child([sys.executable, "-c", "raise SystemExit(3)"])
    assert e.value.returncode == 3


def test_a_finished_run_is_skipped_only_when_it_is_the_same_run(tmp_path, monkeypatch):
    """The status file skips a finished run only when the folder's recipe is the one asked for (a
    changed override reruns it); an unreadable status file is a warning and a rerun, not a
    JSONDecodeError traceback with no file named."""
    import yaml

    from moe_rl.config import load_recipe, to_dict

    base = ROOT / "recipes/tiny.yaml"
    calls = []

    def fake_run_arm(b, overrides, out, **kw):
        calls.append(list(overrides))
        out.mkdir(parents=True, exist_ok=True)
        ov = runner.arm_run_overrides(out, overrides, kw.get("start"), kw.get("checkpoint_every", 1))
        (out / "recipe.yaml").write_text(yaml.safe_dump(to_dict(load_recipe(b, ov))))
        return {"status": "done", "reason": None, "wall_s": 0.0, "cpu_s": 0.0, "resumed": False}

    monkeypatch.setattr(runner, "run_arm", fake_run_arm)
    out = tmp_path / "arm"
    runner.resumable_run("a", base, ["optim.lr=1e-4"], out, checkpoint_every=None)
    runner.resumable_run("a", base, ["optim.lr=1e-4"], out, checkpoint_every=None)
    assert len(calls) == 1  # the same run: skipped
    runner.resumable_run("a", base, ["optim.lr=2e-4"], out, checkpoint_every=None)
    assert len(calls) == 2  # another run in that folder: run again
    (out / runner.STATUS_FILE).write_text("{trunc")
    runner.resumable_run("a", base, ["optim.lr=2e-4"], out, checkpoint_every=None)
    assert len(calls) == 3 and json.loads((out / runner.STATUS_FILE).read_text())["status"] == "done"


def test_ctrl_c_in_a_one_at_a_time_sweep_stops_the_arm_at_its_next_step(tmp_path, parallel_info, capsys):
    """An in-process sweep ran its arms in a worker thread, where Python installs no signal
    handler: Ctrl-C was ignored until the arm's last step, then a KeyboardInterrupt traceback. One
    at a time, the arm runs in the main thread: a real SIGINT (sent by a hook after RL step 1)
    stops it at its next step with a checkpoint, the next arm never starts, and the sweep ends
    with one line and exit code 130."""
    import os
    import signal

    from moe_rl.config import recipe_from_dict
    from moe_rl.megatron.checkpoint import latest_checkpoint
    from moe_rl.trainer.run import run
    from tests.tiny import TINY_E2E as TINY

    def arm(i):
        data = {k: dict(v) for k, v in TINY.items()}
        data["train"] = {
            **data["train"],
            "stages": ["rl"],
            "rl_steps": 50,
            "out_dir": str(tmp_path / f"arm{i}"),
        }

        def interrupt(event):
            if event.stage == "rl" and event.step == 1 and event.minibatch == 0:
                os.kill(os.getpid(), signal.SIGINT)

        return run(recipe_from_dict(data), hooks=[interrupt])

    code = runner.stop_cleanly(lambda: runner.in_pool(arm, [0, 1], jobs=1))
    assert code == 128 + signal.SIGINT
    assert "moe-rl: stopped: " in capsys.readouterr().err
    assert not (tmp_path / "arm1").exists()  # the sweep ended: the next arm never started
    ckpt = latest_checkpoint(tmp_path / "arm0" / "checkpoints")
    meta = json.loads((ckpt / "meta.json").read_text())["extra"]
    assert meta["stage"] == "rl" and meta["step"] == 2  # stopped after step 1, not after step 49
