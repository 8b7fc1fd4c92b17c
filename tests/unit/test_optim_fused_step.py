"""Adam's step count survives a resume, a rollback and a reset whichever layout keeps it.

torch's Adam (megatron-core's fallback, so on CPU) keeps ``step`` per parameter; transformer-engine's
and apex's ``FusedAdam`` (megatron-core's choice wherever either is installed, so on every GPU
cluster) keep it in the param group. ``GroupStepAdam`` is a stand-in with FusedAdam's layout and
update (``transformer_engine/pytorch/optimizers/fused_adam.py``: ``group["step"]`` advanced once per
step, bias correction from it), put where megatron-core's builder looks up ``Adam``.
"""

import pytest
import torch

from moe_rl.config import OptimConfig, ParallelConfig

N, M = 3, 3  # steps before the checkpoint, steps after it


class GroupStepAdam(torch.optim.Optimizer):
    """Adam(W) keeping ``step`` in the param group, as TE's and apex's FusedAdam do."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        capturable=False,  # megatron-core 0.19 passes it (optimizer_cuda_graph), as FusedAdam takes it
    ):
        if capturable:
            raise NotImplementedError("the stand-in has no CUDA-graph-capturable step")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if p.grad is None:
                    continue
                g = p.grad
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                else:
                    g = g + group["weight_decay"] * p
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (state["exp_avg_sq"] / bc2).sqrt().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)


@pytest.fixture
def group_step_adam(monkeypatch):
    """megatron-core built as if transformer-engine were installed, with the stand-in FusedAdam."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    monkeypatch.setattr(mopt, "Adam", GroupStepAdam)
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(dopt, "Adam", GroupStepAdam)
    monkeypatch.setattr(dopt, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(dopt, "USING_TE_OPTIMIZER", True)


def _tokens(seed):
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))


def _train(policy, opt, seeds):
    for s in seeds:
        (-policy.logprobs(_tokens(s)).logp_BT.mean()).backward()
        assert opt.step()["skipped"] == 0


def _weights(policy):
    return [p.detach().clone() for p in policy.parameters()]


def _assert_same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def _policy(tiny_model_cfg, parallel_info, seed):
    from moe_rl.megatron.policy import build_policy

    cfg = tiny_model_cfg.__class__(**{**tiny_model_cfg.__dict__, "seed": seed})
    return build_policy(cfg, ParallelConfig(), parallel_info)


@pytest.mark.parametrize("distributed", [False, True])
def test_resume_and_rollback_keep_the_group_step(
    group_step_adam, parallel_info, tiny_model_cfg, tmp_path, distributed
):
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer

    cfg = OptimConfig(lr=1e-3, grad_clip=0.0, distributed=distributed)
    policy = _policy(tiny_model_cfg, parallel_info, 0)
    opt = Optimizer(policy.model, cfg, parallel_info)
    assert all(isinstance(o.optimizer, GroupStepAdam) for o in opt.inner)
    _train(policy, opt, range(N))
    save_checkpoint(tmp_path, N, policy.model, opt)
    _train(policy, opt, range(N, N + M))  # uninterrupted: N + M steps
    want = _weights(policy)
    assert {g["step"] for o in opt.inner for g in o.optimizer.param_groups if g["params"]} == {N + M}

    # resume: a fresh policy and optimizer load step N, then train M steps
    other = _policy(tiny_model_cfg, parallel_info, 99)
    opt2 = Optimizer(other.model, cfg, parallel_info)
    load_checkpoint(tmp_path, other.model, opt2)
    assert {g["step"] for o in opt2.inner for g in o.optimizer.param_groups if g["params"]} == {N}
    _train(other, opt2, range(N, N + M))
    _assert_same(_weights(other), want)

    # rollback (Checkpointer.rollback -> load_checkpoint): the live optimizer, already at N + M
    load_checkpoint(tmp_path, policy.model, opt)
    assert {g["step"] for o in opt.inner for g in o.optimizer.param_groups if g["params"]} == {N}
    _train(policy, opt, range(N, N + M))
    _assert_same(_weights(policy), want)


def test_a_reset_restarts_the_group_step(group_step_adam, parallel_info, tiny_model_cfg, tmp_path):
    """A checkpoint saved before the first step loads as a reset: Adam starts again at step 1."""
    from moe_rl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from moe_rl.megatron.optim import Optimizer

    cfg = OptimConfig(lr=1e-3, grad_clip=0.0)
    policy = _policy(tiny_model_cfg, parallel_info, 0)
    opt = Optimizer(policy.model, cfg, parallel_info)
    save_checkpoint(tmp_path, 1, policy.model, opt)
    _train(policy, opt, range(M))
    want = _weights(policy)

    _train(policy, opt, range(N))  # then move on, and go back to the start
    load_checkpoint(tmp_path, policy.model, opt)
    assert opt.step_count == 0
    _train(policy, opt, range(M))
    _assert_same(_weights(policy), want)
