"""GPU tier: issue 31's routing switches on CUDA in bf16 (skipped without CUDA): selection noise drawn
from a per-device generator, replayed routes exact under it, the engine's own noise and gate
weights replayed by the trainer, and the replayed gates' straight-through gradient. The CPU
references are tests/unit/test_route_noise.py and tests/unit/test_replay_gates.py."""

import pytest
import torch

from moe_rl.megatron.routing import RoutingSession, routed_with, selection_noise
from moe_rl.routing import RouterAction
from moe_rl.routing.noise import RouteNoise

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def policy(parallel_info):
    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.policy import build_policy

    return build_policy(ModelConfig(dtype="bfloat16"), ParallelConfig(), parallel_info)


@pytest.fixture
def noisy(policy):
    """The policy with trainer-side selection noise, reset to none afterwards."""
    with routed_with(policy, RouteNoise(0.5, seed=3)):
        yield policy


def used_experts(maps: list[torch.Tensor], b: int, s: int, k: int) -> torch.Tensor:
    """[B, S, L, K] sorted expert ids of the routing maps [S * B, E] a forward's routers returned."""
    return torch.stack([m.nonzero()[:, 1].view(s, b, k).transpose(0, 1) for m in maps], 2).sort(-1).values


def tap_maps(policy):
    maps = []
    hooks = [
        r.register_forward_hook(lambda m, a, o: maps.append(o[1].detach().clone())) for r in policy.routers
    ]
    return maps, hooks


def test_noise_draws_on_cuda_repeat_after_reseed_and_replay_stays_exact(noisy):
    tok = torch.randint(0, 104, (4, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    b, s, k = 4, 64, noisy.routers[0].topk

    def natural():
        with torch.no_grad(), RoutingSession(noisy, RouterAction.RECORD) as rs:
            noisy.logprobs(tok)
        return rs.recorded_BSLK(b, s)

    selection_noise(noisy).reseed(7)
    first, second = natural(), natural()
    selection_noise(noisy).reseed(7)
    again = natural()
    assert torch.equal(first, again)  # the CUDA generator restarts from the seed
    assert not torch.equal(first, second)  # fresh draws in every forward
    maps, hooks = tap_maps(noisy)
    try:
        with torch.no_grad(), RoutingSession(noisy, RouterAction.REPLAY, routes_BSLK=first) as rep:
            noisy.logprobs(tok)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(used_experts(maps, b, s, k).cpu(), first.sort(-1).values.cpu())
    assert not torch.equal(rep.natural_BSLK(b, s).sort(-1).values, first.sort(-1).values)


@pytest.mark.parametrize("decoder", ["auto", "megatron"])
def test_the_engines_noisy_routes_and_gates_replay_on_cuda(policy, decoder):
    """The engine routes with its own noise (the trainer's stays off); the trainer, replaying its
    routes, uses exactly those experts, and the engine's gates equal the trainer's live gates at
    them to bf16 rounding (a misplaced row would differ by far more)."""
    from moe_rl.rollout.embedded import EmbeddedEngine
    from moe_rl.rollout.types import SamplingParams
    from moe_rl.routing.codec import decode_routes

    engine = EmbeddedEngine(policy, pad_id=0, decoder=decoder, route_noise=1.0)
    sampling = SamplingParams(max_new_tokens=16, seed=11, return_routes=True, return_gates=True)
    ro = engine.generate([[5, 6, 7, 8], [9, 10]], 2, sampling)
    assert selection_noise(policy).sigma == 0
    b, t = ro.tokens_BT.shape
    s, k = t - 1, policy.routers[0].topk
    valid = (torch.arange(s)[None] < (ro.total_lens_B[:, None] - 1)).cuda()
    routes = decode_routes(ro.routes_BTLK[:, :s]).cuda()
    live = []
    hooks = [
        r.register_forward_hook(lambda m, a, o: live.append(o[0].gather(1, m.router_replay.target_topk_idx)))
        for r in policy.routers
    ]
    maps, map_hooks = tap_maps(policy)
    try:
        with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes) as rs:
            policy.logits(ro.tokens_BT[:, :-1].cuda())
    finally:
        for h in hooks + map_hooks:
            h.remove()
    assert torch.equal(used_experts(maps, b, s, k)[valid], routes.sort(-1).values[valid])
    want = torch.stack([g.view(s, b, -1).transpose(0, 1) for g in live], 2).float()
    got = ro.gates_BTLK[:, :s].cuda()
    assert (got[valid] > 0).all()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=3e-2)
    natural = rs.natural_BSLK(b, s).sort(-1).values
    assert (natural != routes.sort(-1).values).any(-1)[valid].any()  # the engine's noise chose otherwise


def test_replayed_gates_pass_the_live_gates_gradient_to_the_router_on_cuda(policy):
    tok = torch.randint(0, 104, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    b, s = 2, 32
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rec:
        policy.logits(tok[:, :-1])
    routes, gates = rec.recorded_BSLK(b, s), rec.recorded_gates_BSLK(b, s)
    policy.train()
    for p in policy.model.parameters():
        p.grad = None
    try:
        with RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes, gates_BSLK=gates * 0.5) as rs:
            rs.backward(policy.logprobs(tok).logp_BT.float().sum())
        grads = [r.weight.grad for r in policy.routers]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        for p in policy.model.parameters():
            p.grad = None
        policy.eval()
