"""The lean decoder against megatron-core's forward of the same policy (reference tests)."""

from dataclasses import replace

import pytest
import torch

from moe_rl.config import ParallelConfig


def _policy(parallel_info, cfg):
    from moe_rl.megatron.policy import build_policy

    return build_policy(cfg, ParallelConfig(), parallel_info).eval()


def _megatron(policy, tok):
    """Full causal forward logits [b, T, V] and the routers' natural top-k [b, T, L, K]."""
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction

    b, t = tok.shape
    with torch.no_grad(), RoutingSession(policy, RouterAction.NATURAL) as rs:
        logits = policy.logits(tok)
    return logits.float(), rs.natural_BSLK(b, t)


def _decode(policy, tok, prefill):
    """Prefill ``prefill`` tokens, then one token per step: last-position logits of every step
    ([b, T - prefill + 1, V]) and the routes of every fed token ([b, T, L, K])."""
    from moe_rl.megatron.decode import Decoder

    dec = Decoder(policy)
    b, t = tok.shape
    dec.begin()
    cache = dec.new_cache(b, t)
    logits, routes = [], []
    for start, n in [(0, prefill)] + [(s, 1) for s in range(prefill, t)]:
        lg, r = dec.forward(cache, tok[:, start : start + n], start, want_routes=True)
        logits.append(lg.float())
        routes.append(torch.stack(r, dim=1).view(n, b, len(r), -1).transpose(0, 1))  # [b, n, L, K]
    return torch.stack(logits, 1), torch.cat(routes, 1)


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_equals_megatron_forward(parallel_info, tiny_model_cfg, seed, norm_topk):
    cfg = replace(tiny_model_cfg, seed=100 + seed, moe_norm_topk_prob=norm_topk)
    policy = _policy(parallel_info, cfg)
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, cfg.vocab_size, (5, 23), generator=g)
    full, natural = _megatron(policy, tok)
    prefill = 6
    logits, routes = _decode(policy, tok, prefill)
    # measured max |diff| ~5e-7 (fp32 summation order of different matmul shapes)
    torch.testing.assert_close(logits, full[:, prefill - 1 :], atol=5e-6, rtol=1e-5)
    # top-k sets equal (order within a token's k slots may differ on exact ties only)
    assert torch.equal(routes.sort(-1).values, natural.sort(-1).values)


def test_compacted_cache_rows_continue_exactly(parallel_info, tiny_model_cfg):
    """Dropping rows from the cache leaves the kept rows' logits unchanged."""
    from moe_rl.megatron.decode import Decoder

    policy = _policy(parallel_info, tiny_model_cfg)
    dec = Decoder(policy)
    tok = torch.randint(0, tiny_model_cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(5))
    full, _ = _megatron(policy, tok)
    dec.begin()
    cache = dec.new_cache(4, 12)
    dec.forward(cache, tok[:, :5], 0)
    rows = torch.tensor([3, 1])
    cache.keep_rows(rows)
    for s in range(5, 12):
        lg, _ = dec.forward(cache, tok[rows, s : s + 1], s)
        torch.testing.assert_close(lg, full[rows, s], atol=5e-6, rtol=1e-5)


def test_bf16_decode_close_to_megatron(parallel_info, tiny_model_cfg):
    policy = _policy(parallel_info, replace(tiny_model_cfg, dtype="bfloat16"))
    tok = torch.randint(0, tiny_model_cfg.vocab_size, (3, 14), generator=torch.Generator().manual_seed(2))
    full, _ = _megatron(policy, tok)
    logits, _ = _decode(policy, tok, 4)
    # bf16 rounding of activations differs between the two op orders: measured max ~2e-2
    torch.testing.assert_close(logits, full[:, 3:], atol=6e-2, rtol=6e-2)


def test_misuse_is_refused(parallel_info, tiny_model_cfg):
    from moe_rl.megatron.decode import Decoder

    policy = _policy(parallel_info, tiny_model_cfg)
    dec = Decoder(policy)
    with pytest.raises(RuntimeError, match="begin"):
        dec.new_cache(2, 8)
    dec.begin()
    cache = dec.new_cache(2, 8)
    tok = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="cache holds 0"):
        dec.forward(cache, tok, 2)
    dec.forward(cache, tok, 0)
    with pytest.raises(ValueError, match="prefill"):
        dec.forward(cache, tok, 3)


def test_unsupported_layouts_fall_back_to_megatron(parallel_info, tiny_model_cfg):
    from types import SimpleNamespace

    from moe_rl.megatron.decode import unsupported_reason
    from moe_rl.megatron.model import build_gpt
    from moe_rl.rollout.embedded_forward import LeanForward, MegatronForward, pick_forward

    policy = _policy(parallel_info, tiny_model_cfg)
    assert unsupported_reason(policy) is None
    assert isinstance(pick_forward(policy, "auto"), LeanForward)
    assert isinstance(pick_forward(policy, "megatron"), MegatronForward)
    tp2 = SimpleNamespace(info=replace(parallel_info, tp_size=2), model=policy.model, cfg=policy.cfg)
    assert "tensor_parallel=2" in unsupported_reason(tp2)
    assert isinstance(pick_forward(tp2, "auto"), MegatronForward)
    with pytest.raises(ValueError, match="embedded_decoder=lean cannot run"):
        pick_forward(tp2, "lean")
    stock = SimpleNamespace(
        info=parallel_info,
        cfg=policy.cfg,
        model=build_gpt(tiny_model_cfg, ParallelConfig(), stock_local=True),
    )
    assert "local spec" in unsupported_reason(stock)
    with pytest.raises(ValueError, match="embedded_decoder='fast'"):
        pick_forward(policy, "fast")


def _decode_step_ops(parallel_info, cfg, layers: int):
    """aten ops of one decode step (one token for each of 4 rows, 5 cached) of ``cfg`` at
    ``layers`` layers, by name."""
    from moe_rl.megatron.decode import Decoder
    from tests.ops import CountOps

    dec = Decoder(_policy(parallel_info, replace(cfg, num_layers=layers)))
    tok = torch.randint(0, cfg.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    dec.begin()
    cache = dec.new_cache(4, 8)
    dec.forward(cache, tok[:, :5], 0)
    with CountOps() as ops:
        dec.forward(cache, tok[:, 5:], 5, want_routes=True)
    return ops.count


def test_decode_step_ops_per_layer(parallel_info, tiny_model_cfg):
    """A decode step's host work per layer (on a GPU, its kernel launches): the RoPE tables are
    taken once per step for every layer (no per-layer unsqueeze of them), query and key rotate in
    four ops each (:func:`moe_rl.megatron.rope.rotate`: no split, neg, cat), the folded-GQA
    attention is two batched matmuls over views of the cache (no broadcasting expands), and the
    SwiGLU adds no zero offset. This tiny policy's step: 112 ops per layer at 0126d68, 91 now."""
    one, two = (_decode_step_ops(parallel_info, tiny_model_cfg, n) for n in (1, 2))
    per_layer = {k: two[k] - one.get(k, 0) for k in two if two[k] != one.get(k, 0)}
    for op in ("aten.neg", "aten.cat", "aten.expand"):
        assert op not in per_layer, f"{op}: {per_layer.get(op)} per layer ({per_layer})"
    assert per_layer["aten.unsqueeze"] == 1, per_layer  # the gate weights' column, none for RoPE
    assert sum(per_layer.values()) <= 91, (sum(per_layer.values()), per_layer)
