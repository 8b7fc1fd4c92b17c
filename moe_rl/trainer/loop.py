"""The RL stage driver, phase by phase (the step itself is :func:`moe_rl.trainer.rl.rl_step`).

Each RL step: generate, score, pi_old, M minibatch updates, weight sync (``rl_step``); then
evaluate, guards (non-finite updates, collapse sentinel, rollback), log, checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.trainer.rl import StepResult, encode_prompts, local_prompts, rewards_of, rl_step, sampling_for
from moe_rl.trainer.sentinel import Sentinel, SentinelVerdict
from moe_rl.trainer.state import TrainingStopped
from moe_rl.trainer.timer import StepTimer

if TYPE_CHECKING:
    from moe_rl.trainer.run import Run

log = logging.getLogger(__name__)


def run_rl(run: Run) -> dict[str, float]:
    """RL steps with weight sync, metrics, checkpoints, guards and evaluation; the last metrics."""
    cfg = run.recipe.train
    sentinel = _start(run)
    bad_steps, metrics, step = 0, {}, run.state.step
    while step < cfg.rl_steps:
        result = rl_step(run, step, StepTimer())  # generate, score, pi_old, updates, sync
        metrics = result.metrics
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            metrics.update(evaluate(run, step + 1))
        bad_steps = _guard_non_finite(run, result, bad_steps, step, cfg.max_bad_steps)
        verdict = _check_sentinel(sentinel, metrics)
        run.sink.log(step, "rl", metrics)
        run.progress(step, cfg.rl_steps, metrics)
        if _stop_or_roll_back(run, verdict):
            step = run.state.step
            continue
        step += 1
        run.state.step, run.state.sentinel, run.state.lr_scale = step, sentinel.state, run.optimizer.lr_scale
        run.stop_if_signalled(f"rl step {step}", can_save=bad_steps == 0)
        if run.recipe.checkpoint.every and step % run.recipe.checkpoint.every == 0 and step < cfg.rl_steps:
            if bad_steps:
                log.warning("rl step %d: no checkpoint inside a streak of skipped steps", step)
            else:
                run.save()
    final = evaluate(run, cfg.rl_steps)
    run.sink.log(cfg.rl_steps, "rl_eval", final)
    return {**metrics, **final}


def _start(run: Run) -> Sentinel:
    """Engine, RL stage state and sentinel; at step 0 the first checkpoint and evaluation."""
    run.ensure_engine()
    run.state.step, run.state.stage = run.state.step_of("rl"), "rl"
    run.optimizer.lr_scale = run.state.lr_scale
    if run.state.step == 0:
        if run.checkpointer.last_good is None:  # the start is the first "last good" state to roll back to
            run.save()
        run.sink.log(0, "rl_eval", evaluate(run, 0))
    return Sentinel(run.recipe.sentinel, run.state.sentinel, vocab_size=run.recipe.model.vocab_size)


def _guard_non_finite(run: Run, result: StepResult, bad_steps: int, step: int, max_bad_steps: int) -> int:
    """Consecutive steps with skipped (non-finite) updates; stop the run at ``max_bad_steps``.

    (Weights that became non-finite are the sentinel's: ``weights/finite`` is 0 and the step's
    weights were not synced to the engine; see :func:`moe_rl.trainer.sentinel.dead_policy`.)
    """
    bad_steps = bad_steps + 1 if result.skipped_updates else 0
    if bad_steps >= max_bad_steps:
        raise TrainingStopped(
            f"{bad_steps} consecutive RL steps had non-finite loss or gradients "
            f"(each skipped); stopping at step {step}, nothing saved; {run.last_good_text()}: "
            "lower optim.lr or check the data"
        )
    return bad_steps


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
    # the engine serves what it was last given (a step's weights, or the last finite ones): the
    # checkpoint's weights (finite, checked at save) replace them
    run.push_weights()
    return True


def evaluate(run: Run, step: int) -> dict[str, float]:
    """Greedy accuracy on held-out prompts (each rank its share; summed across DP)."""
    prompts = local_prompts(run, run.task.heldout(run.recipe.train.eval_prompts))
    rollouts = run.generate(encode_prompts(run, prompts), 1, sampling_for(run, step, greedy=True))
    rewards_B = rewards_of(run, prompts, rollouts, 1)
    correct = (rewards_B >= 1.0).sum().to(rewards_B.dtype)
    counts = dist.all_reduce(
        torch.stack([correct, rewards_B.new_tensor(float(len(prompts)))]), run.info.dp_group
    )
    return {"eval/accuracy": float(counts[0] / counts[1])}
