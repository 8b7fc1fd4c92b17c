"""The trainer's expert flip probe (``flip/step``), a hook after each optimizer step.

Shape legend: P = probe rows (the first ``train.flip_probe_sequences`` of the batch), S = input
positions, L = MoE layers, K = top-k. See docs/algorithms.md#expert-flip-rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.trainer.hooks import OptimizerStep, StepHook
from moe_rl.trainer.rl import flip_rates, natural_routes, probe_rows, route_flips

if TYPE_CHECKING:
    import torch

    from moe_rl.trainer.context import Run
    from moe_rl.trainer.rl import RLBatch


class FlipProbe(StepHook):
    """The natural top-k routes of the probe rows before and after every ``train.flip_probe_every``-th
    optimizer step; ``flip/step/*`` is the rate at which they change, over the RL step's updates.

    The "before" routes of the first update are pi_old's, reused from its pass when that pass was
    the probe's natural forward (``RLBatch.probe_before_BSLK``), else computed here."""

    def __init__(self) -> None:
        self.before_PSLK: torch.Tensor | None = None
        self.counts: list[dict] = []

    def begin(self, run: Run, step: int, batch: RLBatch) -> None:
        n = probe_rows(run, batch.tokens_BT.shape[0])
        self.counts, self.before_PSLK = [], batch.probe_before_BSLK if n else None  # no rows: no flip/step
        if n and self.before_PSLK is None:
            self.before_PSLK = natural_routes(run, batch.tokens_BT[:n], batch.lens_B[:n])

    def __call__(self, event: OptimizerStep) -> None:
        run, batch = event.run, event.batch
        if batch is None or self.before_PSLK is None:
            return
        if run.optimizer.step_count % run.recipe.train.flip_probe_every:
            return
        n = self.before_PSLK.shape[0]
        after_PSLK = natural_routes(run, batch.tokens_BT[:n], batch.lens_B[:n])
        self.counts.append(route_flips(self.before_PSLK, after_PSLK, batch.valid_BS[:n]))
        self.before_PSLK = after_PSLK

    def metrics(self, run: Run) -> dict[str, float]:
        counts, self.counts, self.before_PSLK = self.counts, [], None
        return flip_rates(run, {"flip/step": counts}) if counts else {}
