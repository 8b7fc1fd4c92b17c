"""KL to a reference policy (issue 49 item 10): the estimators and the loss term against verl's and
TRL's definitions on the same batch, the KL in the reward as verl shapes it, and the trainer's
reference (the RL stage's starting weights, frozen, swapped in for one forward per rollout batch,
routed as the training forwards, checkpointed and resumed).

verl's and TRL's formulas are written here from their definitions (verl
``trainer/ppo/core_algos.py``: ``kl_penalty_forward`` for ``kl`` / ``mse`` / ``low_var_kl``,
``agg_loss``, the actor's ``policy_loss + kl_loss * kl_loss_coef``, ``apply_kl_penalty`` and GRPO's
outcome advantage over the summed token rewards; TRL ``GRPOTrainer._compute_loss``: the k3
``per_token_kl`` added as ``beta * per_token_kl`` to every token's loss before ``loss_type``'s
aggregation), not imported: neither is a dependency.

Shape legend: B = sequences, T = padded tokens per sequence.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import AlgoConfig
from moe_rl.losses import group_advantages, sequence_kl
from tests.unit.test_losses import grad, make_batch, run

ALGOS = ("grpo", "gspo", "gspo_token")


# -- their definitions ------------------------------------------------------------------------------
def verl_kld(logprob, ref_logprob, kind):
    """verl's per-token KL of ``kl_loss_type`` / ``kl_penalty`` (kl | mse | low_var_kl)."""
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # low_var_kl, with verl's clamps
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_agg(loss_mat, mask, mode):
    """verl's ``agg_loss``: token-mean, or seq-mean-token-mean."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1)
    valid = mask.sum(-1) > 0
    return per_seq[valid].mean()


def trl_per_token_kl(per_token_logps, ref_per_token_logps):
    """TRL GRPO's ``per_token_kl`` (k3)."""
    return torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1


def trl_agg(per_token_loss, mask, loss_type):
    """TRL GRPO's aggregation: grpo (per sequence, then the batch mean) or bnpo (per token)."""
    if loss_type == "grpo":
        valid = mask.sum(-1) > 0  # TRL's completions are never empty; moe-rl's means skip empty rows
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[valid].mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


MOE_AGG = {
    "seq-mean-token-mean": "seq_mean",
    "token-mean": "token_mean",
    "grpo": "seq_mean",
    "bnpo": "token_mean",
}
VERL_NAME = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def clean(x, mask):
    return torch.where(mask, x, torch.zeros_like(x))


# -- the loss term ------------------------------------------------------------------------------------
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("name", ALGOS)
def test_the_kl_loss_term_is_verls(name, estimator, agg):
    """loss(kl_coef) - loss(0) is verl's kl_loss * kl_loss_coef, value and gradient, for every
    estimator (verl's clamps do not bind on this batch)."""
    logp, old, adv, mask, ref = make_batch(7)
    coef, aggregation = 0.25, MOE_AGG[agg]
    base, m0 = run(name, logp, old, adv, mask, AlgoConfig(name=name, aggregation=aggregation), ref=ref)
    cfg = AlgoConfig(name=name, aggregation=aggregation, kl_coef=coef, kl_estimator=estimator)
    with_kl, m1 = run(name, logp, old, adv, mask, cfg, ref=ref)
    lp, rf = clean(logp, mask), clean(ref, mask)
    theirs = coef * verl_agg(verl_kld(lp, rf, VERL_NAME[estimator]), mask, agg)
    torch.testing.assert_close(with_kl - base, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        grad(with_kl, logp) - grad(base, logp), grad(theirs, logp), rtol=1e-10, atol=1e-14
    )
    assert (
        float(m1["loss/kl"]) == pytest.approx(float(theirs.detach()), rel=1e-12)
        and float(m0["loss/kl"]) == 0.0
    )


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_the_kl_loss_term_is_trls(loss_type):
    """TRL adds beta * k3 to every token's loss before aggregating; moe-rl adds the aggregated k3
    term: the same loss and gradient (GRPO, TRL's clip band)."""
    logp, old, adv, mask, ref = make_batch(8)
    beta, lo, hi = 0.04, 0.2, 0.28
    cfg = AlgoConfig(name="grpo", eps_low=lo, eps_high=hi, aggregation=MOE_AGG[loss_type], kl_coef=beta)
    ours, metrics = run("grpo", logp, old, adv, mask, cfg, ref=ref)
    lp, od, rf = clean(logp, mask), clean(old, mask), clean(ref, mask)
    coef_1 = torch.exp(lp - od)
    coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    per_token_kl = trl_per_token_kl(lp, rf)
    theirs = trl_agg(per_token_loss + beta * per_token_kl, mask, loss_type)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad(ours, logp), grad(theirs, logp), rtol=1e-10, atol=1e-14)
    trl_kl = (per_token_kl * mask).sum() / mask.sum()  # TRL's logged "kl": the token mean
    assert float(metrics["kl/ref_k3"]) == pytest.approx(float(trl_kl), rel=1e-12)


def test_the_estimators_are_referencemds():
    """d = log pi_ref - log pi_theta: k1 = -d, k2 = d^2/2, k3 = e^d - 1 - d (docs/algorithms.md); k3 >= 0
    and zero at the reference; k1's mean estimates the KL without bias, as k3's does."""
    from moe_rl.losses import k1, k2, k3

    logp = torch.tensor([-2.0, -0.5, -1e-9, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -0.5, -2.0, -0.1], dtype=torch.float64)
    d = ref - logp
    torch.testing.assert_close(k1(logp, ref), -d)
    torch.testing.assert_close(k2(logp, ref), d**2 / 2)
    torch.testing.assert_close(k3(logp, ref), torch.exp(d) - 1 - d)
    # sampled from p, the three estimate KL(p || q); k1 and k3 without bias
    g = torch.Generator().manual_seed(0)
    p, q = (
        torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64),
        torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
    )
    x = torch.multinomial(p, 400_000, replacement=True, generator=g)
    exact = float((p * (p / q).log()).sum())
    for fn in (k1, k3):
        assert float(fn(p.log()[x], q.log()[x]).mean()) == pytest.approx(exact, rel=0.02)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_in_the_reward_is_verls(estimator):
    """verl: token_level_rewards = scores - beta * kld(old_log_prob, ref_log_prob) * mask, and GRPO's
    outcome advantage groups the summed token rewards: the same advantages as moe-rl's."""
    _, old, _, mask, ref = make_batch(9, B=8)
    scores_B = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    beta = 0.3
    od, rf = clean(old, mask), clean(ref, mask)
    token_rewards = torch.zeros_like(od)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask  # the score on the last response token
    token_rewards = torch.where(last, scores_B[:, None].expand_as(od), token_rewards)
    token_rewards = token_rewards - beta * verl_kld(od, rf, VERL_NAME[estimator]) * mask
    theirs_B = token_rewards.sum(-1)
    ours_B = scores_B - beta * sequence_kl(old, ref, mask, estimator)
    torch.testing.assert_close(ours_B, theirs_B, rtol=1e-12, atol=1e-14)
    adv_ours, _ = group_advantages(ours_B, 4, eps=1e-6)
    adv_theirs, _ = group_advantages(theirs_B, 4, eps=1e-6)
    torch.testing.assert_close(adv_ours, adv_theirs)


# -- the trainer's reference --------------------------------------------------------------------------
@pytest.fixture
def varied_rewards(monkeypatch):
    """Rewards that differ within a group: RL updates with a gradient."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))


def kl_recipe(tmp_path, name="run", minibatches=2, **algo):
    from dataclasses import replace

    from tests.tiny import tiny_e2e as tiny

    train = {"rl_steps": 3, "minibatches": minibatches}
    recipe = tiny(tmp_path, optim={"lr": 2e-2}, train=train, algo={"kl_coef": 0.1, **algo})
    return replace(recipe, train=replace(recipe.train, out_dir=str(tmp_path / name)))


def test_the_reference_is_the_rl_starts_weights_frozen(tmp_path, parallel_info, varied_rewards):
    """kl/ref_* is exactly 0 at RL step 0 (the reference is the policy then; one update per step, so
    the loss is computed before the policy moves), grows as the policy moves, and the reference's weights are those the RL stage began with, untouched by the updates;
    the swap leaves the policy's own parameters (storage included) in place."""
    from moe_rl.trainer.context import Run
    from moe_rl.trainer.loop import RLStage
    from moe_rl.trainer.metrics import read_metrics
    from moe_rl.trainer.run import _run_stages

    recipe = kl_recipe(tmp_path, minibatches=1)
    run = Run(recipe)
    try:
        run.make_optimizer("sft")
        from moe_rl.trainer.sft import run_sft

        run_sft(run)
        start = {n: p.detach().clone() for n, p in run.policy.model.named_parameters()}
        storage = {n: p.data_ptr() for n, p in run.policy.model.named_parameters()}
        run.state.finished.append("sft")
        run.state.completed["sft"] = recipe.train.sft_steps
        run.state.step = 0
        run.make_optimizer("rl")
        assert RLStage  # the stage _run_stages runs
        with run.signals:
            _run_stages(run, resumed=True)
        assert run.reference is not None
        for n, p in run.policy.model.named_parameters():
            assert torch.equal(run.reference.weights[n], start[n]), n
            assert p.data_ptr() == storage[n], f"{n}: the swap left another storage in the policy"
        moved = max(float((p - start[n]).abs().max()) for n, p in run.policy.model.named_parameters())
        assert moved > 1e-4
    finally:
        run.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert [r["kl/ref_k3"] for r in rows][0] == 0.0 and rows[0]["kl/ref_k1"] == 0.0
    assert all(r["kl/ref_k3"] > 0 and r["loss/kl"] > 0 for r in rows[1:]), rows
    assert all(r["time/reference"] > 0 for r in rows)


@pytest.mark.parametrize("routing", ["r2", "r3"])
def test_the_reference_forward_replays_the_training_routes(tmp_path, parallel_info, routing):
    """Under R2 / R3 the reference's log-probs are those of a forward of the reference weights
    replaying ``batch.replay_BSLK`` (pi_old's recorded routes; the engine's), not of its own routing:
    with selection noise on the trainer's routers the two differ."""
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction
    from moe_rl.trainer.context import Run
    from moe_rl.trainer.loop import _start
    from moe_rl.trainer.rl import collect

    recipe = kl_recipe(tmp_path, routing=routing, name="route")
    from dataclasses import replace

    recipe = replace(recipe, train=replace(recipe.train, stages=("rl",), route_noise=2.0, packing=False))
    run = Run(recipe)
    try:
        run.make_optimizer("rl")
        _start(run)
        batch, _ = collect(run, 0)
        assert batch.ref_logp_BT is not None and batch.replay_BSLK is not None
        for p in run.policy.model.parameters():  # the policy moves away: the reference must not
            p.data.add_(0.01 * torch.randn_like(p))
        got = run.reference.logprobs(run, batch)
        with run.reference.swapped_into(run.policy), torch.no_grad():
            replay = RoutingSession(run.policy, RouterAction.REPLAY, routes_BSLK=batch.replay_BSLK)
            with replay:
                want = run.policy.logprobs(batch.tokens_BT, temperature=recipe.train.temperature).logp_BT
            natural = RoutingSession(run.policy, RouterAction.NATURAL, noise=run.route_noise)
            with natural:
                own = run.policy.logprobs(batch.tokens_BT, temperature=recipe.train.temperature).logp_BT
        m = batch.mask_BT.bool()
        torch.testing.assert_close(got[m], want[m], rtol=0, atol=1e-5)
        torch.testing.assert_close(
            got[m], batch.ref_logp_BT[m], rtol=0, atol=1e-5
        )  # the same weights as at step 0
        assert float((own[m] - want[m]).abs().max()) > 1e-3  # its own routing would give other log-probs
    finally:
        run.close()


def test_the_kl_in_the_reward_shapes_the_advantages(tmp_path, parallel_info, varied_rewards):
    """With algo.kl_reward_coef the batch's advantages are the group advantages of the rewards
    less kl_reward_coef x the summed estimator of pi_old against pi_ref."""
    from dataclasses import replace

    from moe_rl.trainer.context import Run
    from moe_rl.trainer.loop import _start
    from moe_rl.trainer.rl import advantages_of, collect, rewards_of

    recipe = kl_recipe(tmp_path, kl_coef=0.0, kl_reward_coef=50.0, kl_estimator="k2", name="rew")
    recipe = replace(recipe, train=replace(recipe.train, stages=("rl",)))
    run = Run(recipe)
    try:
        run.make_optimizer("rl")
        _start(run)
        for p in run.policy.model.parameters():  # pi_old away from the reference
            p.data.add_(0.02 * torch.randn_like(p))
        captured = {}
        import moe_rl.trainer.rl as rl

        real = rl.rewards_of

        def spy(*a, **k):
            captured["r"] = real(*a, **k)
            return captured["r"]

        rl.rewards_of = spy
        try:
            batch, metrics = collect(run, 1)
        finally:
            rl.rewards_of = real
        kl_B = sequence_kl(batch.old_logp_BT, batch.ref_logp_BT, batch.mask_BT, "k2")
        assert float(kl_B.min()) > 0
        want, _ = advantages_of(run, captured["r"] - 50.0 * kl_B)
        torch.testing.assert_close(batch.adv_B, want)
        plain, _ = advantages_of(run, captured["r"])
        assert not torch.allclose(batch.adv_B, plain)
        assert metrics["kl/ref_reward_seq"] == pytest.approx(float(kl_B.mean()), rel=1e-6)
        assert rewards_of is real
    finally:
        run.close()


def test_the_reference_is_checkpointed_and_resumed(tmp_path, parallel_info, varied_rewards, caplog):
    """3 RL steps straight, against 2 steps then the run continued to 3 (``--resume`` with more
    steps): the continued run loads the reference saved at the RL start (not the weights it resumed
    with), so its third step's KL equals the straight run's. The resume names the RL step it
    continues after (it said "at rl step 0" before issue 49)."""
    import logging
    from dataclasses import replace

    from moe_rl.trainer.metrics import read_metrics
    from moe_rl.trainer.run import run

    def rl_only(name):
        recipe = kl_recipe(tmp_path, name=name)
        return replace(recipe, train=replace(recipe.train, stages=("rl",)))

    straight = rl_only("straight")
    run(straight)
    cut = rl_only("cut")
    run(replace(cut, train=replace(cut.train, rl_steps=2)))
    with caplog.at_level(logging.INFO, logger="moe_rl.trainer.state"):
        run(cut, resume=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert len(said) == 1 and said[0].endswith("after rl step 2 (the stage finished)"), said
    want = {r["step"]: r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl", "rl")}
    got = {r["step"]: r for r in read_metrics(tmp_path / "cut" / "metrics.jsonl", "rl")}
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for key in ("kl/ref_k3", "kl/ref_k1", "loss/kl", "reward/mean", "grad_norm"):
        assert got[2][key] == want[2][key], (key, got[2][key], want[2][key])
    assert want[2]["kl/ref_k3"] > 0
    assert (tmp_path / "cut" / "checkpoints" / "reference" / "latest").is_file()
