"""Packing in the RL step: one step on packed micro-batches (any token budget) gives the padded
step's metrics and parameters, under every routing mode; the flip probe's reused "before" routes
are exactly what the probe forward computes."""

import pytest
import torch

from moe_rl.trainer.rl import collect, natural_routes, rl_step
from moe_rl.trainer.run import Run
from moe_rl.trainer.timer import StepTimer
from tests.tiny import tiny_e2e as tiny

KEYS = ("loss/pg", "grad_norm", "entropy/mean", "ratio/token_max", "flip/step/rate", "flip/drift/rate")


def _grad(p):
    g = getattr(p, "main_grad", None)  # megatron-core DDP keeps gradients in main_grad
    return (p.grad if g is None else g).detach().clone()


def one_step(tmp_path, routing, **train):
    """A fresh run's first RL step: its result and the gradients of its first optimizer step."""
    recipe = tiny(
        tmp_path,
        algo={"name": "gspo", "routing": routing},
        train={"stages": ["rl"], "rl_steps": 1, "max_new_tokens": 16, "flip_probe_sequences": 3, **train},
    )
    run = Run(recipe)
    try:
        run.ensure_engine()
        run.make_optimizer("rl")
        grads, step = {}, run.optimizer.step

        def step_and_keep_grads(*a, **k):
            if not grads:
                grads.update({n: _grad(p) for n, p in run.policy.model.named_parameters()})
            return step(*a, **k)

        run.optimizer.step = step_and_keep_grads
        return rl_step(run, 0, StepTimer()), grads
    finally:
        run.close()


@pytest.mark.parametrize("routing", ["none", "r2", "r3"])
def test_packed_step_equals_padded_step(tmp_path, parallel_info, monkeypatch, routing):
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))
    ref, ref_grads = one_step(tmp_path / "pad", routing, packing=False)
    lens = ref.batch.lens_B
    assert lens.min() < lens.max(), "mixed lengths: there must be padding to remove"
    assert ref.metrics["adv/abs_mean"] > 0
    for name, train in {"pack": {}, "budget": {"pack_tokens": 24}, "rows": {"micro_batch_size": 3}}.items():
        got, grads = one_step(tmp_path / name, routing, **train)
        assert torch.equal(got.batch.tokens_BT, ref.batch.tokens_BT)
        for k in KEYS:
            assert got.metrics[k] == pytest.approx(ref.metrics[k], rel=1e-4, abs=1e-6), (name, k)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():  # every gradient of the first update
            torch.testing.assert_close(g, ref_grads[n], atol=1e-6, rtol=1e-4, msg=f"{name}: {n}")
        if routing == "r2":  # recorded routes replayed in training: aligned with the padded path
            v = ref.batch.valid_BS.bool()
            assert torch.equal(got.batch.replay_BSLK[v], ref.batch.replay_BSLK[v])


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("routing", ["none", "r2", "r3"])
def test_probe_before_routes_are_the_probe_forward(tmp_path, parallel_info, routing, packing):
    recipe = tiny(
        tmp_path,
        algo={"name": "grpo", "routing": routing},
        train={"stages": ["rl"], "flip_probe_sequences": 3, "micro_batch_size": 2, "packing": packing},
    )
    run = Run(recipe)
    try:
        run.ensure_engine()
        batch, _ = collect(run, 0)
        if routing == "r3" and not packing:  # replayed padding positions: not the natural forward
            assert batch.probe_before_BSLK is None
            return
        # r3 packed: the fp32 engine's routes are the trainer's natural ones, so the replayed pass
        # was the natural forward and its captures are reused
        probe = natural_routes(run, batch.tokens_BT[:3], batch.lens_B[:3])
        assert batch.probe_before_BSLK is not None
        assert torch.equal(batch.probe_before_BSLK, probe)
    finally:
        run.close()


def test_r3_probe_before_not_reused_when_replay_differs(tmp_path, parallel_info, monkeypatch):
    """One replayed slot of a probe row that is not the router's own choice: pi_old's pass was not
    the natural forward, so the probe runs its own "before" forward (and flip/step is still measured)."""
    from moe_rl.trainer import rl

    engine_routes = rl.engine_routes

    def one_slot_changed(run, rollouts):
        routes_BSLK = engine_routes(run, rollouts).clone()
        e = int(routes_BSLK[1, 2, 1, 0])
        others = [x for x in range(run.recipe.model.num_experts) if x not in routes_BSLK[1, 2, 1].tolist()]
        routes_BSLK[1, 2, 1, 0] = others[0]
        assert others[0] != e
        return routes_BSLK

    monkeypatch.setattr(rl, "engine_routes", one_slot_changed)
    recipe = tiny(
        tmp_path,
        algo={"name": "grpo", "routing": "r3"},
        train={"stages": ["rl"], "flip_probe_sequences": 3, "micro_batch_size": 2},
    )
    run = Run(recipe)
    try:
        run.ensure_engine()
        run.make_optimizer("rl")
        timer = StepTimer()
        result = rl_step(run, 0, timer)
        assert result.batch.probe_before_BSLK is None
        assert "flip/step/rate" in result.metrics
        assert timer.seconds["probe"] > 0
    finally:
        run.close()
