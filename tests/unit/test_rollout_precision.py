"""Rollout precision (``rollout.dtype`` / ``rollout.router_dtype``): the embedded engine samples
from its own low-precision copy of the trainer's weights, as an SGLang server does.

Reference tests: at the policy's own precision the engine shares the weights and the rollout
log-probs equal the trainer's (zero mismatch); in bf16 / fp16 the copy holds the trainer's
weights cast (refreshed at every update), computes in that dtype on both forwards, and its
log-probs and routes differ from the trainer's by a small, measurable amount; building the copy
leaves the trainer's RNG where it was.
"""

import pytest
import torch

from moe_rl.rollout.embedded import EmbeddedEngine
from moe_rl.rollout.embedded_forward import rollout_policy
from moe_rl.rollout.types import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3, 4], [20, 21, 22, 23]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3, return_routes=True)


@pytest.fixture(scope="module")
def policy():
    from tests.tiny import tiny_policy

    return tiny_policy(num_experts=8, seed=11)


def trainer_view(policy, rollouts):
    """The trainer's fp32 log-probs and natural routes ``[B, S, L, K]`` of the rollout tokens."""
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction

    b, t = rollouts.tokens_BT.shape
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL) as session:
        logp_BT = policy.logprobs(rollouts.tokens_BT).logp_BT
    return logp_BT, session.natural_BSLK(b, t - 1)


def test_own_precision_shares_the_weights_and_matches_exactly(policy):
    assert rollout_policy(policy, "fp32", "same") is policy
    assert rollout_policy(policy, "fp32", "fp32") is policy
    engine = EmbeddedEngine(policy, pad_id=0, dtype="fp32")
    assert engine.policy is policy
    ro = engine.generate(PROMPTS, 2, SAMPLING)
    logp_BT, _ = trainer_view(policy, ro)
    m = ro.response_mask_BT.bool()
    assert torch.allclose(ro.logprobs_BT[m], logp_BT[m], atol=1e-5)


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("router_dtype", ["same", "fp32"])
def test_replica_holds_cast_weights_and_its_router_dtype(policy, dtype, torch_dtype, router_dtype):
    replica = rollout_policy(policy, dtype, router_dtype)
    assert replica is not policy
    router_names = {n for n, _ in replica.model.named_parameters() if ".router." in n}
    assert router_names
    for (name, p), (_, q) in zip(replica.model.named_parameters(), policy.model.named_parameters()):
        want = torch.float32 if (name in router_names and router_dtype == "fp32") else torch_dtype
        assert p.dtype == want, name
        assert not p.requires_grad
        assert torch.equal(p, q.to(want)), name
    assert replica.model.config.moe_router_dtype == ("fp32" if router_dtype == "fp32" else None)
    assert policy.model.config.moe_router_dtype == "fp32"  # the trainer's policy is untouched
    assert next(policy.model.parameters()).dtype == torch.float32


def test_building_a_replica_leaves_the_rng_alone(policy):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    rollout_policy(policy, "bf16", "same")
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("decoder", ["lean", "megatron"])
def test_bf16_rollouts_differ_a_little_from_the_fp32_trainer(policy, decoder):
    engine = EmbeddedEngine(policy, pad_id=0, decoder=decoder, dtype="bf16")
    assert next(engine.policy.model.parameters()).dtype == torch.bfloat16
    ro = engine.generate(PROMPTS, 4, SAMPLING)
    logp_BT, natural_BSLK = trainer_view(policy, ro)
    m = ro.response_mask_BT.bool()
    gap = (ro.logprobs_BT[m] - logp_BT[m]).abs()
    assert 0 < float(gap.mean()) < 0.05, float(gap.mean())  # bf16 noise: present, and small
    s = ro.tokens_BT.shape[1] - 1
    valid = torch.arange(s)[None, :] < (ro.total_lens_B[:, None] - 1)
    same = (ro.routes_BTLK[:, :s].long().sort(-1).values == natural_BSLK.sort(-1).values).all(-1)
    agree = float(same[valid].float().mean())
    assert 0.9 < agree <= 1.0, agree


def test_both_forwards_compute_the_same_bf16_model(policy):
    """Greedy rollouts of the lean decoder and megatron's path on the same bf16 copy agree."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, return_routes=False)
    lean = EmbeddedEngine(policy, pad_id=0, decoder="lean", dtype="bf16").generate(PROMPTS, 1, greedy)
    mega = EmbeddedEngine(policy, pad_id=0, decoder="megatron", dtype="bf16").generate(PROMPTS, 1, greedy)
    m = lean.response_mask_BT.bool()
    first = m.float().argmax(1)  # the first generated token of each row sees identical inputs
    rows = torch.arange(m.shape[0])
    assert torch.equal(lean.tokens_BT[rows, first], mega.tokens_BT[rows, first])
    assert torch.allclose(lean.logprobs_BT[rows, first], mega.logprobs_BT[rows, first], atol=0.05)


def test_update_weights_refreshes_the_copy(policy):
    engine = EmbeddedEngine(policy, pad_id=0, dtype="bf16")
    w = policy.model.embedding.word_embeddings.weight
    copy = engine.policy.model.embedding.word_embeddings.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(0.5)
        assert not torch.equal(copy, w.detach().to(torch.bfloat16))  # stale until the update
        assert engine.update_weights(None, "v1") == "v1"
        assert torch.equal(copy, w.detach().to(torch.bfloat16))
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_unknown_precision_is_refused(policy):
    with pytest.raises(ValueError, match="rollout dtype"):
        rollout_policy(policy, "fp8", "same")
    with pytest.raises(ValueError, match="router_dtype"):
        rollout_policy(policy, "bf16", "fp64")
