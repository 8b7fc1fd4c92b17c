"""Packed sequences: the packed forward equals the padded one (log-probs, entropy, routes, every
gradient), routes stay aligned for record / replay / natural capture across packings and
micro-batch splits (the misalignment bugs of verl #7106 and SkyRL #1908), pack bookkeeping."""

import pytest
import torch

from moe_rl.config import ParallelConfig
from moe_rl.megatron.packing import pack_rows, padding_share, token_budget_chunks
from moe_rl.routing import RouterAction

LENS = [16, 5, 11, 1, 9, 16]  # input positions per row (mixed; T - 1 = 16)


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy


def batch(lens=LENS, t=17, v=64, seed=0):
    """Right-padded rows (padding is token 0 past each row's end), their input lengths."""
    tok = torch.randint(1, v, (len(lens), t), generator=torch.Generator().manual_seed(seed))
    lens_B = torch.tensor(lens)
    tok[torch.arange(t)[None, :] > lens_B[:, None]] = 0
    return tok, lens_B


def valid(lens_B, s=16):
    return torch.arange(s)[None, :] < lens_B[:, None]


def test_pack_rows_layout():
    tok, lens_B = batch()
    pack = pack_rows(tok, lens_B, multiple=4)
    assert pack.n == sum(LENS) and pack.p % 4 == 0 and pack.p - pack.n < 4
    assert pack.cu_seqlens.tolist()[: len(LENS) + 1] == [0, 16, 21, 32, 33, 42, 58]
    assert torch.equal(pack.inputs_P[: pack.n], tok[:, :-1][valid(lens_B)])
    assert torch.equal(pack.scatter_BS(pack.gather_BS(tok[:, :-1])), tok[:, :-1] * valid(lens_B))
    assert padding_share(lens_B, 16) == pytest.approx(1 - sum(LENS) / 96)
    with pytest.raises(ValueError, match="input lengths"):
        pack_rows(tok, torch.tensor([17, 1, 1, 1, 1, 1]))


def test_token_budget_chunks_keep_order_and_budget():
    lens_B = torch.tensor(LENS)
    parts = token_budget_chunks(lens_B, 20, start=3)
    assert [(p.start, p.stop) for p in parts] == [(3, 4), (4, 7), (7, 8), (8, 9)]
    assert [(p.start, p.stop) for p in token_budget_chunks(lens_B, 1000)] == [(0, 6)]
    assert len(token_budget_chunks(lens_B, 1)) == 6  # a row longer than the budget goes alone
    assert token_budget_chunks(lens_B[:0], 20) == []  # no probe rows: no micro-batch
    from moe_rl.trainer.rl import chunks

    assert chunks(0, 0) == [] and chunks(5, 0) == [slice(0, 5)] and chunks(5, 2)[-1] == slice(4, 5)


def _forward(policy, tok, lens_B, routing, packed, routes=None):
    """Log-probs, entropy, natural routes (+ recorded) and every gradient of one forward/backward."""
    policy.model.zero_grad(set_to_none=True)
    pack = policy.pack(tok, lens_B) if packed else None
    mask_BT = torch.zeros(tok.shape, dtype=torch.float32)
    mask_BT[:, 1:] = valid(lens_B).float()
    with RoutingSession(policy, routing, routes_BSLK=routes, pack=pack) as rs:
        out = policy.logprobs(tok, with_entropy=True, pack=pack)
        loss = ((out.logp_BT * (1 + torch.arange(17.0)) + 0.1 * out.entropy_BT) * mask_BT).sum()
        rs.backward(loss)
    b, s = tok.shape[0], tok.shape[1] - 1
    rec = rs.recorded_BSLK(b, s) if routing is RouterAction.RECORD else None
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return out.logp_BT * mask_BT, out.entropy_BT * mask_BT, rs.natural_BSLK(b, s), rec, grads


from moe_rl.megatron.routing import RoutingSession  # noqa: E402


@pytest.mark.parametrize("routing", ["none", "r2", "r3"])
def test_packed_equals_padded_logprobs_routes_and_gradients(policy, routing):
    tok, lens_B = batch()
    v_BS = valid(lens_B)
    replay = None
    if routing == "r3":  # replay routes that are not the policy's own choice
        g = torch.Generator().manual_seed(3)
        replay = torch.rand(6, 16, policy.num_moe_layers, 4, generator=g).argsort(-1)[..., :2]
    action = {"r2": RouterAction.RECORD, "r3": RouterAction.REPLAY}.get(routing, RouterAction.NATURAL)
    ref = _forward(policy, tok, lens_B, action, packed=False, routes=replay)
    got = _forward(policy, tok, lens_B, action, packed=True, routes=replay)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2][v_BS], ref[2][v_BS])  # natural routes, token for token
    if routing == "r2":
        assert torch.equal(got[3][v_BS], ref[3][v_BS])
    assert ref[4].keys() == got[4].keys() and len(ref[4]) > 0
    for name in ref[4]:
        torch.testing.assert_close(got[4][name], ref[4][name], atol=1e-5, rtol=1e-4, msg=name)


def test_routes_recorded_packed_replay_padded_and_across_splits(policy):
    """R2 record under one packing, replay under another packing / micro-batch split / padded:
    the replayed forward reproduces the recorded log-probs only if every token got its own row."""
    tok, lens_B = batch(seed=5)
    v_BS = valid(lens_B)
    pack = policy.pack(tok, lens_B)
    with torch.no_grad(), RoutingSession(policy, RouterAction.RECORD, pack=pack) as rs:
        rec_logp = policy.logprobs(tok, pack=pack).logp_BT
    recorded = rs.recorded_BSLK(6, 16)
    # a different split: rows 3.. alone, packed, reversed order inside the batch
    order = torch.tensor([5, 4, 3])
    sub_pack = policy.pack(tok[order], lens_B[order])
    with (
        torch.no_grad(),
        RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=recorded[order], pack=sub_pack),
    ):
        sub_logp = policy.logprobs(tok[order], pack=sub_pack).logp_BT
    torch.testing.assert_close(sub_logp, rec_logp[order], atol=1e-5, rtol=1e-5)
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=recorded) as rs2:
        pad_logp = policy.logprobs(tok).logp_BT
    mask = torch.zeros_like(pad_logp, dtype=torch.bool)
    mask[:, 1:] = v_BS
    torch.testing.assert_close(pad_logp[mask], rec_logp[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(rs2.natural_BSLK(6, 16)[v_BS], recorded[v_BS])  # R2: replay = own choice
    # a misaligned replay (routes shifted by one row) must change the log-probs: the test can fail
    shifted = recorded.roll(1, dims=0)
    with torch.no_grad(), RoutingSession(policy, RouterAction.REPLAY, routes_BSLK=shifted, pack=pack):
        bad_logp = policy.logprobs(tok, pack=pack).logp_BT
    assert not torch.allclose(bad_logp[mask], rec_logp[mask], atol=1e-4)


def test_outside_the_pack_is_zero_and_routes_distinct(policy):
    tok, lens_B = batch()
    pack = policy.pack(tok, lens_B)
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL, pack=pack) as rs:
        out = policy.logprobs(tok, with_entropy=True, pack=pack)
    outside = torch.ones(6, 17, dtype=torch.bool)
    outside[:, 1:] = ~valid(lens_B)
    assert (out.logp_BT[outside] == 0).all() and (out.entropy_BT[outside] == 0).all()
    nat = rs.natural_BSLK(6, 16)
    assert (nat[~valid(lens_B)] == torch.arange(2)).all()


@pytest.mark.parametrize("packed", [True, False])
def test_routes_only_forward_gives_the_full_forwards_routes(policy, packed):
    tok, lens_B = batch(seed=7)
    pack = policy.pack(tok, lens_B) if packed else None
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL, pack=pack) as full:
        policy.logits(tok[:, :-1], pack=pack)
    with (
        torch.no_grad(),
        RoutingSession(policy, RouterAction.NATURAL, pack=pack, stop_after_routes=True) as rs,
    ):
        assert policy.logits(tok[:, :-1], pack=pack) is None, "the forward must end at the last router"
    assert torch.equal(rs.natural_BSLK(6, 16), full.natural_BSLK(6, 16))
    with pytest.raises(ValueError, match="natural"):
        RoutingSession(policy, RouterAction.RECORD, stop_after_routes=True)


def test_hidden_state_logprob_path_packed(parallel_info, tiny_model_cfg):
    from dataclasses import replace

    from moe_rl.megatron.policy import build_policy

    tok, lens_B = batch(seed=9)
    pol = build_policy(replace(tiny_model_cfg, logprob_impl="torch"), ParallelConfig(), parallel_info)
    pack = pol.pack(tok, lens_B)
    mask = torch.zeros(tok.shape, dtype=torch.bool)
    mask[:, 1:] = valid(lens_B)
    with torch.no_grad():
        ref = pol.logprobs(tok, with_entropy=True)
        got = pol.logprobs(tok, with_entropy=True, pack=pack)
    torch.testing.assert_close(got.logp_BT[mask], ref.logp_BT[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy_BT[mask], ref.entropy_BT[mask], atol=1e-5, rtol=1e-5)
