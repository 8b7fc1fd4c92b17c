"""The megatron-core policy on CPU: log-probs, checkpoints (the optimizer: test_optim.py)."""

import pytest
import torch

from moe_rl.config import ParallelConfig
from moe_rl.kernels.logprob_reference import logprobs_entropy


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy


def tokens(b=4, t=17, v=64, seed=0):
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_log_softmax_gather(policy, temperature):
    tok = tokens()
    with torch.no_grad():
        out = policy.logprobs(tok, temperature=temperature, with_entropy=True)
        logits = policy.logits(tok[:, :-1]).float() / temperature
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        out.logp_BT[:, 1:], ref.gather(-1, tok[:, 1:, None]).squeeze(-1), atol=1e-6, rtol=0
    )
    ent = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(out.entropy_BT[:, 1:], ent, atol=1e-5, rtol=0)
    assert (out.logp_BT[:, 0] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_reference_backward_matches_autograd(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 40, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (12,), generator=g)
    w1, w2 = (
        torch.randn(12, generator=g, dtype=torch.float64),
        torch.randn(12, generator=g, dtype=torch.float64),
    )
    lp, ent = logprobs_entropy(logits, target, temperature=temperature, with_entropy=True)
    (lp * w1 + ent * w2).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits / temperature, -1)
    lp2 = ref.gather(-1, target[:, None]).squeeze(-1)
    ent2 = -(ref.exp() * ref).sum(-1)
    (lp2 * w1 + ent2 * w2).sum().backward()
    torch.testing.assert_close(lp.double(), lp2, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours, logits.grad, atol=1e-6, rtol=1e-6)


def test_crash_mid_save_keeps_previous_checkpoint(policy, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from moe_rl.megatron.checkpoint import latest_checkpoint, save_checkpoint

    first = save_checkpoint(tmp_path, 1, policy.model)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(dist_checkpointing, "save", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, policy.model)
    assert latest_checkpoint(tmp_path) == first
    monkeypatch.undo()
    second = save_checkpoint(tmp_path, 3, policy.model, keep=1)
    assert latest_checkpoint(tmp_path) == second
    assert not list(tmp_path.glob(".tmp-*")) and not first.exists()


def test_missing_checkpoint_is_a_clear_error(policy, tmp_path):
    from moe_rl.megatron.checkpoint import load_checkpoint

    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, policy.model)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hidden_state_logprob_paths_equal_the_logits_path(parallel_info, tiny_model_cfg, impl):
    """The vocab-chunked paths (torch reference, Triton kernel under the CPU interpreter) give the
    logits path's log-probs, entropy and parameter gradients."""
    import dataclasses

    from moe_rl.kernels import triton_available
    from moe_rl.megatron.policy import build_policy

    if impl == "triton" and not triton_available():
        pytest.skip("triton not installed")
    ref = build_policy(
        dataclasses.replace(tiny_model_cfg, logprob_impl="logits"), ParallelConfig(), parallel_info
    )
    alt = build_policy(
        dataclasses.replace(tiny_model_cfg, logprob_impl=impl), ParallelConfig(), parallel_info
    )
    alt.model.load_state_dict(ref.model.state_dict())
    tok = tokens(3, 12)
    outs = []
    for pol in (ref, alt):
        out = pol.logprobs(tok, temperature=0.8, with_entropy=True)
        (out.logp_BT.sum() + 0.5 * out.entropy_BT.sum()).backward()
        outs.append((out, {n: p.grad.clone() for n, p in pol.model.named_parameters()}))
    (o1, g1), (o2, g2) = outs
    torch.testing.assert_close(o2.logp_BT, o1.logp_BT, atol=2e-5, rtol=0)
    torch.testing.assert_close(o2.entropy_BT, o1.entropy_BT, atol=2e-5, rtol=0)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.parametrize(
    "poison, finite",
    [(None, True), (float("nan"), False), (float("inf"), False), (-float("inf"), False), ("overflow", True)],
)
def test_weights_finite_is_the_elementwise_definition(poison, finite):
    """The sum-first check answers exactly what ``isfinite(p).all()`` over every parameter does,
    also when finite weights overflow the sum (3e38 + 3e38 is inf in fp32)."""
    from moe_rl.megatron.checkpoint import weights_finite

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with torch.no_grad():
        if poison == "overflow":
            model[0].weight.fill_(3e38)
        elif poison is not None:
            model[1].bias[1] = poison
    assert weights_finite(model) is finite
    assert finite is all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_retention_keeps_the_newest_checkpoints_and_never_another_runs(policy, tmp_path):
    """keep=3 keeps the three newest of this run by step number (the oldest go) and every checkpoint
    of another owner. Planted bug killed: pruning the newest older checkpoints instead of the oldest
    (``make mutate`` found it surviving every other test)."""
    from moe_rl.megatron.checkpoint import checkpoint_dirs, save_checkpoint

    save_checkpoint(tmp_path, 1, policy.model, keep=3, owner="earlier-run")
    for step in range(2, 8):
        save_checkpoint(tmp_path, step, policy.model, keep=3, owner="this-run")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [
        "0001-checkpoint",  # another run's: never this run's to remove
        "0005-checkpoint",
        "0006-checkpoint",
        "0007-checkpoint",
    ]
