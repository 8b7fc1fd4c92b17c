"""Routing noise (moe_rl.routing.noise, issue 31): selection noise on the routers' top-k, gates
from the clean logits, replayed routes exact whatever the noise, engine and trainer knobs apart.

Tiny policy: hidden 64, 2 layers, 4 experts top-2. Each test is pinned by its effect: the experts
a forward actually used (the router's routing map) and the gate weights it actually applied."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ConfigError, recipe_from_dict
from moe_rl.megatron.routing import RoutingSession, routed_with, selection_noise
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing import RouterAction
from moe_rl.routing.noise import RouteNoise, selection_key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
TOKENS = torch.randint(1, 64, (3, 17), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "pre_softmax"])
def policy(request):
    from tests.tiny import tiny_policy

    return tiny_policy(seed=5, moe_norm_topk_prob=request.param)


class RouterTap:
    """Every router's input, routing map and probs of the forwards inside the ``with``."""

    def __init__(self, policy):
        self.policy, self.seen = policy, []

    def __enter__(self):
        self.hooks = [
            r.register_forward_hook(
                lambda m, a, o, i=i: self.seen.append((i, a[0].detach(), o[0].detach(), o[1]))
            )
            for i, r in enumerate(self.policy.routers)
        ]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def natural(policy, tokens=TOKENS, noise=None):
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL, noise=noise) as rs:
        policy.logits(tokens[:, :-1])
    return rs.natural_BSLK(tokens.shape[0], tokens.shape[1] - 1)


def disagreement(a, b):
    """Share of (token, layer) routers whose expert set differs."""
    return float((a.sort(-1).values != b.sort(-1).values).any(-1).float().mean())


def test_noise_off_routes_as_before_and_noise_on_changes_some_routers(policy):
    off = RouteNoise(0.0)
    first, second = natural(policy, noise=off), natural(policy)
    assert torch.equal(first, second)
    noise = RouteNoise(0.05, seed=1)  # one value, two sessions: fresh draws in each
    noisy = [natural(policy, noise=noise) for _ in range(2)]
    assert selection_noise(policy).sigma == 0  # the session's noise ends with it
    d_pass = disagreement(noisy[0], noisy[1])  # fresh draws in every forward
    assert 0 < d_pass < 0.5, d_pass
    assert 0 < disagreement(first, noisy[0]) < 0.5


def test_noise_moves_the_selection_only_gates_come_from_the_clean_logits(policy):
    """Under heavy noise the chosen experts are often not the top-k, yet each gate equals the clean
    softmax score of its expert (pre-softmax) or the clean softmax over the chosen logits."""
    with torch.no_grad(), RouterTap(policy) as tap, routed_with(policy, RouteNoise(3.0, seed=2)):
        policy.logits(TOKENS[:, :-1])
    off_topk = 0
    for i, x, probs, routing_map in tap.seen:
        router = policy.routers[i]
        logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), router.weight.float())
        clean_top = logits.topk(2, dim=-1).indices
        chosen = routing_map.nonzero()[:, 1].view(-1, 2)
        off_topk += int((chosen.sort(-1).values != clean_top.sort(-1).values).any(-1).sum())
        if router.config.moe_router_pre_softmax:
            want = torch.softmax(logits, -1).gather(1, chosen)
        else:
            want = torch.softmax(logits.gather(1, chosen), -1)
        torch.testing.assert_close(probs.gather(1, chosen), want.to(probs), rtol=1e-5, atol=1e-6)
    assert off_topk > 0, "sigma=3 chose the clean top-k everywhere"


def test_replayed_routes_are_exact_under_noise_and_record_keeps_the_noisy_choice(policy):
    """R2's recorded routes are the (noisy) experts the pi_old pass used; replaying them under new
    noise uses exactly them, so the replayed forward's log-probs equal the recorded pass's."""
    b, s = TOKENS.shape[0], TOKENS.shape[1] - 1
    noise = RouteNoise(0.5, seed=3)
    with routed_with(policy, noise):  # the forwards outside the sessions too
        with (
            torch.no_grad(),
            RouterTap(policy) as tap,
            RoutingSession(policy, RouterAction.RECORD, noise=noise) as rec,
        ):
            logp_rec = policy.logprobs(TOKENS).logp_BT
        recorded = rec.recorded_BSLK(b, s)
        used = torch.stack([m.nonzero()[:, 1].view(s, b, 2).transpose(0, 1) for _, _, _, m in tap.seen], 2)
        assert torch.equal(recorded.sort(-1).values, used.sort(-1).values)
        assert torch.equal(rec.natural_BSLK(b, s), recorded)  # the router's own choice is the noisy one
        with (
            torch.no_grad(),
            RouterTap(policy) as tap,
            RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=recorded, noise=noise) as rep,
        ):
            logp_rep = policy.logprobs(TOKENS).logp_BT
        for i, _, _, m in tap.seen:
            assert torch.equal(m.nonzero()[:, 1].view(s, b, 2).transpose(0, 1).sort(-1).values,
                               recorded[:, :, i].sort(-1).values)  # fmt: skip
        torch.testing.assert_close(logp_rep, logp_rec, rtol=0, atol=1e-6)
        assert disagreement(rep.natural_BSLK(b, s), recorded) > 0  # the router itself would choose otherwise
        with torch.no_grad():
            logp_natural = policy.logprobs(TOKENS).logp_BT  # fresh noise, no replay
        assert (logp_natural - logp_rec).abs().max() > 1e-4


@pytest.mark.parametrize("decoder", ["lean", "megatron"])
def test_engine_noise_is_the_engines_own_and_r3_replays_it_exactly(policy, decoder):
    """The engine routes with its own noise, not the trainer's: the trainer (noise off) replaying
    the engine's routes reproduces the engine's log-probs; routing naturally it does not."""
    from moe_rl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(policy, pad_id=0, decoder=decoder, route_noise=1.0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=11, return_routes=True)
    ro = engine.generate([[5, 6, 7], [8, 9, 10, 11]], 2, sampling)
    assert selection_noise(policy).sigma == 0  # restored: the trainer's forwards keep their own
    b, t = ro.tokens_BT.shape
    from moe_rl.routing.codec import decode_routes

    routes = decode_routes(ro.routes_BTLK[:, : t - 1])
    mask = ro.response_mask_BT.bool()
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes) as rs:
        replayed = policy.logprobs(ro.tokens_BT).logp_BT
    with torch.no_grad():
        own = policy.logprobs(ro.tokens_BT).logp_BT
    torch.testing.assert_close(replayed[mask], ro.logprobs_BT[mask], rtol=0, atol=2e-5)
    assert (own[mask] - ro.logprobs_BT[mask]).abs().max() > 1e-3
    valid = torch.arange(t - 1)[None] < (ro.total_lens_B[:, None] - 1)
    assert disagreement(rs.natural_BSLK(b, t - 1)[valid], routes[valid]) > 0.05
    again = engine.generate([[5, 6, 7], [8, 9, 10, 11]], 2, sampling)  # same seed: same draws
    assert torch.equal(again.tokens_BT, ro.tokens_BT) and torch.equal(again.routes_BTLK, ro.routes_BTLK)


def test_selection_key_orders_as_the_logits():
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    key = selection_key(torch.softmax(logits, -1), pre_softmax=True)
    torch.testing.assert_close(key - key[:, :1], logits - logits[:, :1], rtol=0, atol=1e-5)
    assert torch.equal(selection_key(logits, pre_softmax=False), logits)
    with pytest.raises(ValueError, match="finite number >= 0"):
        RouteNoise(-0.1)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"train": {"route_noise": -0.1}}, "train.route_noise"),
        ({"rollout": {"route_noise": 0.05, "engine": "sglang"}}, "rollout.route_noise"),
        ({"train": {"route_noise": 0.05}, "model": {"recompute": True}}, "model.recompute"),
    ],
)
def test_route_noise_settings_that_cannot_work_are_refused_at_load(change, field):
    data = {"train": {"stages": ["rl"]}}
    for section, values in change.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        recipe_from_dict(data)
