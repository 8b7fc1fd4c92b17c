"""The routing-replay pitfall: a replayed expert that is NOT in the router's own top-k.

Shape legend: B = sequences, S = model input positions, L = MoE layers, K = top-k, E = experts,
R = router rows (megatron order: row = s * B + b), H = hidden size.

Under replay the gate of a replayed expert must come from the live router logits over all E
experts: softmax(logits)[e], renormalised over the replayed set when the model renormalises
(Qwen3 norm_topk_prob, megatron-core moe_router_pre_softmax=False), and the router must get a
gradient through it. Gathering it from post-top-k, zero-filled probabilities (the router's own
top-k) would give exactly 0 for such an expert and no gradient: a bug reported against a
megatron fork. megatron-core 0.16.1's unfused path (moe_utils.topk_routing_with_score_function +
RouterReplay.get_replay_topk) gathers the replayed indices from the full scores: pre-softmax,
from softmax over all E; otherwise from the logits, then softmax over the K gathered.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.megatron.routing import RoutingSession
from moe_rl.routing import RouterAction


def _policy(info, cfg, **kw):
    from moe_rl.megatron.policy import build_policy

    return build_policy(ModelConfig(**{**cfg.__dict__, **kw}), ParallelConfig(), info)


def _capture(policy):
    """Forward hooks keeping each router's input [S, B, H] and output probs [R, E] (with graph)."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append((a[0], o[0]))) for r in policy.routers]
    return seen, hooks


def _hand_logits(router, inp_SBH):
    """Router logits [R, E] by hand: fp32 input @ weight^T (no bias), rows sequence-major."""
    x = inp_SBH.detach().reshape(-1, inp_SBH.shape[-1]).float()
    return x @ router.weight.detach().float().t()


def _replay_outside_topk(policy, tok):
    """Routes [B, S, L, K] = the router's top-(K-1) plus its LEAST likely expert, per row."""
    b, s = tok.shape[0], tok.shape[1] - 1
    seen, hooks = _capture(policy)
    try:
        with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL):
            policy.logprobs(tok)
    finally:
        for h in hooks:
            h.remove()
    k = policy.cfg.moe_router_topk
    per_layer = []
    for router, (inp, _) in zip(policy.routers, seen):
        logits_RE = _hand_logits(router, inp)
        order = logits_RE.argsort(dim=-1, descending=True)
        rows_RK = torch.cat([order[:, : k - 1], order[:, -1:]], dim=-1)
        per_layer.append(rows_RK.view(s, b, k).transpose(0, 1))
    return torch.stack(per_layer, dim=2)


def _expected_gates(logits_RE, idx_RK, renormalise):
    p = torch.softmax(logits_RE, dim=-1).gather(1, idx_RK)
    return p / p.sum(-1, keepdim=True) if renormalise else p


def _rows(routes_BSLK, layer):
    b, s, _, k = routes_BSLK.shape
    return routes_BSLK[:, :, layer].transpose(0, 1).reshape(-1, k)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_expert_outside_topk_gets_its_softmax_gate_and_a_gradient(
    parallel_info, tiny_model_cfg, norm_topk_prob
):
    policy = _policy(
        parallel_info, tiny_model_cfg, moe_norm_topk_prob=norm_topk_prob, num_experts=6, moe_router_topk=3
    )
    tok = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(4))
    b, s = 3, 9
    routes = _replay_outside_topk(policy, tok)
    for layer, router in enumerate(policy.routers):
        router.weight.grad = None
        seen, hooks = _capture(policy)
        try:
            with RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes) as rs:
                policy.logprobs(tok)
                inp, probs_RE = seen[layer]
                idx_RK = _rows(routes, layer)
                gates_RK = probs_RE.gather(1, idx_RK)
                # the replayed least-likely expert (last slot) of every row: its gate alone is the loss
                rs.backward(gates_RK[:, -1].sum())
        finally:
            for h in hooks:
                h.remove()
        natural_RK = _rows(rs.natural_BSLK(b, s), layer)
        # the pitfall case on every row: the last replayed expert is outside the router's own top-k,
        # so a gather from zero-filled post-top-k probabilities would give exactly 0 here
        assert not (natural_RK == idx_RK[:, -1:]).any(-1).any()
        logits_RE = _hand_logits(router, inp)
        expected = _expected_gates(logits_RE, idx_RK, renormalise=norm_topk_prob)
        torch.testing.assert_close(gates_RK.detach(), expected, rtol=1e-5, atol=1e-6)
        assert (gates_RK[:, -1] > 1e-4).all()
        # the experts outside the replayed set get nothing (the dispatcher sees only the replayed K)
        assert int((probs_RE.detach() != 0).sum()) <= idx_RK.numel()
        # the router weight's gradient is the gradient of the hand formula through that gate
        w = router.weight.detach().float().clone().requires_grad_()
        x = inp.detach().reshape(-1, inp.shape[-1]).float()
        hand = _expected_gates(x @ w.t(), idx_RK, renormalise=norm_topk_prob)[:, -1].sum()
        (g_hand,) = torch.autograd.grad(hand, w)
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0
        torch.testing.assert_close(router.weight.grad.float(), g_hand, rtol=1e-4, atol=1e-6)


def test_router_fusion_is_off():
    """megatron-core's fused top-k (moe_router_fusion, transformer-engine) returns before it consults
    RouterReplay in topk_routing_with_score_function (0.16.1): replay would be silently ignored.
    The policy's TransformerConfig must keep it off."""
    from moe_rl.megatron.model import transformer_config

    assert (
        transformer_config(ModelConfig(num_experts=4, moe_router_topk=2), ParallelConfig()).moe_router_fusion
        is False
    )
