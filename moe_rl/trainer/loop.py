"""The RL stage, phase by phase (the step itself is :func:`moe_rl.trainer.rl.rl_step`).

Each RL step: generate, score, pi_old, M minibatch updates, weight sync (``rl_step``); then
evaluate, the collapse sentinel (stop, or roll back), log; the guards against non-finite updates,
signals and checkpoints are the loop SFT shares (:func:`moe_rl.trainer.stage.run_stage`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.trainer.reference import start_reference
from moe_rl.trainer.rl import encode_prompts, local_prompts, rewards_of, rl_step, sampling_for
from moe_rl.trainer.samples import samples_due, write_samples
from moe_rl.trainer.sentinel import Sentinel, SentinelVerdict
from moe_rl.trainer.stage import Stage, run_stage
from moe_rl.trainer.state import TrainingStopped
from moe_rl.trainer.timer import StepTimer

if TYPE_CHECKING:
    from moe_rl.trainer.context import Run

log = logging.getLogger(__name__)


def run_rl(run: Run) -> dict[str, float]:
    """RL steps with weight sync, metrics, checkpoints, guards and evaluation; the last metrics."""
    stage = RLStage(run)
    metrics = run_stage(run, stage)
    every = run.recipe.train.eval_every
    if every and stage.steps % every == 0 and "eval/accuracy" in metrics:  # the last step's weights,
        final = {"eval/accuracy": metrics["eval/accuracy"]}  # evaluated already: not again
    else:
        run.phases.phase(
            "rl final evaluation", f"greedy accuracy on {run.recipe.train.eval_prompts} held-out prompts"
        )
        final = evaluate(run, stage.steps)
    run.sink.log(stage.steps, "rl_eval", final)
    return {**metrics, **final}


class RLStage(Stage):
    """RL's steps for :func:`run_stage`: an RL step and its evaluation, then the sentinel."""

    name = "rl"
    advice = "lower optim.lr or check the data"

    def __init__(self, run: Run):
        super().__init__(run, run.recipe.train.rl_steps)
        self.sentinel = _start(run)

    def step(self, step: int) -> tuple[dict[str, float], bool]:
        """Generate, score, pi_old, updates, sync; the evaluation when due. Skipped: any update was
        (weights that became non-finite are the sentinel's: ``weights/finite`` is 0 and the step's
        weights were not synced; see :func:`moe_rl.trainer.sentinel.dead_policy`)."""
        result = rl_step(self.run, step, StepTimer())
        every = self.run.recipe.train.eval_every
        if every and (step + 1) % every == 0:
            result.metrics.update(evaluate(self.run, step + 1))
        return result.metrics, result.skipped_updates > 0

    def finish(self, step: int, metrics: dict[str, float], skipped: bool) -> bool:
        verdict = _check_sentinel(self.sentinel, metrics)
        self.run.sink.log(step, "rl", metrics)
        self.run.progress("rl", step, self.steps, metrics)
        return _stop_or_roll_back(self.run, verdict)

    def advanced(self, step: int) -> None:
        self.run.state.sentinel, self.run.state.lr_scale = self.sentinel.state, self.run.optimizer.lr_scale


def _start(run: Run) -> Sentinel:
    """Engine, RL stage state and sentinel; at step 0 the first checkpoint and evaluation."""
    run.ensure_engine()
    run.state.step, run.state.stage = run.state.step_of("rl"), "rl"
    run.optimizer.lr_scale = run.state.lr_scale
    run.reference = start_reference(run)  # the stage's starting weights, for a KL term (else None)
    if run.state.step == 0:
        what = f"greedy accuracy on {run.recipe.train.eval_prompts} held-out prompts before any update"
        run.phases.phase("rl step-0 evaluation", what)
        if run.checkpointer.last_good is None:  # the start is the first "last good" state to roll back to
            run.save()
        run.sink.log(0, "rl_eval", evaluate(run, 0))
    return Sentinel(run.recipe.sentinel, run.state.sentinel, vocab_size=run.recipe.model.vocab_size)


def _check_sentinel(sentinel: Sentinel, metrics: dict[str, float]) -> SentinelVerdict:
    """The collapse sentinel's verdict on this step (``sentinel/fired`` added to the metrics)."""
    verdict = sentinel.check(metrics)
    metrics["sentinel/fired"] = float(len(verdict.fired))
    if verdict.fired:
        log.warning("sentinel (%s): %s", verdict.action, "; ".join(verdict.reasons))
    return verdict


def _stop_or_roll_back(run: Run, verdict: SentinelVerdict) -> bool:
    """Carry out the verdict (after the step is logged): ``stop`` raises; ``rollback`` reloads the
    last good checkpoint at a lower LR and returns True (the loop continues from its step)."""
    if verdict.action == "stop":
        raise TrainingStopped(
            "collapse sentinel: " + "; ".join(verdict.reasons) + f"; nothing saved; {run.last_good_text()}"
        )
    if verdict.action != "rollback":
        return False
    run.state = run.checkpointer.rollback(run.optimizer, run.state, run.recipe.sentinel.rollback_lr_factor)
    run.cut_rows()  # the abandoned steps' rows go, as a resume's do
    # the engine serves what it was last given (a step's weights, or the last finite ones): the
    # checkpoint's weights (finite, checked at save) replace them
    run.push_weights()
    return True


def evaluate(run: Run, step: int) -> dict[str, float]:
    """Greedy accuracy on held-out prompts (each rank its share; summed across DP), after ``step``
    RL steps; the first generations go to ``samples.jsonl`` (``train.samples_every``)."""
    prompts = local_prompts(run, run.task.heldout(run.recipe.train.eval_prompts))
    rollouts = run.generate(encode_prompts(run, prompts), 1, sampling_for(run, step, greedy=True))
    rewards_B = rewards_of(run, prompts, rollouts, 1)
    if samples_due(run):
        write_samples(run, step, "eval", prompts, rollouts, rewards_B, None, 1)
    correct = (rewards_B >= 1.0).sum().to(rewards_B.dtype)
    counts = dist.all_reduce(
        torch.stack([correct, rewards_B.new_tensor(float(len(prompts)))]), run.info.dp_group
    )
    return {"eval/accuracy": float(counts[0] / counts[1])}
