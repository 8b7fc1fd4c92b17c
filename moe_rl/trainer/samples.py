"""What the policy generates, for a person to read (``train.samples_every``).

Every ``train.samples_every`` RL steps (steps 0, N, 2N, ...) the first ``train.samples_per_step``
rollouts of rank 0's batch, and as many held-out generations of every evaluation, go to
``<out_dir>/samples.jsonl`` (:meth:`moe_rl.trainer.metrics.MetricsSink.samples`) and to TensorBoard
as text. Each row: ``step`` (rollouts: the RL step, as its ``rl`` metrics row; evaluations: the
RL steps trained before it, as ``rl_eval`` rows), ``kind`` (``rollout`` | ``eval``), the run's
``run`` / ``attempt`` tags, ``row`` (its index in rank 0's batch), ``prompt``, ``response`` (the
response tokens decoded as the reward decodes them), ``answer`` (the reference), ``reward``,
``correct`` (reward >= 1, as ``reward/accuracy`` and ``eval/accuracy`` count), ``advantage``
(rollouts), ``response_tokens`` and ``finish_reason``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_rl.rollout.types import Rollouts
    from moe_rl.tasks.base import Prompt
    from moe_rl.trainer.context import Run


def samples_due(run: Run, step: int | None = None) -> bool:
    """Whether this rank writes samples now: rank 0 (the sink's), with ``train.samples_every`` on,
    and, for an RL step ``step``, a multiple of it (every evaluation writes: ``step`` None)."""
    every = run.recipe.train.samples_every
    if not (every and run.recipe.train.samples_per_step and run.sink.enabled):
        return False
    return step is None or step % every == 0


def sample_rows(
    run: Run,
    prompts: list[Prompt],
    rollouts: Rollouts,
    rewards_B: torch.Tensor,
    adv_B: torch.Tensor | None,
    group: int,
) -> list[dict]:
    """The first ``train.samples_per_step`` rows of ``rollouts`` (row i answers prompt i // group)."""
    k = min(run.recipe.train.samples_per_step, rollouts.batch_size)
    tokens = rollouts.tokens_BT[:k].tolist()
    starts, ends = rollouts.prompt_lens_B[:k].tolist(), rollouts.total_lens_B[:k].tolist()
    rewards = rewards_B[:k].tolist()
    advantages = adv_B[:k].tolist() if adv_B is not None else None
    rows = []
    for i in range(k):
        prompt = prompts[i // group]
        row = {
            "row": i,
            "prompt": prompt.text,
            "response": run.tok.decode(tokens[i][starts[i] : ends[i]]),
            "answer": prompt.answer,
            "reward": rewards[i],
            "correct": rewards[i] >= 1.0,
        }
        if advantages is not None:
            row["advantage"] = advantages[i]
        row["response_tokens"] = ends[i] - starts[i]
        row["finish_reason"] = rollouts.finish_reasons[i]
        rows.append(row)
    return rows


def write_samples(
    run: Run,
    step: int,
    kind: str,
    prompts: list[Prompt],
    rollouts: Rollouts,
    rewards_B: torch.Tensor,
    adv_B: torch.Tensor | None,
    group: int,
) -> None:
    """:func:`sample_rows` of this batch to the run's sink as ``kind`` rows of ``step``."""
    run.sink.samples(step, kind, sample_rows(run, prompts, rollouts, rewards_B, adv_B, group))
