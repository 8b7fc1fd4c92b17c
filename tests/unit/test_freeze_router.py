"""``train.freeze_router`` (issue 31, the frozen-router arm), pinned by its effect on the weights."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import recipe_from_dict
from moe_rl.trainer.context import Run
from moe_rl.trainer.rl import rl_step
from moe_rl.trainer.sft import sft_batch, sft_step
from moe_rl.trainer.timer import StepTimer
from tests.tiny import TINY_E2E as TINY


def _weights(run: Run) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in run.policy.model.named_parameters()}


def _moved(before: dict[str, torch.Tensor], run: Run) -> set[str]:
    return {n for n, p in run.policy.model.named_parameters() if not torch.equal(p.detach(), before[n])}


@pytest.mark.parametrize("freeze", [False, True])
def test_a_frozen_router_does_not_move_in_rl_and_still_trains_in_sft(
    tmp_path, parallel_info, monkeypatch, freeze
):
    """One SFT step, then one RL step (2 updates) at a large learning rate with weight decay, on one
    DDP wrapper shared by both stages, as ``moe-rl train`` runs [sft, rl]. SFT moves the routers
    either way. With ``train.freeze_router`` the RL step leaves every router weight bit for bit as
    it was while the experts, attention and embeddings move; without it the routers move too.
    Planted bugs killed: the flag read but not applied (no frozen parameters passed to the
    optimizer); frozen gradients zeroed but lr and weight decay left on (weight decay moves them)."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))
    data = {k: dict(v) for k, v in TINY.items()}
    data["optim"] = {"lr": 1e-2, "weight_decay": 0.1}
    data["train"] = {**data["train"], "out_dir": str(tmp_path / "run"), "freeze_router": freeze}
    data["train"]["rl_steps"] = 1
    run = Run(recipe_from_dict(data))
    try:
        run.ensure_engine()
        router_names = {
            n
            for n, p in run.policy.model.named_parameters()
            if any(p is q for r in run.policy.routers for q in r.parameters())
        }
        assert len(router_names) == run.policy.num_moe_layers  # one weight per router, no bias

        run.make_optimizer("sft")
        before = _weights(run)
        cfg = run.recipe.train
        tokens, mask = sft_batch(run.task, run.tok, step=0, batch_size=8, seed=cfg.seed, max_len=64)
        sft_step(run.policy, run.optimizer, tokens, mask, run.info)
        assert router_names <= _moved(before, run), "SFT left a router where it was"

        run.make_optimizer("rl")
        before = _weights(run)
        res = rl_step(run, 0, StepTimer())
        assert res.skipped_updates == 0 and res.metrics["grad_norm"] > 0
        moved = _moved(before, run)
        others = set(before) - router_names
        assert {n for n in others if ".experts." in n} <= moved
        assert {n for n in others if "linear_qkv" in n or "linear_proj" in n} <= moved
        assert "embedding.word_embeddings.weight" in moved
        if freeze:
            assert not router_names & moved, f"frozen routers moved: {sorted(router_names & moved)}"
        else:
            assert router_names <= moved, f"routers that did not move: {sorted(router_names - moved)}"
    finally:
        run.close()


def test_frozen_parameters_step_as_if_they_had_no_gradient(parallel_info, tiny_model_cfg):
    """``Optimizer(frozen=routers)``'s steps equal torch AdamW over the other parameters alone,
    clipped by *their* global norm (weight decay on, clipping active), and leave the routers as
    they were: a frozen router adds nothing to the norm, as with ``requires_grad_(False)``.
    Planted bug killed: the frozen gradients left in (lr_mult 0 alone): the norm, and so the clip
    of every other parameter, then includes the routers'."""
    from moe_rl.config import OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    policy = build_policy(tiny_model_cfg, ParallelConfig(), parallel_info)
    frozen = [p for r in policy.routers for p in r.parameters()]
    is_frozen = [any(p is q for q in frozen) for p in policy.parameters()]
    live = [p.detach().clone().requires_grad_(True) for p, f in zip(policy.parameters(), is_frozen) if not f]
    ref = torch.optim.AdamW(
        [
            {"params": [q for q in live if q.dim() >= 2], "weight_decay": 0.1},
            {"params": [q for q in live if q.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    start = [p.detach().clone() for p, f in zip(policy.parameters(), is_frozen) if f]
    opt = Optimizer(
        policy.model, OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5), parallel_info, frozen=frozen
    )
    for seed in range(2):
        tok = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
        router_term = sum(p.pow(2).sum() for p in frozen)  # router gradients as large as the rest
        (-policy.logprobs(tok).logp_BT.mean() + 20 * router_term).backward()
        assert all(p.main_grad.norm() > 0.5 for p in frozen)
        grads = [p.main_grad.clone() for p, f in zip(policy.parameters(), is_frozen) if not f]
        norm = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        for q, g in zip(live, grads):
            q.grad = g * min(1.0, 0.5 / (float(norm) + 1e-6))
        ref.step()
        stats = opt.step()
        assert stats["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert all(torch.equal(p.detach(), s) for p, s in zip(frozen, start))
    for p, q in zip([p for p, f in zip(policy.parameters(), is_frozen) if not f], live):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mult", [0.25, 4.0])
def test_scaled_routers_step_at_their_multiple_of_the_learning_rate(parallel_info, tiny_model_cfg, mult):
    """``Optimizer(scaled=(routers, mult))``'s steps equal torch AdamW with the routers in a group
    of their own at ``mult`` x the learning rate and the weight decay (``train.router_lr_mult``,
    issue 31's volatility dial), every other parameter as before. Planted bug killed: the
    multiplier not given to megatron-core's param groups."""
    from moe_rl.config import OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import build_policy

    policy = build_policy(tiny_model_cfg, ParallelConfig(), parallel_info)
    routers = [p for r in policy.routers for p in r.parameters()]
    is_router = [any(p is q for q in routers) for p in policy.parameters()]
    copies = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]
    ref = torch.optim.AdamW(
        [
            {
                "params": [q for q, r in zip(copies, is_router) if r],
                "lr": 1e-2 * mult,
                "weight_decay": 0.1 * mult,
            },
            {"params": [q for q, r in zip(copies, is_router) if not r and q.dim() >= 2], "weight_decay": 0.1},
            {"params": [q for q, r in zip(copies, is_router) if not r and q.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    opt = Optimizer(
        policy.model,
        OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1e9),
        parallel_info,
        scaled=(routers, mult),
    )
    for seed in range(2):
        tok = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
        (-policy.logprobs(tok).logp_BT.mean()).backward()
        for q, p in zip(copies, policy.parameters()):
            q.grad = p.main_grad.clone()
        ref.step()
        opt.step()
    for p, q in zip(policy.parameters(), copies):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)


def test_router_lr_mult_moves_the_routers_that_much_further_in_rl(tmp_path, parallel_info, monkeypatch):
    """One RL step (one minibatch: one Adam update) from the same start, prompts and seed at
    ``train.router_lr_mult`` 1 and 4: Adam's first update moves each weight by about its learning
    rate, so the routers move 4 times as far and every other weight as far. Planted bug killed:
    the recipe field read but not handed to the optimizer."""
    from moe_rl.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "reward", lambda self, prompt, text: float(len(text) % 2))
    moved = {}
    for mult in (1.0, 4.0):
        data = {k: dict(v) for k, v in TINY.items()}
        data["train"] = {**data["train"], "out_dir": str(tmp_path / f"m{mult}"), "stages": ["rl"], "rl_steps": 1,
                         "minibatches": 1, "router_lr_mult": mult, "flip_probe_sequences": 0}  # fmt: skip
        run = Run(recipe_from_dict(data))
        try:
            run.ensure_engine()
            run.make_optimizer("rl")
            before = _weights(run)
            rl_step(run, 0, StepTimer())
            router_ids = {id(p) for r in run.policy.routers for p in r.parameters()}
            moved[mult] = {
                kind: max(
                    float((p.detach() - before[n]).abs().max())
                    for n, p in run.policy.model.named_parameters()
                    if (id(p) in router_ids) == (kind == "router")
                )
                for kind in ("router", "other")
            }
        finally:
            run.close()
    assert moved[4.0]["router"] == pytest.approx(4 * moved[1.0]["router"], rel=0.02), moved
    assert moved[4.0]["other"] == pytest.approx(moved[1.0]["other"], rel=0.02), moved
