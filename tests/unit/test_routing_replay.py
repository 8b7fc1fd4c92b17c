"""Routing capture and replay on the megatron-core policy (world of one)."""

import pytest
import torch

from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.megatron.routing import RoutingSession, sanitize_routes
from moe_rl.routing import RouterAction
from moe_rl.routing.flip import flip_rate


def _policy(info, cfg, **kw):
    from moe_rl.megatron.policy import build_policy

    return build_policy(ModelConfig(**{**cfg.__dict__, **kw}), ParallelConfig(), info)


def _used_experts(policy):
    """Forward hooks that record which experts the dispatcher actually used, per layer."""
    used = []
    hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[1].clone())) for r in policy.routers]
    return used, hooks


def _map(routes_BSLK, layer, num_experts):
    b, s, _, k = routes_BSLK.shape
    rows = routes_BSLK[:, :, layer].transpose(0, 1).reshape(-1, k)
    return torch.zeros(rows.shape[0], num_experts, dtype=torch.bool).scatter(1, rows, True)


def _perturb(policy, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in policy.routers:
            r.weight.mul_(1 + scale * torch.randn(r.weight.shape, generator=g))


@pytest.mark.parametrize("recompute", [False, True])
def test_record_perturb_replay(parallel_info, tiny_model_cfg, recompute):
    policy = _policy(parallel_info, tiny_model_cfg, recompute=recompute)
    tok = torch.randint(0, 64, (4, 21), generator=torch.Generator().manual_seed(1))
    b, s = 4, 20
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rs:
        policy.logprobs(tok)
    rec = rs.recorded_BSLK(b, s)
    assert torch.equal(rec, rs.natural_BSLK(b, s))  # RECORD stores the natural choice
    _perturb(policy)
    used, hooks = _used_experts(policy)
    try:
        with RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=rec) as rs2:
            out = policy.logprobs(tok)
            rs2.backward(-out.logp_BT.sum())
    finally:
        for h in hooks:
            h.remove()
    calls = 2 if recompute else 1  # activation recompute replays in backward too
    assert len(used) == calls * len(policy.routers)
    n = len(policy.routers)
    for i, m in enumerate(used):
        layer = i if i < n else 2 * n - 1 - i  # backward recomputes the layers in reverse order
        assert torch.equal(m, _map(rec, layer, tiny_model_cfg.num_experts)), i
    natural = rs2.natural_BSLK(b, s)
    flips = flip_rate(natural.reshape(b * s, *natural.shape[2:]), rec.reshape(b * s, *rec.shape[2:]))
    assert flips["flip/rate"] > 0.05, "the perturbed router's own choice must differ (capture is natural)"
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in policy.routers)


def test_without_replay_the_perturbed_router_changes_experts(parallel_info, tiny_model_cfg):
    policy = _policy(parallel_info, tiny_model_cfg)
    tok = torch.randint(0, 64, (4, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rs:
        policy.logprobs(tok)
    rec = rs.recorded_BSLK(4, 20)
    _perturb(policy)
    used, hooks = _used_experts(policy)
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL):
        policy.logprobs(tok)
    for h in hooks:
        h.remove()
    assert any(not torch.equal(m, _map(rec, i, 4)) for i, m in enumerate(used))


def test_replay_with_a_different_minibatch_split(parallel_info, tiny_model_cfg):
    """Routes recorded on the whole batch replay on any row slice of it."""
    policy = _policy(parallel_info, tiny_model_cfg)
    tok = torch.randint(0, 64, (6, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rs:
        full = policy.logprobs(tok).logp_BT
    rec = rs.recorded_BSLK(6, 12)
    _perturb(policy, 0.3)
    for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
        used, hooks = _used_experts(policy)
        with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=rec[sl]):
            policy.logprobs(tok[sl])
        for h in hooks:
            h.remove()
        for i, m in enumerate(used):
            assert torch.equal(m, _map(rec[sl], i, 4))
    assert full.shape == (6, 13)


def test_gate_weight_replay_reproduces_old_logprobs_exactly(parallel_info, tiny_model_cfg):
    policy = _policy(parallel_info, tiny_model_cfg)
    tok = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rs:
        old = policy.logprobs(tok).logp_BT
    gates = rs.recorded_gates_BSLK(3, 10)
    routes = rs.recorded_BSLK(3, 10)
    _perturb(policy, 0.3)
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes) as rs2:
        idx_only = policy.logprobs(tok).logp_BT
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=routes, gates_BSLK=gates):
        both = policy.logprobs(tok).logp_BT
    assert rs2 is not None
    # only the router changed: replaying experts and gate weights restores pi_old exactly,
    # replaying experts alone leaves the gate-weight part of the mismatch
    torch.testing.assert_close(both, old, atol=1e-6, rtol=0)
    assert (idx_only - old).abs().max() > 1e-4


def test_session_always_resets_even_when_the_step_raises(parallel_info, tiny_model_cfg):
    policy = _policy(parallel_info, tiny_model_cfg)
    tok = torch.randint(0, 64, (2, 9))
    rec = torch.zeros(2, 8, 2, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="boom"):
        with RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=rec):
            raise RuntimeError("boom")
    for r in policy.routers:
        assert r.router_replay.router_replay_action is None
        assert r.router_replay.target_topk_idx is None
        assert "gating" not in r.__dict__
    # and the next plain forward routes naturally
    with torch.no_grad():
        policy.logprobs(tok)


def test_sanitize_padding_rows():
    r = torch.tensor([[3, 1], [0, 0], [2, 2], [0, 1]])
    assert sanitize_routes(r, 2).tolist() == [[3, 1], [0, 1], [0, 1], [0, 1]]


@pytest.mark.parametrize("packing", [False, True])
def test_replay_rows_replays_those_rows_and_routes_the_others_naturally(
    parallel_info, tiny_model_cfg, packing
):
    """One forward of the rows twice over, the first copy routed naturally and the second with
    recorded routes replayed (``replay_rows``, what the routing share's probe runs): the experts the
    dispatcher uses, the log-probs and the captured natural routes of each copy are those of a
    natural forward and of a replayed forward of the rows alone."""
    policy = _policy(parallel_info, tiny_model_cfg)
    b, s = 3, 12
    tok = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(4))
    lens = torch.tensor([12, 7, 10])
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD) as rs:
        policy.logprobs(tok)
    rec = rs.recorded_BSLK(b, s)
    _perturb(policy, 0.5)

    def forward(rows_tok, rows_lens, **kw):
        pack = policy.pack(rows_tok, rows_lens) if packing else None
        used, hooks = _used_experts(policy)
        try:
            with torch.no_grad(), RoutingSession(policy, pack=pack, **kw) as session:
                logp = policy.logprobs(rows_tok, pack=pack).logp_BT
        finally:
            for h in hooks:
                h.remove()
        return logp, used, session.natural_BSLK(rows_tok.shape[0], s)

    nat_logp, nat_used, nat_routes = forward(tok, lens, action=RouterAction.NATURAL)
    rep_logp, rep_used, _ = forward(tok, lens, action=RouterAction.REPLAY, routes_BSLK=rec)
    valid = torch.arange(s)[None] < lens[:, None]
    assert not torch.equal(nat_routes[valid], rec[valid])  # the perturbed routers choose other experts
    both = torch.cat([torch.zeros_like(rec), rec])  # the natural copy's entries are never read
    flags = torch.tensor([False] * b + [True] * b)
    logp, used, routes = forward(
        torch.cat([tok, tok]),
        torch.cat([lens, lens]),
        action=RouterAction.REPLAY,
        routes_BSLK=both,
        replay_rows=flags,
    )
    torch.testing.assert_close(logp[:b][:, :s][valid], nat_logp[:, :s][valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(logp[b:][:, :s][valid], rep_logp[:, :s][valid], atol=1e-5, rtol=0)
    assert torch.equal(routes[:b][valid], nat_routes[valid])
    if not packing:  # router rows are sequence-major: row = position * rows + row index
        for layer, (m, m_nat, m_rep) in enumerate(zip(used, nat_used, rep_used)):
            m = m.view(s, 2 * b, -1)
            assert torch.equal(m[:, :b], m_nat.view(s, b, -1)), layer
            assert torch.equal(m[:, b:], m_rep.view(s, b, -1)), layer
            assert torch.equal(m_rep, _map(rec, layer, 4))


def test_replay_rows_is_refused_where_it_cannot_mean_anything(parallel_info, tiny_model_cfg):
    policy = _policy(parallel_info, tiny_model_cfg)
    rec = torch.zeros(2, 8, 2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="replay_rows"):
        RoutingSession(policy, RouterAction.NATURAL, replay_rows=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="one flag per row"):
        RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=rec, replay_rows=torch.tensor([True]))
    tok = torch.randint(0, 64, (2, 9))
    with RoutingSession(
        policy, RouterAction.REPLAY, routes_BSLK=rec, replay_rows=torch.tensor([True, False])
    ) as rs:
        out = policy.logprobs(tok).logp_BT
        with pytest.raises(RuntimeError, match="without gradients"):
            rs.backward(out.sum())
    assert all(getattr(r.router_replay, "natural_rows_R", None) is None for r in policy.routers)
