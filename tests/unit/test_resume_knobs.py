"""A resumed run equals the uninterrupted one, step by step, under every stateful knob (issue 48).

Each case trains a tiny run twice: once uninterrupted, and once interrupted and continued with
``--resume`` (in process: ``run(recipe, resume=True)``), either by a crash (an exception from a
hook in the middle of an update, as a ``kill -9`` after a checkpoint: the resume continues from
that checkpoint and cuts the rows written after it) or by a stop signal (SIGTERM's flag: the
run saves after the step and ends). Every metric of every step after the resume equals the
uninterrupted run's, exactly (CPU, fp32: the same operations on the same numbers), but the
clock's. The knobs carry state across steps or draw from seeds:

- routing noise on the trainer's RL forwards (``train.route_noise``; SFT routes without it) and
  on the engine's (``rollout.route_noise``);
- shuffled minibatches (``train.shuffle_minibatches``), the start's jitter
  (``train.start_jitter``), the routers' learning rate (``train.router_lr_mult``) and a frozen
  router (``train.freeze_router``);
- R3 with the engine's gate weights replayed (``algo.replay_gate_weights``);
- the collapse sentinel's rollback: its count, the lowered learning rate and the attempt.

The subprocess twin (a real ``kill -9``): tests/integration/test_resume.py.
"""

from __future__ import annotations

import signal

import pytest
import torch

from moe_rl.trainer.metrics import read_every_attempt, read_metrics
from moe_rl.trainer.run import run
from moe_rl.trainer.signals import StopRequested
from tests.tiny import TINY_RL, tiny_rl_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

CLOCK = ("time", "tokens_per_s", "step_s")
"Row keys that read the clock."

BASE: dict = {
    **TINY_RL,
    "train": {
        **TINY_RL["train"],
        "stages": ["rl"],
        "rl_steps": 5,
        "group_size": 3,
        "max_new_tokens": 8,
        "temperature": 1.5,
    },
    "checkpoint": {"every": 2},
}
"""TINY_RL for 5 RL steps of 2 prompts x 3 samples, a checkpoint every 2 steps."""


@pytest.fixture
def varied_rewards(monkeypatch):
    """Rewards that differ within a group (the response's length): every step trains."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text)))


class Crash(Exception):
    """A crash in the middle of an update (the in-process ``kill -9``)."""


class Interrupt:
    """A hook that interrupts the run once, at ``stage`` step ``step`` after update ``minibatch``:
    ``crash`` raises :class:`Crash`; ``stop`` raises SIGTERM's flag (the run saves after the step
    and ends with :class:`StopRequested`)."""

    def __init__(self, stage: str, step: int, how: str, minibatch: int = 0):
        self.stage, self.step, self.how, self.minibatch = stage, step, how, minibatch
        self.fired = False

    def __call__(self, event) -> None:
        if self.fired or (event.stage, event.step, event.minibatch) != (
            self.stage,
            self.step,
            self.minibatch,
        ):
            return
        self.fired = True
        if self.how == "crash":
            raise Crash(f"crash in {self.stage} step {self.step}")
        event.run.signals.signum = signal.SIGTERM


class PoisonOnce:
    """A hook that makes one weight NaN after the last update of RL step ``step``, once: the step's
    weights are dead, the sentinel rolls back to the last checkpoint at a lower learning rate."""

    def __init__(self, step: int):
        self.step, self.fired = step, False

    def __call__(self, event) -> None:
        if self.fired or event.stage != "rl" or event.step != self.step:
            return
        if event.minibatch == event.minibatches - 1:
            self.fired = True
            with torch.no_grad():
                next(event.run.policy.model.parameters()).view(-1)[0] = float("nan")


def _rows(folder, stage: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(folder / "metrics.jsonl", stage)}


def _metrics(row: dict) -> dict:
    return {
        k: v
        for k, v in row.items()
        if k not in CLOCK and k not in ("run", "attempt") and not k.startswith("time/")
    }


def _resume_equals_uninterrupted(tmp_path, sections: dict, interrupt: Interrupt, *, hooks=list) -> dict:
    """Train ``BASE`` + ``sections`` uninterrupted and interrupted (then resumed); assert every row of
    every stage equal; both folders. ``hooks()``: hooks for each (the interrupted run and its resume
    share one set: a hook that fires once fires once in them)."""
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    cut_hooks = hooks()
    run(tiny_rl_recipe(ref_dir, base=BASE, **sections), hooks=hooks())
    recipe = tiny_rl_recipe(cut_dir, base=BASE, **sections)
    with pytest.raises(Crash if interrupt.how == "crash" else StopRequested):
        run(recipe, hooks=[*cut_hooks, interrupt])
    assert interrupt.fired
    run(recipe, resume=True, hooks=cut_hooks)
    stages = {r["stage"] for r in read_metrics(ref_dir / "metrics.jsonl")}
    for stage in stages:
        want, got = _rows(ref_dir, stage), _rows(cut_dir, stage)
        assert sorted(got) == sorted(want), (stage, sorted(got), sorted(want))
        for step in want:
            w, g = _metrics(want[step]), _metrics(got[step])
            differ = {k: (g.get(k), w[k]) for k in w.keys() | g.keys() if g.get(k) != w.get(k)}
            assert not differ, f"{stage} step {step} (resumed, uninterrupted): {differ}"
    return {"ref": ref_dir, "cut": cut_dir}


def test_a_noisy_shuffled_jittered_run_resumes_as_it_would_have_gone_on(
    tmp_path, parallel_info, varied_rewards
):
    """Routing none: the trainer's and the engine's routing noise, shuffled minibatches, start
    jitter, the routers at twice the learning rate; a crash in RL step 3 (after the checkpoint of
    step 2), then the resume. Planted bugs killed: the trainer's noise seeded once per run (not per
    step); the engine's noise seeded from its call count (which restarts at a resume); the
    minibatch order drawn from the global generator."""
    sections = {
        "algo": {"name": "grpo", "routing": "none"},
        "train": {
            **BASE["train"],
            "route_noise": 1.0,
            "shuffle_minibatches": True,
            "start_jitter": 0.02,
            "router_lr_mult": 2.0,
        },
        "rollout": {"route_noise": 1.0},
    }
    _resume_equals_uninterrupted(tmp_path, sections, Interrupt("rl", 3, "crash", minibatch=1))


def test_an_r3_run_with_replayed_gates_a_frozen_router_and_a_rollback_resumes_exactly(
    tmp_path, parallel_info, varied_rewards
):
    """R3 with the engine's gate weights replayed, a frozen router, routing noise on both sides and
    a sentinel rollback in RL step 1 (dead weights: back to the start at half the learning rate),
    then a stop signal after RL step 3; the resume continues at the lowered rate with the
    sentinel's count. Planted bugs killed: the learning-rate scale not restored at a resume; the
    sentinel's state not saved with the checkpoint."""
    sections = {
        "algo": {"name": "gspo", "routing": "r3", "replay_gate_weights": True},
        "train": {**BASE["train"], "route_noise": 0.5, "freeze_router": True},
        "rollout": {"route_noise": 0.5},
        "sentinel": {"max_rollbacks": 2},
    }
    dirs = _resume_equals_uninterrupted(
        tmp_path, sections, Interrupt("rl", 3, "stop", minibatch=1), hooks=lambda: [PoisonOnce(1)]
    )
    for folder in dirs.values():  # the rollback happened, in both: step 0 again at half the rate
        first = [r for r in read_every_attempt(folder, "rl") if r["attempt"] == 0]
        assert [r["step"] for r in first][:2] == [0, 1], first
        again = _rows(folder, "rl")[0]
        assert again["attempt"] > 0 and again["lr"] == pytest.approx(first[0]["lr"] * 0.5, rel=1e-6)


def test_a_run_interrupted_in_sft_with_routing_noise_resumes_as_it_would_have_gone_on(
    tmp_path, parallel_info, varied_rewards
):
    """``train.route_noise`` on, a crash in SFT step 3 (after the checkpoint of step 2), then the
    resume: SFT's steps 2 and 3 and the RL steps after them equal the uninterrupted run's; SFT's
    rows are those of a run without the noise (an SFT start is shared by runs of any noise: its
    signature, ``moe_rl.lab.starts.SFT_TRAIN_KEYS``, leaves the knob out). The bug it found, seen
    failing before the fix: SFT drew the trainer's noise from one generator seeded when the run
    started, so a resumed run drew the first steps' noise again (SFT step 2's loss 4.3598 resumed,
    4.3616 uninterrupted). Planted bug killed: SFT routing with the trainer's noise."""
    train = {**BASE["train"], "stages": ["sft", "rl"], "sft_steps": 4, "sft_batch_size": 4, "rl_steps": 2}
    sections = {"algo": {"name": "grpo", "routing": "r2"}, "train": {**train, "route_noise": 1.0}}
    dirs = _resume_equals_uninterrupted(tmp_path, sections, Interrupt("sft", 3, "crash"))
    quiet = tmp_path / "quiet"
    run(tiny_rl_recipe(quiet, base=BASE, algo=sections["algo"], train={**train, "stages": ["sft"]}))
    assert [_metrics(r) for r in _rows(quiet, "sft").values()] == [
        _metrics(r) for r in _rows(dirs["ref"], "sft").values()
    ]
