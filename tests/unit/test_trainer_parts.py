"""Trainer building blocks without a model: the step timer, RunState, metric reduction, arms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_rl.losses import combine_metrics
from moe_rl.trainer.state import RunState
from moe_rl.trainer.timer import StepTimer

ROOT = Path(__file__).resolve().parents[2]


class FakeClockTimer(StepTimer):
    """A StepTimer on a clock the test advances by hand, with the hooks logged."""

    def __init__(self):
        super().__init__()
        self.now, self.events = 0.0, []

    def read(self):
        return {"s": self.now, "ticks": self.now * 10}

    def on_enter(self, phase):
        self.events.append(("enter", phase))

    def on_exit(self, phase):
        self.events.append(("exit", phase))


def test_nested_records_are_excluded_from_the_enclosing_phase():
    t = FakeClockTimer()
    with t.record("rollout"):
        t.now += 2.0
    with t.record("train"):
        t.now += 1.0
        with t.record("probe"):
            t.now += 0.5
        t.now += 3.0
        with t.record("probe"):  # a phase recorded twice accumulates
            t.now += 0.25
    assert t.seconds == {"rollout": 2.0, "train": 4.0, "probe": 0.75}
    assert t.totals["train"]["ticks"] == pytest.approx(40.0)  # every clock is made exclusive
    assert t.total() == pytest.approx(6.75) == t.now  # each moment counted once
    assert t.events[2:6] == [("enter", "train"), ("enter", "probe"), ("exit", "probe"), ("enter", "probe")]


def test_a_phase_that_raises_is_still_recorded():
    t = FakeClockTimer()
    with pytest.raises(RuntimeError), t.record("sync"):
        t.now += 1.5
        raise RuntimeError("engine down")
    assert t.seconds == {"sync": 1.5} and t.events[-1] == ("exit", "sync")


def test_the_real_clock_nests_too():
    t = StepTimer()
    with t.record("outer"):
        with t.record("inner"):
            torch.ones(1000).sum()
    assert t.seconds["outer"] >= 0 and t.seconds["inner"] > 0
    assert t.total() == pytest.approx(t.seconds["outer"] + t.seconds["inner"])


def test_run_state_round_trips_through_checkpoint_meta():
    state = RunState(
        stage="rl",
        step=3,
        checkpoint_seq=7,
        sentinel={"best_reward": 0.5, "below": 1, "rollbacks": 0},
        lr_scale=0.25,
        finished=["sft"],
    )
    meta = json.loads(json.dumps(state.to_meta()))  # what meta.json holds
    assert RunState.from_meta(meta) == state
    assert meta["done"] == ["sft"] and meta["ckpt_seq"] == 7  # the keys older checkpoints used
    # an older checkpoint's meta (no sentinel, no lr_scale yet) still loads
    full = RunState(stage="rl", completed={"sft": 4}, run_id="abc", metrics_offset=123)
    assert RunState.from_meta(json.loads(json.dumps(full.to_meta()))) == full
    old = RunState.from_meta({"stage": "sft", "step": 4, "done": [], "ckpt_seq": 2})
    assert old == RunState(stage="sft", step=4, checkpoint_seq=2)
    assert old.step_of("sft") == 4 and old.step_of("rl") == 0


def test_combine_metrics_micro_minibatch_and_data_parallel():
    def parts(scale):
        return [
            {
                "loss/pg": torch.tensor(1.0 * scale),
                "ratio/token_min": torch.tensor(0.9),
                "ratio/token_max": torch.tensor(1.1 * scale),
            },
            {
                "loss/pg": torch.tensor(2.0 * scale),
                "ratio/token_min": torch.tensor(0.8),
                "ratio/token_max": torch.tensor(1.0),
            },
        ]

    minibatches = [combine_metrics(parts(1)), combine_metrics(parts(2))]  # micro-batches add up
    assert float(minibatches[0]["loss/pg"]) == 3.0 and float(
        minibatches[1]["ratio/token_max"]
    ) == pytest.approx(2.2)
    calls = []

    def fake_all_reduce(t, op):  # a second rank with the same values
        calls.append(op)
        if op == "sum":
            t.mul_(2)

    out = combine_metrics(minibatches, mean=True, all_reduce=fake_all_reduce)
    assert float(out["loss/pg"]) == pytest.approx(2 * (3.0 + 6.0) / 2)  # mean over M, sum over ranks
    assert float(out["ratio/token_min"]) == pytest.approx(0.8)
    assert float(out["ratio/token_max"]) == pytest.approx(2.2)
    assert sorted(calls) == ["max", "min", "sum"]  # one all-reduce per op
    with pytest.raises(KeyError, match="METRIC_REDUCTIONS"):
        combine_metrics([{"grad_norm": torch.tensor(1.0)}])


def test_arms_are_one_definition_of_overrides():
    from moe_rl.config import load_recipe
    from moe_rl.lab.arms import ARMS, COMPARE_ARMS, DEMO_ARMS, VARIANTS, arm_dir, arm_overrides

    assert set(DEMO_ARMS) <= set(COMPARE_ARMS) and arm_dir("GRPO+R2") == "grpo_r2"
    assert set(COMPARE_ARMS) == set(ARMS) | set(VARIANTS)
    for name in COMPARE_ARMS:
        r = load_recipe(ROOT / "recipes/demo/base.yaml", arm_overrides(name))
        algo, of = r.algo, VARIANTS[name]["of"] if name in VARIANTS else name
        assert (algo.name, algo.routing) == (ARMS[of]["algo"]["name"], ARMS[of]["algo"]["routing"])
        assert (algo.clip_low, algo.clip_high) == ((0.2, 0.27) if algo.name == "grpo" else (3e-4, 4e-4))
    # a variant is its arm plus exactly its overrides
    chaos = load_recipe(ROOT / "recipes/demo/base.yaml", arm_overrides("CHAOS"))
    assert (
        chaos.train.start_jitter == 1e-7
        and chaos.algo == load_recipe(ROOT / "recipes/demo/base.yaml", arm_overrides("GRPO")).algo
    )
    with pytest.raises(KeyError, match="GRPO"):
        arm_overrides("PPO")


def test_sentinel_reward_rule_and_rollback_budget():
    from moe_rl.config import SentinelConfig
    from moe_rl.trainer.sentinel import Sentinel

    cfg = SentinelConfig(reward_window=2, reward_action="rollback", max_rollbacks=1)
    sentinel = Sentinel(cfg)
    actions = [sentinel.check({"reward/mean": r}).action for r in (0.02, 0.4, 0.1, 0.1, 0.3, 0.1, 0.1)]
    # 0.02 never arms it; two steps under 0.5 x 0.4 roll back once, the next two stop the run
    assert actions == ["off", "off", "off", "rollback", "off", "off", "stop"]
    state = dict(sentinel.state)
    assert Sentinel(cfg, state).state == state  # the state survives a checkpoint as a plain dict
    verdict = Sentinel(SentinelConfig(grad_action="stop", max_grad_norm=10.0)).check(
        {"grad_norm": float("nan")}
    )
    assert verdict.fired == ["grad"] and verdict.action == "stop"


def test_sentinel_sees_a_dead_policy_and_rolls_back_then_stops():
    import math

    from moe_rl.config import SentinelConfig
    from moe_rl.trainer.sentinel import Sentinel, dead_policy

    healthy = {"entropy/mean": math.log(104) - 0.01, "grad_norm": 0.3, "adv/zero_std_frac": 0.5}
    assert dead_policy(healthy, 104) is None
    uniform = {**healthy, "entropy/mean": math.log(104) - 1e-6}
    assert "uniform output" in dead_policy(uniform, 104)
    assert dead_policy(uniform, None) is None  # no vocabulary given: the entropy check is off
    flat = {**healthy, "grad_norm": 0.0}
    assert "gradient norm exactly 0" in dead_policy(flat, 104)
    # no learning signal (every group's rewards equal): a zero gradient is expected, not death
    assert dead_policy({**flat, "adv/zero_std_frac": 1.0}, 104) is None
    # every informative sequence clipped (GSPO's sequence clip off-policy): zero gradient, alive
    assert dead_policy({**flat, "clip/seq_frac": 0.5, "clip/token_frac": 0.5}, 104) is None
    assert dead_policy({**flat, "clip/token_frac": 0.0, "clip/seq_frac": 0.0}, 104) is not None
    assert "non-finite weights" in dead_policy({**healthy, "weights/finite": 0.0}, 104)
    sentinel = Sentinel(SentinelConfig(max_rollbacks=1), vocab_size=104)  # every detector at "log"
    verdicts = [sentinel.check(uniform) for _ in range(2)]
    assert [v.action for v in verdicts] == ["rollback", "stop"] and verdicts[0].fired == ["dead"]


def test_rollback_compounds_the_learning_rate_cut(tmp_path, parallel_info):
    """Each rollback multiplies the live LR scale; the checkpoint's (older) scale is not reloaded."""
    from moe_rl.config import OptimConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.trainer.state import Checkpointer
    from tests.tiny import tiny_policy

    policy = tiny_policy()
    ckpt = Checkpointer(tmp_path, policy.model, keep=2)
    opt = Optimizer(policy.model, OptimConfig(), parallel_info)
    live = RunState(stage="rl", step=2, lr_scale=1.0, run_id="r")
    ckpt.save(opt, live)
    for want in (0.5, 0.25, 0.125):
        live = ckpt.rollback(opt, live, 0.5)
        assert live.lr_scale == want and opt.lr_scale == want and live.step == 2
