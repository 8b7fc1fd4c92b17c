"""``ratio/routing_share`` (issue 31), recomputed independently: after one RL step, the probe
rows' log rho against pi_old with the natural routes and with pi_old's routes replayed, their
variances by hand; and under trainer route noise at fixed weights, replay removes all of the
ratios' spread (share 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.megatron.routing import RoutingSession
from moe_rl.routing import RouterAction
from moe_rl.trainer.rl import collect, train_on
from tests.unit.test_wiring import _run


def _step(run):
    """One RL step's updates on its rollouts, with advantages set to +-1 (the tiny random policy
    earns no reward, and zero advantages would leave the weights where they were)."""
    batch, _ = collect(run, 0)
    g = torch.Generator().manual_seed(0)
    batch.adv_B = (torch.randint(0, 2, batch.adv_B.shape, generator=g) * 2 - 1).to(batch.adv_B)
    return batch, train_on(run, batch)


def _log_rho(run, batch, routes):
    n = run.recipe.train.flip_probe_sequences
    action = RouterAction.NATURAL if routes is None else RouterAction.REPLAY
    with torch.no_grad(), RoutingSession(run.policy, action, routes_BSLK=routes):
        logp = run.policy.logprobs(batch.tokens_BT[:n], temperature=run.recipe.train.temperature).logp_BT
    return (logp.double() - batch.old_logp_BT[:n].double())[batch.mask_BT[:n].bool()]


def test_routing_share_is_one_minus_the_variance_ratio_recomputed_by_hand(tmp_path, parallel_info):
    run = _run(tmp_path)  # route noise off: both forwards are deterministic, the metric exact
    try:
        b, m = _step(run)
        natural = _log_rho(run, b, None).var()
        replayed = _log_rho(run, b, b.old_routes_BSLK[: run.recipe.train.flip_probe_sequences]).var()
        assert natural > 0
        assert m["ratio/log_rho_var_natural"] == pytest.approx(float(natural), rel=1e-6)
        assert m["ratio/log_rho_var_replayed"] == pytest.approx(float(replayed), rel=1e-6)
        assert m["ratio/routing_share"] == pytest.approx(1 - float(replayed / natural), abs=1e-6)
    finally:
        run.close()


def test_under_trainer_route_noise_at_fixed_weights_replay_removes_all_the_spread(tmp_path, parallel_info):
    """Updates too small to move a weight (lr 1e-30): with pi_old's routes replayed the probe
    reproduces pi_old exactly (var 0, share 1), while its natural forwards draw new noise and
    move the log-probs. A probe that did not replay, or replayed other routes, reads ~0."""
    run = _run(tmp_path)
    try:
        derived = run.derive(
            train=dataclasses.replace(run.recipe.train, route_noise=2.0),
            optim=dataclasses.replace(run.recipe.optim, lr=1e-30),
        )
        _, m = _step(derived)
        assert m["flip/drift/router_rate"] > 0.1, m  # the noise does move the routes
        assert m["ratio/log_rho_var_natural"] > 1e-6, m
        assert m["ratio/log_rho_var_replayed"] < 1e-10, m
        assert m["ratio/routing_share"] == pytest.approx(1.0, abs=1e-6)
    finally:
        derived.close()
        run.close()
