"""R3 with the rollout's gate weights replayed (``algo.replay_gate_weights``, issue 31), pinned by
its effect: the gates the engine reports are the ones its forward mixed the experts with, the
training forward mixes them with exactly those, and a replayed forward then reproduces the
engine's log-probs. Each test names the planted bugs it kills (``tools/mutate.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_rl.megatron.routing import RoutingSession
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing import RouterAction
from moe_rl.routing.codec import decode_routes
from moe_rl.trainer.context import Run
from moe_rl.trainer.rl import collect, rl_step
from moe_rl.trainer.timer import StepTimer
from tests.tiny import ready_run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
SCALE = torch.tensor([0.5, 0.25])
"What the wrapped engine multiplies its gates by, slot by slot (tiny model: top-2)."


@pytest.fixture(scope="module")
def policy():
    from tests.tiny import tiny_policy

    return tiny_policy(seed=5)


def _valid(ro) -> torch.Tensor:
    t = ro.tokens_BT.shape[1]
    return torch.arange(t - 1)[None] < (ro.total_lens_B[:, None] - 1)


@pytest.mark.parametrize("sigma", [0.0, 1.0], ids=["clean", "noisy"])
@pytest.mark.parametrize("decoder", ["lean", "megatron"])
def test_the_engine_returns_the_gates_it_mixed_its_experts_with(policy, decoder, sigma):
    """The trainer, replaying the engine's routes at the same weights, computes each expert's gate
    from its live router output; the engine's ``gates_BTLK`` equal those, slot for slot, on every
    valid row (0 elsewhere). Under heavy engine noise the engine chose experts the clean top-k
    would not, and its gates are still the clean scores of its chosen experts. Planted bugs killed:
    the lean decoder's gates left batch-major (rows of the prefill misplaced); megatron's captured
    at the router's clean top-k instead of its choice."""
    from moe_rl.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(policy, pad_id=0, decoder=decoder, route_noise=sigma)
    sampling = SamplingParams(max_new_tokens=8, seed=11, return_routes=True, return_gates=True)
    ro = engine.generate([[5, 6, 7], [8, 9, 10, 11]], 2, sampling)
    b, t = ro.tokens_BT.shape
    s, valid = t - 1, _valid(ro)
    routes = decode_routes(ro.routes_BTLK[:, :s])
    assert ro.gates_BTLK.dtype == torch.float32 and ro.gates_BTLK.shape == ro.routes_BTLK.shape
    assert (ro.gates_BTLK[:, :s][~valid] == 0).all() and (ro.gates_BTLK[:, s:] == 0).all()
    live = []
    taps = [
        r.register_forward_hook(lambda m, a, o: live.append(o[0].gather(1, m.router_replay.target_topk_idx)))
        for r in policy.routers
    ]
    try:
        with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes) as rs:
            policy.logits(ro.tokens_BT[:, :-1])
    finally:
        for h in taps:
            h.remove()
    want = torch.stack([g.view(s, b, -1).transpose(0, 1) for g in live], dim=2)  # [B, S, L, K]
    got = ro.gates_BTLK[:, :s]
    assert (got[valid] > 0).all()
    torch.testing.assert_close(got[valid], want[valid].float(), rtol=0, atol=1e-5)
    natural = rs.natural_BSLK(b, s)
    off_topk = (natural.sort(-1).values != routes.sort(-1).values).any(-1)[valid]
    assert bool(off_topk.any()) == (sigma > 0), float(off_topk.float().mean())


class KeepingEngine:
    """The run's engine, its last rollouts kept; with ``scale_gates`` its reported gates are
    multiplied by :data:`SCALE` slot by slot (routes, tokens and log-probs unchanged)."""

    def __init__(self, engine, *, scale_gates: bool = False):
        self.engine, self.scale_gates, self.name, self.rollouts = engine, scale_gates, "keeping", None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, sampling):
        if self.scale_gates:  # gates also where the run does not replay them, to compare with
            sampling = dataclasses.replace(sampling, return_gates=True)
        ro = self.engine.generate(prompts, n, sampling)
        if self.scale_gates:
            ro = dataclasses.replace(ro, gates_BTLK=ro.gates_BTLK * SCALE.to(ro.gates_BTLK))
        self.rollouts = ro
        return ro


def _run(tmp_path, replay_gates: bool, **train) -> Run:
    algo = {"name": "grpo", "routing": "r3", "replay_gate_weights": replay_gates}
    return ready_run(tmp_path / "run", algo=algo, train=train)


@pytest.mark.parametrize("replay_gates", [False, True])
def test_the_training_forward_mixes_the_experts_with_the_engines_gates(
    tmp_path, parallel_info, monkeypatch, replay_gates
):
    """The engine's gates are scaled on purpose (0.5 and 0.25 of slots 0 and 1). With
    ``replay_gate_weights`` the router of every training forward hands its dispatcher exactly those
    gates at the replayed experts, token for token (0 elsewhere); without it, the live router's
    (renormalised over the replayed experts: they sum to 1). The probe is the router's output after
    every hook of the session. Planted bugs killed: the gates passed but not used (the replay hook
    returns the router's own output); the training step not passing them to the session."""
    run = _run(
        tmp_path,
        replay_gates,
        packing=False,
        shuffle_minibatches=False,
        flip_probe_sequences=0,
        max_new_tokens=8,
    )
    seen = []  # (router probs [R, E], rows) of every training forward of layer 0
    wrap = RoutingSession._wrap

    def wrap_and_tap(self, i, router):
        wrap(self, i, router)
        if i == 0 and self.action is RouterAction.REPLAY:
            tap = router.register_forward_hook(
                lambda m, a, o: seen.append(o[0].detach().clone()) if torch.is_grad_enabled() else None
            )
            self._hooks.append(("hook", tap))

    monkeypatch.setattr(RoutingSession, "_wrap", wrap_and_tap)
    try:
        engine = KeepingEngine(run.engine, scale_gates=True)
        derived = run.derive(engine=engine, engine_gives_routes=True)
        rl_step(derived, 0, StepTimer())
        ro = engine.rollouts
        b, t = ro.tokens_BT.shape
        s, valid = t - 1, _valid(ro)
        routes = decode_routes(ro.routes_BTLK[:, :s])[:, :, 0]  # layer 0, [B, S, K]
        gates = ro.gates_BTLK[:, :s, 0]
        rows = b // run.recipe.train.minibatches  # one forward per minibatch (no packing, no micro-batches)
        assert len(seen) == run.recipe.train.minibatches
        for j, probs_RE in enumerate(seen):
            mb = slice(j * rows, (j + 1) * rows)
            probs = probs_RE.view(s, rows, -1).transpose(0, 1)  # [rows, S, E]
            at = probs.gather(2, routes[mb].to(probs.device))  # the gates applied to the replayed experts
            v = valid[mb]
            # nothing outside the replayed experts (straight through: live + (replayed - live), so
            # equal to rounding)
            torch.testing.assert_close(probs.sum(-1)[v], at.sum(-1)[v], rtol=0, atol=1e-6)
            if replay_gates:
                torch.testing.assert_close(at[v].cpu(), gates[mb][v], rtol=0, atol=1e-6)
            else:  # the live gates sum to 1, the scaled ones to at most 0.5
                torch.testing.assert_close(at.sum(-1)[v], torch.ones_like(at.sum(-1)[v]), rtol=0, atol=1e-6)
                assert (at.sum(-1)[v].cpu() - gates[mb].sum(-1)[v]).min() > 0.4
    finally:
        run.close()


@pytest.mark.parametrize("replay_gates", [False, True])
def test_r3_with_gates_reproduces_the_log_probs_of_an_engine_that_mixed_with_other_gates(
    tmp_path, parallel_info, monkeypatch, replay_gates
):
    """An engine at the trainer's precision, without noise, whose forward mixes its experts with
    gates other than the router's (its lean decoder's gates scaled on purpose, the tokens sampled
    and the log-probs computed with them, those gates reported). R3 with its gates replayed
    reproduces its log-probs in the pi_old recompute (to the 2e-5 the two forwards' kernels
    differ by); R3 alone, mixing with the live router's gates, does not. Planted bugs killed: the
    gates passed but not used (the replay hook returns the router's own output); the pi_old
    recompute not passing them."""
    from moe_rl.megatron.decode import Decoder

    route = Decoder._route

    def scaled(self, layer_idx, t):
        idx, probs = route(self, layer_idx, t)
        return idx, probs * SCALE.to(probs)

    monkeypatch.setattr(Decoder, "_route", scaled)
    run = _run(tmp_path, replay_gates)
    try:
        kept = KeepingEngine(run.engine)
        derived = run.derive(engine=kept, engine_gives_routes=True)
        batch, metrics = collect(derived, 0)
        ro = kept.rollouts
        mask = ro.response_mask_BT.bool()
        gap = (batch.old_logp_BT.cpu() - ro.logprobs_BT)[mask].abs().max()
        if replay_gates:
            assert gap < 2e-5, gap
        else:
            assert gap > 1e-3, gap
    finally:
        run.close()


@pytest.mark.parametrize("aux", [0.0, 0.1])
def test_replayed_gates_pass_the_live_gates_gradient_to_the_router(parallel_info, aux):
    """The replayed gates are used straight through: the forward mixes with them, the backward
    takes the live gates' gradient, so the router still learns from the policy loss (and from its
    aux loss, which megatron attaches to the router's output). Planted bugs killed: the gates
    replayed as constants (the router gets no policy gradient) and the hook returning a fresh
    tensor (no gradient at all)."""
    from tests.tiny import tiny_policy

    policy = tiny_policy(seed=5, moe_aux_loss_coeff=aux)
    tokens = torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    b, s = 2, 12
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rec:
        policy.logits(tokens[:, :-1])
    routes, gates = rec.recorded_BSLK(b, s), rec.recorded_gates_BSLK(b, s)
    policy.train()
    with RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes, gates_BSLK=gates * 0.5) as rs:
        rs.backward(policy.logprobs(tokens).logp_BT.sum())
    grads = [r.weight.grad for r in policy.routers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(
        p.grad is not None and p.grad.any() for p in policy.model.decoder.layers[0].mlp.experts.parameters()
    )
