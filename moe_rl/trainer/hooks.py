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

The types live with :class:`~moe_rl.trainer.context.Run`, which holds the hooks and hands itself to
them (one module, so no import circle); they are imported from here.
"""

from moe_rl.trainer.context import FunctionHook as FunctionHook
from moe_rl.trainer.context import OptimizerStep as OptimizerStep
from moe_rl.trainer.context import StepHook as StepHook
