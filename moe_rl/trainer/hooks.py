"""Seam 1: hooks after each optimizer step, where measurements attach instead of patching the trainer.

A hook is registered on a run (:meth:`moe_rl.trainer.run.Run.add_hook`) and sees every optimizer
step of every stage that run trains (SFT and RL), as an :class:`OptimizerStep`. The trainer's own
probes (``ratio/routing_share``, then ``flip/step``: :mod:`moe_rl.trainer.probe`) are the first hooks of
every run; studies add theirs beside them (``studies/collapse/volatility.py``).

In an RL step the trainer calls, for every hook, in registration order::

    hook.begin(run, step, batch)       before the first of the M updates (pi_old's weights)
    hook(event)                        after each optimizer step j = 0 .. M-1
    hook.metrics(run)                  after the M updates: added to the step's metrics

The calls are timed as the step's ``probe`` phase (excluded from ``train``), except ``metrics``.
In SFT only ``hook(event)`` is called, after each optimizer step (``event.batch`` is None).
Every rank calls every hook: a hook may run a forward or a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_rl.trainer.context import Run
    from moe_rl.trainer.rl import RLBatch


@dataclass(frozen=True)
class OptimizerStep:
    """What a hook sees after one optimizer step."""

    run: Run
    "The run that stepped (``run.optimizer.step_count`` counts this step already)."
    stage: str
    "The stage: ``sft`` or ``rl``."
    step: int
    "The stage's step the update belongs to (an RL step holds ``minibatches`` updates)."
    minibatch: int
    "The update's index j within the step, 0 .. ``minibatches`` - 1 (0 in SFT)."
    minibatches: int
    "Updates in the step: ``train.minibatches`` in RL, 1 in SFT."
    stats: dict[str, float]
    "What ``optimizer.step()`` returned (``grad_norm``, ``lr``, ``skipped``; SFT adds ``loss``)."
    batch: RLBatch | None = None
    "The RL step's rollout batch (this rank's rows); None in SFT."


class StepHook:
    """A measurement after each optimizer step; subclass and override what it needs."""

    def begin(self, run: Run, step: int, batch: RLBatch) -> None:
        """Before the first update of RL step ``step`` on ``batch``."""

    def __call__(self, event: OptimizerStep) -> None:
        """After each optimizer step."""

    def metrics(self, run: Run) -> dict[str, float]:
        """After the updates of an RL step: metrics to add to the step's (reduced over ranks)."""
        return {}


class FunctionHook(StepHook):
    """A plain function ``fn(event)`` as a hook (:meth:`Run.add_hook` wraps functions in it)."""

    def __init__(self, fn: Callable[[OptimizerStep], object]):
        self.fn = fn

    def __call__(self, event: OptimizerStep) -> None:
        self.fn(event)
