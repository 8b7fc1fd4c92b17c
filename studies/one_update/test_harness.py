"""Design (e)'s harness on the tiny policy, by its effects: every arm starts from s exactly, V is drawn
from pi_s, R2 replays pi_s's routes in the scored update, the dense-equivalent's R2 and R3 are GRPO
to the bit, and the nulls are what they say."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.trainer.context import Run
from moe_rl.trainer.rl import collect, natural_routes, train_on
from studies.one_update import harness as h
from tests.tiny import tiny_rl_recipe

SIGMA = 1.0
"Engine noise for B' that surely flips routes of the untrained tiny policy (its router logits are far apart)."


@pytest.fixture(scope="module")
def varied_rewards():
    """Rewards that differ within a group (the untrained policy answers nothing right): updates with a gradient."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))
        yield


@pytest.fixture(scope="module")
def moe(tmp_path_factory, parallel_info, varied_rewards):
    """The tiny MoE at a state (shared by the tests: each starts by restoring its snapshot)."""
    run = tiny_state(tmp_path_factory.mktemp("moe"))
    yield run, h.snapshot(run)
    run.close()


def tiny_state(out, **model) -> Run:
    """A run of the tiny policy after two RL steps (Adam moments and step count are a state's)."""
    recipe = tiny_rl_recipe(
        out / "run",
        model={"moe_router_topk": 2, **model},
        optim={"lr": 5e-3},
        train={"prompts_per_step": 2, "group_size": 4, "minibatches": 2, "max_new_tokens": 8,
               "router_lr_mult": 1.0, "shuffle_minibatches": True, "flip_probe_sequences": 0},
    )  # fmt: skip
    run = Run(recipe, write_recipe=False)
    run.ensure_engine()
    run.make_optimizer("rl")
    for step in range(2):
        train_on(run, collect(run, step)[0])
        run.push_weights()
    return run


def weights(run: Run) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.policy.model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


CFG = {"arms": list(h.ARMS), "minibatches": [2, 4], "v_per_prompt": 4, "heldout": [2, 4], "w_clip": 10.0,
       "engine_sigma": SIGMA}  # fmt: skip


def test_every_arm_starts_from_s_and_s_scores_zero(moe):
    """Each arm moves the policy; after it, restore gives s back to the bit (weights and Adam: the same
    arm again gives the same theta'), and s scored as an arm is scored gives dJ = KL = 0 exactly."""
    run, snap = moe
    h.restore(run, snap)
    s_weights = weights(run)
    batches = h.collect_batches(run, 2, SIGMA)
    v = h.draw_scoring_set(run, run.task.sample(2, 2, run.recipe.task.seed), 4, seed=7)
    s_score = h.score(run, v, 10.0)
    assert s_score["dJ"] == 0.0 and s_score["kl"] == 0.0 and s_score["w_max"] == 1.0
    for name in ("GRPO", "GRPO+R2", "GSPO", "NULL-order", "NULL-jitter", "GRPO+R3"):
        h.train_arm(run, snap, h.ARMS[name], 2, batches, seed=3)
        first = weights(run)
        assert not same(first, s_weights), f"{name} did not move the policy"
        h.train_arm(run, snap, h.ARMS[name], 2, batches, seed=3)
        assert same(weights(run), first), f"{name} from the restored s is not the same update"
    h.restore(run, snap)
    assert same(weights(run), s_weights)
    assert h.score(run, v, 10.0) == s_score


def test_v_is_drawn_from_pi_s_before_any_arm_trains(moe):
    """The record's V is the set pi_s samples with V's seed (an independent draw at s has its
    fingerprint), and the engine that sampled it served pi_s (its log-probs are the trainer's at s).
    A V drawn from an updated policy (after an arm) has another fingerprint."""
    run, snap = moe
    h.restore(run, snap)
    rec = h.score_state(run, 2, {**CFG, "minibatches": [2], "arms": ["GRPO", "GRPO+R3"]}, seed=11)
    prompts = run.task.sample(2, 2, run.recipe.task.seed)
    again = h.draw_scoring_set(run, prompts, 4, h.fresh_seed("V1", 11, 2))
    assert rec["V"]["V1"]["sha"] == again.sha
    assert rec["V"]["V1"]["engine_vs_trainer_max_abs_logp"] < 1e-4
    assert torch.allclose(again.logp_s_B, again.engine_logp_B, atol=1e-4)
    assert set(rec["arms"]) == {"GRPO@M2", "GRPO+R3@M2"} and set(rec["V"]) == {"V1", "V2"}
    assert rec["s"]["dJ"] == 0.0 and rec["s"]["kl"] == 0.0
    h.train_arm(run, snap, h.ARMS["GRPO"], 2, h.collect_batches(run, 2, None), seed=0)
    assert h.draw_scoring_set(run, prompts, 4, h.fresh_seed("V1", 11, 2)).sha != again.sha


def test_r2_replays_pi_s_routes_in_the_scored_update(moe):
    """R2's theta' is the update that replays pi_s's own natural routes of B (computed here, apart
    from the harness) and no other: replaying other experts gives another theta', and so does GRPO."""
    run, snap = moe
    h.restore(run, snap)
    batches = h.collect_batches(run, 2, None)
    b = batches.B
    own = natural_routes(run, b.tokens_BT, b.lens_B)

    def r2_with(routes):
        h.restore(run, snap)
        train_on(h.arm_run(run, h.ARMS["GRPO+R2"], 2), dataclasses.replace(b, replay_BSLK=routes))
        return weights(run)

    want = r2_with(own)
    h.train_arm(run, snap, h.ARMS["GRPO+R2"], 2, batches, seed=0)
    assert same(weights(run), want)
    other = (own + 1) % run.recipe.model.num_experts  # other experts, in every slot
    assert not same(r2_with(other), want), "the routes replayed must matter here"
    h.train_arm(run, snap, h.ARMS["GRPO"], 2, batches, seed=0)
    assert not same(weights(run), want), "R2 must differ from GRPO in the MoE"


def test_b_prime_is_sampled_with_engine_noise_and_r3_replays_the_engines_routes(moe):
    run, snap = moe
    h.restore(run, snap)
    batches = h.collect_batches(run, 2, SIGMA)
    assert batches.metrics["B'/flip/rollout_vs_trainer/router_rate"] > 0.05
    assert batches.metrics["B/flip/rollout_vs_trainer/router_rate"] == 0.0
    r3, grpo = batches.B_r3, batches.B_grpo
    assert torch.equal(r3.tokens_BT, grpo.tokens_BT)  # one sample, two pi_old passes
    assert not torch.equal(r3.old_logp_BT, grpo.old_logp_BT)  # the engine's routes vs the trainer's
    assert not torch.equal(r3.replay_BSLK, grpo.old_routes_BSLK)
    assert batches.metrics["B'/mismatch/k3"] < 1e-10  # R3's pi_old replays the engine: no mismatch


def test_the_order_null_reorders_whole_minibatches_and_the_jitter_null_is_tiny(moe):
    run, snap = moe
    h.restore(run, snap)
    batches = h.collect_batches(run, 2, None)
    b = batches.B
    rows = b.tokens_BT.shape[0]
    for m in (2, 4):
        order, per = h.block_order(rows, m, seed=5), rows // m
        blocks = order.view(m, per)
        assert torch.equal(blocks - blocks[:, :1], torch.arange(per).expand(m, per))  # whole blocks
        assert sorted(blocks[:, 0].tolist()) == list(range(0, rows, per))
        assert not torch.equal(order, torch.arange(rows))
        r = h.reordered(b, m, seed=5)
        for f in ("tokens_BT", "mask_BT", "adv_B", "old_logp_BT", "replay_BSLK", "old_routes_BSLK"):
            assert torch.equal(getattr(r, f), getattr(b, f)[order]), f  # every row's parts move together
    with pytest.raises(ValueError, match="at least 2 minibatches"):
        h.reordered(b, 1, seed=5)
    h.train_arm(run, snap, h.ARMS["GRPO"], 2, batches, seed=5)
    grpo = weights(run)
    h.train_arm(run, snap, h.ARMS["NULL-jitter"], 2, batches, seed=5)
    gap = max(float((a - b).abs().max()) for a, b in zip(weights(run), grpo))
    assert 0 < gap < 1e-3


def test_in_the_dense_equivalent_r2_and_r3_are_grpo_to_the_bit(tmp_path, parallel_info, varied_rewards):
    """2 experts top-2: both are always chosen, so replaying them changes nothing."""
    run = tiny_state(tmp_path, num_experts=2)
    try:
        snap = h.snapshot(run)
        batches = h.collect_batches(run, 2, SIGMA)
        for arm, ref in (("GRPO+R2", "GRPO"), ("GRPO+R3", "GRPO'")):
            h.train_arm(run, snap, h.ARMS[arm], 2, batches, seed=0)
            got = weights(run)
            h.train_arm(run, snap, h.ARMS[ref], 2, batches, seed=0)
            assert same(got, weights(run)), arm
    finally:
        run.close()


def test_the_leave_one_out_baseline_and_dj_by_hand():
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    assert h.loo_baseline(reward, 3).tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 1.0]
    v = h.ScoringSet(
        tokens_BT=torch.zeros(4, 2, dtype=torch.long),
        mask_BT=torch.ones(4, 2),
        lens_B=torch.ones(4, dtype=torch.long),
        reward_B=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        baseline_B=h.loo_baseline(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2),
        logp_s_B=torch.zeros(4, dtype=torch.float64),
        engine_logp_B=torch.zeros(4, dtype=torch.float64),
        group=2,
    )
    logw = torch.tensor([0.5, -0.5, 3.0, 0.0], dtype=torch.float64)
    got = h.score_from(logw, v, w_clip=10.0)
    w = logw.exp()
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    assert got["dJ"] == pytest.approx(float(((w - 1) * adv).mean()), abs=1e-15)
    assert got["kl"] == pytest.approx(float((w - 1 - logw).mean()), abs=1e-15)
    assert got["dJ_clip"] == got["dJ"]  # no w above 10 with a non-zero advantage
    big = h.score_from(torch.tensor([3.0, 0.0, 0.0, 0.0], dtype=torch.float64), v, w_clip=10.0)
    assert big["dJ_clip"] == pytest.approx((10 - 1) * 1.0 / 4) and big["dJ"] > big["dJ_clip"]
