"""GPU tier: losses, routing replay and the embedded engine on CUDA, bf16 (skipped without CUDA)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def bf16_policy(parallel_info):
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.policy import build_policy

    return build_policy(ModelConfig(dtype="bfloat16"), ParallelConfig(), parallel_info)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_losses_on_cuda_match_cpu(name):
    from moe_rl.config import AlgoConfig
    from moe_rl.losses import get_loss, loss_batch

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(8, 40, generator=g)
    old = logp + 0.05 * torch.randn(8, 40, generator=g)
    adv = torch.randn(8, generator=g)
    mask = (torch.rand(8, 40, generator=g) < 0.8).float()
    cfg = AlgoConfig(name=name)
    out = {}
    for dev in ("cpu", "cuda"):
        # a fresh leaf per device: ``logp.to("cpu")`` is ``logp`` itself, so requiring its grad
        # made the CUDA copy a non-leaf whose ``.grad`` stayed None (the first GPU run's failure)
        x = logp.detach().to(dev).clone().requires_grad_(True)
        batch = loss_batch(
            x, old.to(dev), adv.to(dev), mask.to(dev), num_sequences=8, num_tokens=float(mask.sum())
        )
        loss, m = get_loss(name)(batch, cfg)
        loss.backward()
        out[dev] = (loss.detach().cpu(), x.grad.cpu(), {k: v.detach().cpu() for k, v in m.items()})
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], atol=1e-6, rtol=1e-5)


def test_replay_on_cuda_uses_the_recorded_experts(bf16_policy):
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction

    tok = torch.randint(0, 104, (4, 65), device="cuda")
    with torch.no_grad(), RoutingSession(bf16_policy, RouterAction.RECORD) as rs:
        bf16_policy.logprobs(tok)
    rec = rs.recorded_BSLK(4, 64)
    used = []
    hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[1].clone())) for r in bf16_policy.routers]
    saved = [r.weight.detach().clone() for r in bf16_policy.routers]
    with torch.no_grad():
        for r in bf16_policy.routers:
            r.weight.mul_(1 + 0.5 * torch.randn_like(r.weight))
    try:
        with RoutingSession(bf16_policy, RouterAction.REPLAY, routes_BSLK=rec) as rs2:
            out = bf16_policy.logprobs(tok)
            rs2.backward(-out.logp_BT.float().mean())
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for r, w in zip(bf16_policy.routers, saved):
                r.weight.copy_(w)
    for i, m in enumerate(used):
        rows = rec[:, :, i].transpose(0, 1).reshape(-1, rec.shape[-1]).to(m.device)
        want = torch.zeros_like(m).scatter(1, rows, True)
        assert torch.equal(m, want), i


@pytest.mark.parametrize("decoder", ["auto", "megatron"])
def test_embedded_engine_on_cuda_matches_recompute(bf16_policy, decoder):
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.rollout.types import SamplingParams

    eng = EmbeddedEngine(bf16_policy, pad_id=0, decoder=decoder)
    ro = eng.generate(
        [[5, 6, 7, 8], [9, 10]],
        2,
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, return_routes=True),
    )
    with torch.no_grad():
        re = bf16_policy.logprobs(ro.tokens_BT.cuda()).logp_BT.cpu()
    m = ro.response_mask_BT.bool()
    # bf16 weights: the KV-cache path and the full recompute differ only by bf16 rounding
    assert (re[m] - ro.logprobs_BT[m]).abs().max() < 5e-2
