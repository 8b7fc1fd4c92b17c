"""The trainer's probes, hooks after each optimizer step: the expert flip probe (``flip/step``)
and the routing share of the ratios (``ratio/routing_share``).

Shape legend: P = probe rows (the first ``train.flip_probe_sequences`` of the batch), S = input
positions, L = MoE layers, K = top-k. See docs/algorithms.md#expert-flip-rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.megatron.routing import RoutingSession
from moe_rl.routing import RouterAction
from moe_rl.trainer.forwards import flip_rates, micro_batches, natural_routes, packed, probe_rows, route_flips
from moe_rl.trainer.hooks import OptimizerStep, StepHook

if TYPE_CHECKING:
    from moe_rl.trainer.batch import RLBatch
    from moe_rl.trainer.context import Run


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
        shared = batch.probe_after
        if shared is not None and shared[0] == run.optimizer.step_count and shared[1].shape[0] == n:
            after_PSLK = shared[1]  # the routing share's natural forward of these rows, after this step
        else:
            after_PSLK = natural_routes(run, batch.tokens_BT[:n], batch.lens_B[:n])
        self.counts.append(route_flips(self.before_PSLK, after_PSLK, batch.valid_BS[:n]))
        self.before_PSLK = after_PSLK

    def metrics(self, run: Run) -> dict[str, float]:
        counts, self.counts, self.before_PSLK = self.counts, [], None
        return flip_rates(run, {"flip/step": counts}) if counts else {}


class RoutingShareProbe(StepHook):
    """How much of the ratios' movement routing carries, after the last update of each RL step.

    The natural and the replayed pass are one forward of the probe rows twice over (the first copy
    natural, the second replayed: ``RoutingSession(replay_rows=...)``), which also yields the probe
    rows' natural routes after that update; it leaves them on the batch (``RLBatch.probe_after``)
    for the flip probe, registered after it, to take instead of a forward of its own.

    On the probe rows, log rho = log pi_theta - log pi_old per response token, with pi_theta's
    forward routed naturally and again with pi_old's natural routes replayed (the routes of the
    pi_old pass; the engine's in bypass mode)::

        ratio/routing_share = 1 - Var(log rho, pi_old's routes replayed) / Var(log rho, natural)

    0: routing moves no ratio (replay changes nothing); 1: all the ratios' spread comes from the
    experts changing. ``ratio/log_rho_var_natural`` and ``ratio/log_rho_var_replayed`` are the two
    variances. Sums are reduced over data-parallel ranks before dividing.
    """

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    def begin(self, run: Run, step: int, batch: RLBatch) -> None:
        self.sums = None

    def __call__(self, event: OptimizerStep) -> None:
        run, batch = event.run, event.batch
        if batch is None or event.minibatch != event.minibatches - 1 or batch.old_routes_BSLK is None:
            return
        n = probe_rows(run, batch.tokens_BT.shape[0])
        if n == 0:
            return
        # one forward of the rows twice over: the first copy routed naturally, the second with
        # pi_old's routes replayed (RoutingSession's replay_rows), one pass over the weights
        tokens_BT, lens_B = batch.tokens_BT[:n].repeat(2, 1), batch.lens_B[:n].repeat(2)
        routes_BSLK = torch.cat([torch.zeros_like(batch.old_routes_BSLK[:n]), batch.old_routes_BSLK[:n]])
        replayed_B = torch.arange(2 * n) >= n
        logp, natural = [], []
        for rows in micro_batches(run, lens_B, 0, 2 * n):
            pack = packed(run, tokens_BT[rows], lens_B[rows])
            session = RoutingSession(
                run.policy,
                RouterAction.REPLAY,
                routes_BSLK=routes_BSLK[rows],
                replay_rows=replayed_B[rows],
                pack=pack,
                noise=run.route_noise,
            )
            with torch.no_grad(), session:
                logp.append(
                    run.policy.logprobs(
                        tokens_BT[rows], temperature=run.recipe.train.temperature, pack=pack
                    ).logp_BT
                )
            natural.append(session.natural_BSLK(rows.stop - rows.start, tokens_BT.shape[1] - 1))
        # the natural copy's routes: the flip probe's "after" of this update
        batch.probe_after = (run.optimizer.step_count, torch.cat(natural)[:n])
        logp_BT, mask_BT = torch.cat(logp), batch.mask_BT[:n].bool()
        sums = []
        for part in (logp_BT[:n], logp_BT[n:]):  # natural, replayed
            x = (part.double() - batch.old_logp_BT[:n].double())[mask_BT]
            sums.append(torch.stack([x.new_tensor(float(x.numel())), x.sum(), (x * x).sum()]))
        self.sums = dist.all_reduce(torch.stack(sums), run.info.dp_group)

    def metrics(self, run: Run) -> dict[str, float]:
        sums, self.sums = self.sums, None
        if sums is None or float(sums[0, 0]) < 2:
            return {}
        count, total, squares = sums.unbind(1)
        var = (squares - total * total / count) / (count - 1)
        natural, replayed = float(var[0]), float(var[1])
        out = {"ratio/log_rho_var_natural": natural, "ratio/log_rho_var_replayed": replayed}
        if natural > 0:
            out["ratio/routing_share"] = 1.0 - replayed / natural
        return out
