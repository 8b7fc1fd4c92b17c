"""The trainer's two seams: hooks after each optimizer step (the flip probe is one), and
``Run.derive`` (a reconfigured run sharing the policy and engine, the original untouched)."""

from dataclasses import replace

import pytest
import torch

from moe_rl.routing.flip import flip_metrics
from moe_rl.trainer.context import Run
from moe_rl.trainer.hooks import OptimizerStep, StepHook
from moe_rl.trainer.rl import natural_routes, rl_step, route_flips
from moe_rl.trainer.run import run
from moe_rl.trainer.timer import StepTimer
from tests.tiny import tiny_e2e as tiny


class Recorder(StepHook):
    """Every call, and the probe rows' natural routes before and after every update: the flip
    probe's reference, computed here by the same routine the probe calls."""

    def __init__(self, rows: int):
        self.rows, self.calls, self.events, self.counts = rows, [], [], []

    def begin(self, run, step, batch):
        self.calls.append(("begin", step))
        self.before = natural_routes(run, batch.tokens_BT[: self.rows], batch.lens_B[: self.rows])

    def __call__(self, event: OptimizerStep):
        self.calls.append((event.stage, event.step, event.minibatch))
        self.events.append((event, event.run.optimizer.step_count))
        if event.batch is not None:
            b = event.batch
            after = natural_routes(event.run, b.tokens_BT[: self.rows], b.lens_B[: self.rows])
            self.counts.append(route_flips(self.before, after, b.valid_BS[: self.rows]))
            self.before = after


@pytest.fixture
def varied_rewards(monkeypatch):
    """Rewards that differ within a group: RL updates with a gradient."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))


def test_a_hook_sees_every_optimizer_step_of_both_stages(tmp_path, parallel_info, varied_rewards):
    recorder = Recorder(rows=2)  # TINY: train.flip_probe_sequences = 2, every update probed
    recipe = tiny(tmp_path, optim={"lr": 2e-2}, train={"sft_lr": 1e-3})  # RL updates that move routes
    res = run(recipe, hooks=[recorder])
    # TINY: 3 SFT steps, then 2 RL steps of 2 minibatch updates each
    assert recorder.calls == [
        ("sft", 0, 0),
        ("sft", 1, 0),
        ("sft", 2, 0),
        ("begin", 0),
        ("rl", 0, 0),
        ("rl", 0, 1),
        ("begin", 1),
        ("rl", 1, 0),
        ("rl", 1, 1),
    ]
    ev = [e for e, _ in recorder.events]
    assert [n for _, n in recorder.events] == [1, 2, 3, 1, 2, 3, 4]  # a fresh optimizer for RL
    assert all(e.minibatches == 1 and e.batch is None and "loss" in e.stats for e in ev[:3])
    assert all(e.minibatches == 2 and e.batch is not None and "grad_norm" in e.stats for e in ev[3:])
    # the trainer's own flip probe, a hook too, reports the reference's rate over the last step
    total = {k: sum(c[k] for c in recorder.counts[2:]).float() for k in recorder.counts[2]}
    want = flip_metrics(total, "flip/step")
    assert want["flip/step/rate"] > 0, "the updates must move some routes for the check to bite"
    for k in ("flip/step/rate", "flip/step/token_any"):
        assert res["rl"][k] == pytest.approx(want[k], abs=1e-12), k


def test_a_function_hook_and_flip_probe_every(tmp_path, parallel_info):
    recipe = tiny(tmp_path, train={"stages": ["rl"], "flip_probe_every": 2})
    the_run = Run(recipe)
    try:
        the_run.ensure_engine()
        the_run.make_optimizer("rl")
        seen = []
        the_run.add_hook(lambda e: seen.append((e.step, e.minibatch, e.run.optimizer.step_count)))
        m = rl_step(the_run, 7, StepTimer()).metrics
        assert seen == [(7, 0, 1), (7, 1, 2)]
        assert "flip/step/rate" in m  # probed after update 2 only
    finally:
        the_run.close()


def test_derive_reconfigures_a_copy_and_leaves_the_run_as_it_was(tmp_path, parallel_info, varied_rewards):
    recipe = tiny(tmp_path, train={"stages": ["rl"]})
    base = Run(recipe)
    try:
        base.ensure_engine()
        base.make_optimizer("rl")
        opt, engine, hooks = base.optimizer, base.engine, list(base.hooks)

        faster = base.derive(optim=replace(recipe.optim, lr=3e-3))
        assert faster.recipe.optim.lr == 3e-3 and faster.optimizer.cfg.lr == 3e-3
        assert faster.optimizer is not opt  # optim changed: a new optimizer
        assert faster.policy is base.policy and faster.engine is engine and faster.tok is base.tok

        r2 = base.derive(algo=replace(recipe.algo, routing="r2"))
        assert r2.recipe.algo.routing == "r2" and r2.optimizer is opt  # optim as it was: shared
        assert base.derive(algo=recipe.algo, new_optimizer=True).optimizer is not opt

        mine = r2.add_hook(lambda e: None)
        assert mine in r2.hooks and mine not in base.hooks
        r2.state.step = 5
        with pytest.raises(ValueError, match="model"):
            base.derive(recipe=replace(recipe, model=replace(recipe.model, num_layers=3)))

        # the original: untouched
        assert base.recipe is recipe and base.optimizer is opt and base.engine is engine
        assert base.hooks == hooks and base.state.step == 0

        # a derived run trains the shared policy; closing it leaves the original working
        before = [p.detach().clone() for p in base.policy.parameters()]
        rl_step(faster, 0, StepTimer())
        faster.close()
        assert faster.optimizer.step_count == 2 and opt.step_count == 0
        assert any(not torch.equal(a, p) for a, p in zip(before, base.policy.parameters()))
        rl_step(base, 1, StepTimer())  # its engine and sink still open
        assert opt.step_count == 2
    finally:
        base.close()


def test_the_flip_probe_takes_the_routing_shares_forward_after_the_last_update(
    tmp_path, parallel_info, varied_rewards, monkeypatch
):
    """After the last update the routing share's one forward of the probe rows (natural and replayed
    copies together) already holds their natural routes: the flip probe runs forwards after the other
    updates only (its rates, held to an independent reference by the test above, are unchanged), and
    the probes run one forward of the model per update."""
    from moe_rl.trainer import probe

    calls = []
    real = probe.natural_routes
    monkeypatch.setattr(probe, "natural_routes", lambda *a, **k: calls.append(1) or real(*a, **k))

    class ProbeForwards(StepTimer):  # the model's forwards while the probe phase is open
        def __init__(self):
            super().__init__()
            self.probing, self.forwards = False, 0

        def on_enter(self, phase):
            self.probing = phase == "probe"

        def on_exit(self, phase):
            self.probing = False

    recipe = tiny(tmp_path, train={"stages": ["rl"], "minibatches": 2})
    the_run = Run(recipe)
    try:
        the_run.ensure_engine()
        the_run.make_optimizer("rl")
        timer = ProbeForwards()
        counting = the_run.policy.model.register_forward_pre_hook(
            lambda *_: setattr(timer, "forwards", timer.forwards + timer.probing)
        )
        try:
            res = rl_step(the_run, 0, timer)
        finally:
            counting.remove()
        assert "ratio/routing_share" in res.metrics or "ratio/log_rho_var_natural" in res.metrics
        assert "flip/step/rate" in res.metrics
        before_reused = res.batch.probe_before_BSLK is not None
        assert (
            len(calls) == (0 if before_reused else 1) + 1
        )  # update 0 probed by its own forward, update 1 shared
        assert timer.forwards == len(calls) + 1, timer.forwards  # + the routing share's one forward
    finally:
        the_run.close()


def test_a_second_embedded_engine_beside_the_runs_own_adds_its_own_route_noise(tmp_path, parallel_info):
    """``Run.embedded_engine``: the run's own engine is the recipe's (no selection noise here: its
    routes are the trainer's), a second one over the same policy with ``route_noise`` chooses other
    experts for some tokens of the same sample; served through ``derive(engine=...)``."""
    from moe_rl.trainer.rl import collect

    recipe = tiny(tmp_path, train={"stages": ["rl"]})
    base = Run(recipe)
    try:
        base.ensure_engine()
        base.make_optimizer("rl")
        own = collect(base, 0)[1]
        assert own["flip/rollout_vs_trainer/router_rate"] == 0.0
        noisy = base.embedded_engine(route_noise=1.0)
        try:
            assert noisy is not base.engine and noisy.policy is base.engine.policy
            got = collect(base.derive(engine=noisy, engine_gives_routes=True), 0)[1]
        finally:
            noisy.close()
        assert got["flip/rollout_vs_trainer/router_rate"] > 0.05
        assert base.embedded_engine().route_noise.sigma == recipe.rollout.route_noise == 0.0
    finally:
        base.close()
