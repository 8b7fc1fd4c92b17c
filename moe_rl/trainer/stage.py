"""The guard-and-checkpoint loop every stage runs (:func:`run_stage`): SFT
(:func:`moe_rl.trainer.sft.run_sft`) and RL (:func:`moe_rl.trainer.loop.run_rl`) give it their steps.

After each step the loop

- counts the steps whose update was skipped for a non-finite loss or gradient:
  ``train.max_bad_steps`` in a row stop the run (:class:`TrainingStopped`), nothing saved;
- lets the stage finish the step (:meth:`Stage.finish`: log, checks, a sentinel's rollback);
- advances ``run.state.step``; a SIGTERM / SIGINT stops the run there, with a checkpoint unless
  inside a streak of skipped steps;
- writes the periodic checkpoint (``checkpoint.every``): none inside such a streak, and none
  after the last step (the driver saves the finished stage).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from moe_rl.trainer.state import TrainingStopped

if TYPE_CHECKING:
    from moe_rl.trainer.context import Run

log = logging.getLogger(__name__)


class Stage:
    """One stage's part of the loop: :meth:`step`, and optionally :meth:`finish` / :meth:`advanced`."""

    name: str
    "The stage (``sft`` | ``rl``): ``run.state.stage`` and the messages' step names."
    steps: int
    "Steps of the stage: the loop runs ``run.state.step`` .. ``steps`` - 1."
    advice: str
    "What to change when updates keep being skipped (ends the stop message)."

    def __init__(self, run: Run, steps: int):
        self.run, self.steps = run, steps

    def step(self, step: int) -> tuple[dict[str, float], bool]:
        """Run step ``step``: its metrics, and whether an update of it was skipped (non-finite)."""
        raise NotImplementedError

    def finish(self, step: int, metrics: dict[str, float], skipped: bool) -> bool:
        """After the guard: True when the loop is to continue from ``run.state.step`` (a rollback)."""
        return False

    def advanced(self, step: int) -> None:
        """After ``run.state.step`` became ``step``: the stage's own state into ``run.state``."""


def run_stage(run: Run, stage: Stage) -> dict[str, float]:
    """Steps ``run.state.step`` .. ``stage.steps`` - 1 of ``stage`` with the guards, signals and
    periodic checkpoints; the last step's metrics."""
    max_bad_steps, every = run.recipe.train.max_bad_steps, run.recipe.checkpoint.every
    bad_steps, metrics, step = 0, {}, run.state.step
    run.phases.stage(stage.name, stage.steps, step)
    while step < stage.steps:
        metrics, skipped = stage.step(step)
        bad_steps = bad_steps + 1 if skipped else 0
        if bad_steps >= max_bad_steps:
            raise TrainingStopped(
                f"{bad_steps} consecutive {stage.name.upper()} steps had non-finite loss or gradients "
                f"(each skipped); stopping at {stage.name} step {step + 1}, nothing saved; "
                f"{run.last_good_text()}: {stage.advice}"
            )
        if stage.finish(step, metrics, skipped):
            step = run.state.step
            continue
        step += 1
        run.state.step = step
        stage.advanced(step)
        run.stop_if_signalled(f"{stage.name} step {step}", can_save=bad_steps == 0)
        if every and step % every == 0 and step < stage.steps:
            if bad_steps:
                log.warning("%s step %d: no checkpoint inside a streak of skipped steps", stage.name, step)
            else:
                run.save()
    return metrics
