"""Packed rows' RoPE in one pass (moe_rl/megatron/rope.py): megatron-core's own values and
gradients, an op count that does not grow with the number of sequences, and the packed forward
of the policy running it (no op slices the RoPE table sequence by sequence)."""

import pytest
import torch

from tests.ops import CountOps

SEGMENTS = [16, 5, 11, 1, 9, 16, 3]  # the last: a TP padding segment


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy


def _cu(segments):
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments), 0)
    return cu


def _rope_fns(policy):
    """The function megatron-core's attention calls (after the policy was built) and megatron-core's
    own, the model's config, CP group and RoPE table."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    model = policy.model
    freqs = model.rotary_pos_emb(max(SEGMENTS))
    return (
        attention.apply_rotary_pos_emb,
        rope_utils.apply_rotary_pos_emb,
        model.config,
        parallel_state.get_context_parallel_group(),
        freqs,
    )


def _apply(fn, t, freqs, config, cu, cp):
    x = t.detach().clone().requires_grad_(True)
    out = fn(x, freqs, config, cu_seqlens=cu, cp_group=cp)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / out.numel())
    return out.detach(), x.grad


@pytest.mark.parametrize("table", ["per-sequence", "per-position"])
def test_one_pass_rope_equals_megatrons_values_and_gradients(policy, table):
    installed, stock, config, cp, freqs = _rope_fns(policy)
    assert installed is not stock
    cu = _cu(SEGMENTS)
    n = int(cu[-1])
    if table == "per-position":  # megatron-core's "exact mapping": the table covers the whole pack
        freqs = policy.model.rotary_pos_emb(n)
    t = torch.randn(n, 4, config.kv_channels, generator=torch.Generator().manual_seed(0))
    got, got_grad = _apply(installed, t, freqs, config, cu, cp)
    want, want_grad = _apply(stock, t, freqs, config, cu, cp)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    if table == "per-sequence":  # a sequence's rows rotate as that sequence alone, from position 0
        lo, hi = int(cu[2]), int(cu[3])
        alone, _ = _apply(stock, t[lo:hi], freqs, config, _cu([hi - lo]), cp)
        assert torch.equal(got[lo:hi], alone)


def test_unpacked_rope_is_megatrons(policy):
    installed, stock, config, cp, freqs = _rope_fns(policy)
    t = torch.randn(max(SEGMENTS), 2, 4, config.kv_channels)  # [s, b, heads, d]: no cu_seqlens
    assert torch.equal(installed(t, freqs, config, cp_group=cp), stock(t, freqs, config, cp_group=cp))


def test_one_pass_rope_op_count_does_not_grow_with_sequences(policy):
    installed, stock, config, cp, freqs = _rope_fns(policy)
    counts = {}
    for segs in ([256], [64] * 4, [8] * 32):
        cu = _cu(segs)
        t = torch.randn(256, 4, config.kv_channels)
        table = policy.model.rotary_pos_emb(max(segs))
        with CountOps() as ops:
            _apply(installed, t, table, config, cu, cp)
        counts[len(segs)] = sum(ops.count.values())
    assert counts[4] == counts[32], counts


def test_packed_forward_never_slices_the_rope_table(policy):
    from tests.unit.test_packing import batch

    tok, lens_B = batch()
    pack = policy.pack(tok, lens_B)
    table_shape = tuple(policy.model.rotary_pos_emb(pack.max_seqlen).shape)
    with CountOps() as ops:
        policy.logprobs(tok, pack=pack).logp_BT.sum().backward()
    sliced = [s for s in ops.shapes["aten.slice"] if s == table_shape]
    assert not sliced, f"{len(sliced)} slices of the RoPE table {table_shape}: RoPE ran sequence by sequence"
    assert ops.count["aten.searchsorted"] == 1  # one table gather per forward, shared by every layer


def test_packed_forward_takes_the_tables_cosine_and_sine_once(policy):
    """Every layer's query and key rotate with one cosine and one sine of the pack's table, in the
    forward and in the backward (megatron-core takes both for every rotation: 2 per layer)."""
    from tests.unit.test_packing import batch

    tok, lens_B = batch()
    pack = policy.pack(tok, lens_B)
    with CountOps() as ops:
        policy.logprobs(tok, pack=pack).logp_BT.sum().backward()
    assert ops.count["aten.cos"] == ops.count["aten.sin"] == 1, (ops.count["aten.cos"], ops.count["aten.sin"])


def test_packed_rotation_is_four_ops_forward_and_back(policy):
    """Each query and key rotates in four ops (two products, one roll, one sum; megatron-core's
    form takes six: split, neg, cat, two products, a sum) and its backward in four (two products,
    a roll, a sum of the two paths): the table's cosine and sine are ready (taken once per
    forward), so the count is the rotation's own."""
    installed, _, config, cp, _ = _rope_fns(policy)
    cu = _cu(SEGMENTS)
    n = int(cu[-1])
    table = policy.model.rotary_pos_emb(n)  # the pack's own table: no gather
    t = torch.randn(n, 4, config.kv_channels, requires_grad=True)
    installed(t.detach(), table, config, cu_seqlens=cu, cp_group=cp)  # the table's trig, cached
    with CountOps() as fwd:
        out = installed(t, table, config, cu_seqlens=cu, cp_group=cp)
    with CountOps() as bwd:
        out.backward(torch.ones_like(out))
    assert sum(fwd.count.values()) == 4, dict(fwd.count)
    for op in ("aten.split", "aten.split_with_sizes", "aten.neg", "aten.cat"):
        assert op not in fwd.count and op not in bwd.count, (dict(fwd.count), dict(bwd.count))
