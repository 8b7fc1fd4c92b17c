"""Train-inference mismatch corrections, mismatch metrics and dual clip: hand-worked numbers,
verl's semantics, gradients, padding and microbatch invariance.

Shape legend: B = sequences, T = padded tokens per sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import AlgoConfig
from moe_rl.losses.core import clipped_surrogate
from moe_rl.losses.corrections import (
    CORRECTION_METRIC_REDUCTIONS,
    correction_metrics,
    correction_weights,
    correction_weights_for,
    mismatch_metrics,
)
from tests.unit.test_losses import counts, make_batch, padded, run

NAN = float("nan")
ln = math.log

# ---------------------------------------------------------------------------------------
# One hand-worked batch. rollout log-probs are 0 on valid tokens, so old = log rho exactly
# (no rounding at the inclusive bounds 0.5 and 5); NaN on padding.
#   row 0: rho = 0.4, 1, 3          row 1: rho = 0.5, 5, 6, 2     row 2: empty
#   row 3: rho = 0.1, 0.2           row 4: rho = 9, 9, 9, 9
# 13 valid tokens, 4 non-empty sequences.
RHO = [[0.4, 1.0, 3.0, None], [0.5, 5.0, 6.0, 2.0], [None] * 4, [0.1, 0.2, None, None], [9.0] * 4]


def hand_batch():
    mask = torch.tensor([[r is not None for r in row] for row in RHO])
    old = torch.tensor([[ln(r) if r is not None else NAN for r in row] for row in RHO], dtype=torch.float64)
    roll = torch.where(mask, 0.0, NAN).to(torch.float64)
    return old, roll, mask


def test_tis_hand_worked():
    old, roll, mask = hand_batch()
    w = correction_weights(old, roll, mask, method="tis", c=2.0)
    # w = min(rho, 2), 0 on padding
    expected = [[0.4, 1, 2, 0], [0.5, 2, 2, 2], [0] * 4, [0.1, 0.2, 0, 0], [2] * 4]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    m = correction_metrics(w, mask, num_sequences=4, num_tokens=13)
    # (0.4 + 1 + 2) + (0.5 + 2 + 2 + 2) + (0.1 + 0.2) + 4 * 2 = 18.2 over 13 tokens; none is 0
    assert float(m["correction/weight_mean"]) == pytest.approx(18.2 / 13, rel=1e-12)
    assert float(m["correction/masked_frac"]) == 0.0


def test_seq_tis_hand_worked():
    old, roll, mask = hand_batch()
    w = correction_weights(old, roll, mask, method="seq_tis", c=2.0)
    # products: 0.4*1*3 = 1.2; 0.5*5*6*2 = 30 -> 2; empty -> 0; 0.1*0.2 = 0.02; 9^4 -> 2
    torch.testing.assert_close(w, torch.tensor([1.2, 2.0, 0.0, 0.02, 2.0], dtype=torch.float64))
    m = correction_metrics(w, mask, num_sequences=4, num_tokens=13)
    assert float(m["correction/weight_mean"]) == pytest.approx((1.2 + 2 + 0.02 + 2) / 4, rel=1e-12)
    assert float(m["correction/masked_frac"]) == 0.0


def test_icepop_hand_worked_bounds_inclusive():
    """IcePop weights a kept token by its ratio, M(rho) = rho * 1[0.5 <= rho <= 5] (slime's
    icepop_function, TRL's token_mask): not by 1 (that is icepop_mask)."""
    old, roll, mask = hand_batch()
    w = correction_weights(old, roll, mask, method="icepop")  # defaults [0.5, 5]
    # 0.4 < 0.5 out; 0.5 and 5 are on the bounds: in, weighted 0.5 and 5; 1, 3, 2 in; 6, 9, 0.1, 0.2 out
    expected = [[0, 1, 3, 0], [0.5, 5, 0, 2], [0] * 4, [0, 0, 0, 0], [0] * 4]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    m = correction_metrics(w, mask, num_sequences=4, num_tokens=13)
    # (1 + 3) + (0.5 + 5 + 2) = 11.5 over 13 tokens (mask-only: 5 / 13); 8 of 13 dropped
    assert float(m["correction/weight_mean"]) == pytest.approx(11.5 / 13, rel=1e-12)
    assert float(m["correction/masked_frac"]) == pytest.approx(8 / 13, rel=1e-12)


def test_icepop_mask_hand_worked_bounds_inclusive():
    old, roll, mask = hand_batch()
    w = correction_weights(old, roll, mask, method="icepop_mask")  # defaults [0.5, 5], as icepop's
    expected = [[0, 1, 1, 0], [1, 1, 0, 1], [0] * 4, [0, 0, 0, 0], [0] * 4]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    m = correction_metrics(w, mask, num_sequences=4, num_tokens=13)
    assert float(m["correction/weight_mean"]) == pytest.approx(5 / 13, rel=1e-12)
    assert float(m["correction/masked_frac"]) == pytest.approx(8 / 13, rel=1e-12)


def test_icepop_is_rho_times_icepop_mask():
    """On a random batch with bounds that cut both tails: icepop = rho * icepop_mask exactly where
    kept, the same zeros, and a weight mean that differs from the mask's."""
    logp, old, adv, mask, _ = make_batch(2, B=7, spread=0.6)
    roll = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=old.dtype)
    rho = torch.where(mask, (old - roll).exp(), 0.0)
    w = correction_weights(old, roll, mask, method="icepop", low=0.7, high=1.4)
    keep = correction_weights(old, roll, mask, method="icepop_mask", low=0.7, high=1.4)
    torch.testing.assert_close(w, rho * keep, rtol=1e-12, atol=0)
    assert torch.equal(w == 0, keep == 0)
    assert 0 < int((mask & (keep == 0)).sum()) < int((mask & (keep == 1)).sum())  # both sides of a bound
    assert float((w[keep == 1] - 1).abs().max()) > 0.1  # the kept weights are not 1


def test_geo_mask_hand_worked():
    old, roll, mask = hand_batch()
    w = correction_weights(old, roll, mask, method="geo_mask", low=0.5, high=5.0)
    # geometric means: 1.2^(1/3) = 1.063 in; 30^(1/4) = 2.34 in; empty 0; sqrt(0.02) = 0.141 out; 9 out
    torch.testing.assert_close(w, torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    m = correction_metrics(w, mask, num_sequences=4, num_tokens=13)
    assert float(m["correction/weight_mean"]) == 0.5 and float(m["correction/masked_frac"]) == 0.5
    # tighter bounds around 1 reject row 1 too (2.34 > 2), keep row 0
    w2 = correction_weights(old, roll, mask, method="geo_mask", low=0.5, high=2.0)
    assert w2.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_none_and_config_defaults():
    old, roll, mask = hand_batch()
    assert correction_weights(old, roll, mask, method="none") is None
    assert correction_metrics(None, mask, num_sequences=4, num_tokens=13) == {}
    cfg = AlgoConfig(name="grpo")
    assert cfg.rollout_correction == "none" and cfg.clip_ratio_c is None and cfg.correction_c == 2.0
    assert cfg.correction_low is None and cfg.correction_high is None
    assert correction_weights_for(cfg, old, roll, mask) is None
    cfg = AlgoConfig(name="gspo_token", rollout_correction="icepop", correction_low=0.05, correction_high=7.0)
    w = correction_weights_for(cfg, old, roll, mask)
    # row 1: rho = 0.5, 5, 6, 2 all kept, weighted by rho; row 4 (rho = 9) dropped
    assert w.shape == mask.shape and float(w[4].sum()) == 0.0
    assert float(w[1].sum()) == pytest.approx(13.5, rel=1e-12)
    cfg = AlgoConfig(name="grpo", rollout_correction="icepop_mask", correction_low=0.05, correction_high=7.0)
    assert cfg.correction_bounds == (0.05, 7.0)
    w = correction_weights_for(cfg, old, roll, mask)
    assert float(w[4].sum()) == 0.0 and float(w[1].sum()) == 4.0
    assert AlgoConfig(name="grpo", rollout_correction="icepop_mask").correction_bounds == (0.5, 5.0)


def test_bad_arguments_are_refused():
    old, roll, mask = hand_batch()
    with pytest.raises(ValueError, match="unknown rollout correction 'tls'.*tis, seq_tis"):
        correction_weights(old, roll, mask, method="tls")
    with pytest.raises(ValueError, match="0 < low < high"):
        correction_weights(old, roll, mask, method="icepop", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="must all be"):
        correction_weights(old[:, :-1], roll, mask, method="tis")


# ---------------------------------------------------------------------------------------
# Mismatch metrics


def test_mismatch_metrics_hand_worked():
    old, roll, mask = hand_batch()
    m = mismatch_metrics(old, roll, mask, num_tokens=13)
    rhos = [r for row in RHO for r in row if r is not None]
    assert float(m["mismatch/abs_log_ratio"]) == pytest.approx(sum(abs(ln(r)) for r in rhos) / 13, rel=1e-12)
    assert float(m["mismatch/k3"]) == pytest.approx(sum(r - 1 - ln(r) for r in rhos) / 13, rel=1e-12)
    # |log rho| > ln 2: 0.4, 3 | 5, 6 (0.5 and 2 sit exactly on ln 2: not counted) | 0.1, 0.2 | 9 x 4
    assert float(m["mismatch/extreme_frac"]) == pytest.approx(10 / 13, rel=1e-12)
    # |sum log rho|: ln 1.2, ln 30, -, |ln 0.02| = 3.91, ln 6561 = 8.79
    assert float(m["mismatch/seq_log_ratio_abs_max"]) == pytest.approx(4 * ln(9), rel=1e-12)
    assert set(m) | {"correction/weight_mean", "correction/masked_frac"} == set(CORRECTION_METRIC_REDUCTIONS)


def test_mismatch_k3_estimates_kl_from_the_rollout_policy():
    """The tokens are drawn from pi_roll, so the token mean of k3 estimates KL(pi_roll || pi_old).

    A batch whose tokens appear with exactly pi_roll's frequencies (1/2, 1/4, 1/8, 1/8 of 8
    tokens) makes the estimate exact: the mean is KL(pi_roll || pi_old), not KL(pi_old || pi_roll).
    """
    p_roll = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    p_old = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    tokens = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])
    old, roll = p_old.log()[tokens][None], p_roll.log()[tokens][None]
    mask = torch.ones_like(old, dtype=torch.bool)
    k3 = float(mismatch_metrics(old, roll, mask, num_tokens=8)["mismatch/k3"])
    kl_roll_old = float((p_roll * (p_roll / p_old).log()).sum())
    kl_old_roll = float((p_old * (p_old / p_roll).log()).sum())
    assert k3 == pytest.approx(kl_roll_old, rel=1e-12)
    assert abs(kl_roll_old - kl_old_roll) > 0.05  # 0.606 vs 0.522


def _pieces(x, rows):
    return [x[s] for s in rows]


def _combine(parts: list[dict]) -> dict:
    ops = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}
    return {k: ops[CORRECTION_METRIC_REDUCTIONS[k]](torch.stack([p[k] for p in parts])) for k in parts[0]}


@pytest.mark.parametrize("method", ["tis", "seq_tis", "icepop", "icepop_mask", "geo_mask"])
def test_metrics_invariant_to_padding_and_split(method):
    logp, old, adv, mask, _ = make_batch(3, B=7, spread=0.6)
    roll = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0), dtype=old.dtype)
    ns, nt = counts(mask)
    w = correction_weights(old, roll, mask, method=method, low=0.85, high=1.2)
    full = {**mismatch_metrics(old, roll, mask, num_tokens=nt)}
    full.update(correction_metrics(w, mask, num_sequences=ns, num_tokens=nt))
    assert 0 < float(full["correction/masked_frac"]) or method in ("tis", "seq_tis")
    # split into row pieces (the last one empty), computed independently
    rows = [slice(0, 2), slice(2, 5), slice(5, 6), slice(6, 7)]
    parts = []
    for o, r, mk in zip(_pieces(old, rows), _pieces(roll, rows), _pieces(mask, rows)):
        piece = mismatch_metrics(o, r, mk, num_tokens=nt)
        piece.update(
            correction_metrics(
                correction_weights(o, r, mk, method=method, low=0.85, high=1.2),
                mk,
                num_sequences=ns,
                num_tokens=nt,
            )
        )
        parts.append(piece)
    torch.testing.assert_close(_combine(parts), full, rtol=1e-12, atol=1e-15)
    # right-pad with 3 columns and 2 rows of garbage
    B, T = mask.shape

    def padded(x, fill):
        x = torch.cat([x, torch.full((B, 3), fill, dtype=x.dtype)], 1)
        return torch.cat([x, torch.full((2, T + 3), fill, dtype=x.dtype)], 0)

    old_p, roll_p, mask_p = padded(old, 40.0), padded(roll, -40.0), padded(mask, False)
    w_p = correction_weights(old_p, roll_p, mask_p, method=method, low=0.85, high=1.2)
    torch.testing.assert_close(w_p[:B, :T] if w_p.dim() == 2 else w_p[:B], w)
    assert float(w_p[B:].abs().sum()) == 0.0 and (w_p.dim() == 1 or float(w_p[:, T:].abs().sum()) == 0.0)
    pad_m = mismatch_metrics(old_p, roll_p, mask_p, num_tokens=nt)
    pad_m.update(correction_metrics(w_p, mask_p, num_sequences=ns, num_tokens=nt))
    torch.testing.assert_close(pad_m, full, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------
# verl's semantics (volcengine/verl, verl/trainer/ppo/rollout_corr_helper.py, read at commit
# b178a3cd): log_ratio = old_log_prob - rollout_log_prob (compute_rollout_correction_and_rejection_mask);
# compute_rollout_correction_weights: "token" = exp(clamp(log_ratio, -20, 20)).clamp(max=threshold),
# "sequence" = exp(clamp(sum_t log_ratio, -20, 20)).clamp(max=threshold), both * response_mask;
# compute_rollout_rejection_mask: "token_k1" keeps a token when log(lower) <= -log_ratio <= log(upper),
# "seq_mean_k1" when log(lower) <= -mean_t log_ratio <= log(upper) (bounds inclusive).


def test_verl_token_is_and_token_k1_on_verls_own_mask_mode_inputs():
    # tests/trainer/ppo/test_rollout_corr.py::test_mask_mode: old = -2, rollout = -1 (rho = e^-1)
    # and -2.5 (rho = e^0.5); rollout_is="token", threshold 2; rollout_rs="token_k1", "0.5_2.0".
    old = torch.full((2, 5), -2.0)
    roll = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    w = correction_weights(old, roll, mask, method="tis", c=2.0)
    torch.testing.assert_close(w[0], torch.full((5,), math.exp(-1.0)))  # verl: ~0.368, kept
    torch.testing.assert_close(w[1], torch.full((5,), math.exp(0.5)))  # verl: ~1.649 < 2, kept
    keep = correction_weights(old, roll, mask, method="icepop_mask", low=0.5, high=2.0)
    assert keep[0].tolist() == [0.0] * 5 and keep[1].tolist() == [1.0] * 5  # verl: row 0 rejected
    m = correction_metrics(keep, mask, num_sequences=2, num_tokens=10)
    assert float(m["correction/masked_frac"]) == 0.5  # verl: rollout_rs_masked_fraction 0.5


def test_verl_sequence_is_truncation():
    # sum_t log rho = ln 1.2, ln 30, -25 with threshold 2: verl gives 1.2, 2, exp(-20) (its safety
    # clamp); here exp(-25). Equal up to exp(-20) = 2.1e-9.
    old = torch.tensor([[ln(1.2), 0.0], [ln(5.0), ln(6.0)], [-12.5, -12.5]], dtype=torch.float64)
    roll = torch.zeros_like(old)
    mask = torch.ones_like(old)
    w = correction_weights(old, roll, mask, method="seq_tis", c=2.0)
    verl = torch.tensor([1.2, 2.0, math.exp(-20.0)], dtype=torch.float64)
    torch.testing.assert_close(w, verl, rtol=1e-12, atol=2.1e-9)
    assert float(w[2]) == pytest.approx(math.exp(-25.0), rel=1e-12)


def test_verl_k1_bounds_apply_to_the_inverse_ratio():
    """verl's *_k1 rejection bounds -log rho = log(pi_roll / pi_old): its "lower_upper" bounds the
    inverse ratio. With reciprocal bounds (0.5_2.0) that is the same set as icepop_mask's on rho;
    with IcePop's asymmetric [0.5, 5] it is not: verl's "0.5_5.0" keeps 0.2 <= rho <= 2, which is
    icepop_mask here with low = 1/5, high = 1/0.5. icepop keeps the same sets, weighted by rho."""
    rho = [0.1, 0.3, 1.0, 3.0, 4.9]
    old = torch.tensor([[ln(r) for r in rho]], dtype=torch.float64)
    roll, mask = torch.zeros_like(old), torch.ones_like(old)
    verl_token_k1_0_5_5 = [0.0, 1.0, 1.0, 0.0, 0.0]  # 1/rho = 10, 3.3, 1, 0.33, 0.2 in [0.5, 5]?
    assert correction_weights(old, roll, mask, method="icepop_mask", low=0.2, high=2.0)[0].tolist() == (
        verl_token_k1_0_5_5
    )
    assert correction_weights(old, roll, mask, method="icepop_mask")[0].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    torch.testing.assert_close(
        correction_weights(old, roll, mask, method="icepop")[0],
        torch.tensor([0.0, 0.0, 1.0, 3.0, 4.9], dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
    # reciprocal bounds: the same keep set both ways (verl "0.5_2.0")
    assert correction_weights(old, roll, mask, method="icepop_mask", low=0.5, high=2.0)[0].tolist() == (
        [0.0, 0.0, 1.0, 0.0, 0.0]
    )


def test_verl_seq_mean_k1_geometric_rejection():
    # seq_mean_k1 "0.5_2.0": keep when 0.5 <= exp(-mean log rho) <= 2, i.e. 0.5 <= geo mean <= 2.
    # rows: geo means 2^(1/2) (kept), 3 (rejected), 0.4 (rejected), 1 (kept)
    old = torch.tensor([[ln(2.0), 0.0], [ln(3.0), ln(3.0)], [ln(0.4), ln(0.4)], [ln(4.0), -ln(4.0)]])
    roll, mask = torch.zeros_like(old), torch.ones_like(old)
    assert correction_weights(old, roll, mask, method="geo_mask", low=0.5, high=2.0).tolist() == [1, 0, 0, 1]


# ---------------------------------------------------------------------------------------
# IcePop as slime and TRL compute it. slime (THUDM/slime, slime/backends/megatron_utils/loss.py,
# icepop_function, read at commit 624b824a): ratio = exp(old - rollout), weight = ratio where
# tis_clip_low <= ratio <= tis_clip else 0, multiplying pg_loss. TRL (huggingface/trl,
# trl/trainer/grpo_trainer.py, read at commit f2cd5771): vllm_importance_sampling_mode="token_mask"
# takes exp((old - sampling) * mask), sets it to 0 where below clip_min or above clip_max, and
# multiplies per_token_loss by it (padding is removed by the loss's completion mask).


def slime_icepop_weights(old, roll, low, high):
    ratio = torch.exp(old - roll)
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def trl_token_mask_weights(old, roll, mask, low, high):
    ratio = torch.exp((old - roll) * mask)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("reference", ["slime", "trl"])
def test_icepop_matches_slime_and_trl(reference):
    _, old, _, mask, _ = make_batch(7, B=8, T=12, spread=0.6)
    roll = old + 0.6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5), dtype=old.dtype)
    low, high = 0.6, 1.5
    w = correction_weights(old, roll, mask, method="icepop", low=low, high=high)
    if reference == "slime":
        want = slime_icepop_weights(old, roll, low, high)
    else:
        want = trl_token_mask_weights(old, roll, mask.to(old.dtype), low, high)
    want = torch.where(mask, want, 0.0)
    torch.testing.assert_close(w, want, rtol=1e-12, atol=0)
    kept = mask & (want > 0)
    assert 0 < int(kept.sum()) < int(mask.sum()) and float((want[kept] - 1).abs().max()) > 0.1


# ---------------------------------------------------------------------------------------
# The losses take the weights


def grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


def test_grpo_weights_hand_worked():
    # one sequence, two tokens at ratio 1, A = 1, weights 0.5 and 2, seq_mean over 1 sequence:
    # J = (0.5 * 1 + 2 * 1) / 2 = 1.25; d(-J)/dlogp_t = -w_t * r_t * A / 2 = -0.25, -1.0
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp = old.clone().requires_grad_()
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    loss, m = run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo"), w=w)
    assert float(loss.detach()) == pytest.approx(-1.25, rel=1e-12)
    assert grad(loss, logp).tolist() == [[-0.25, -1.0]]
    # token_mean over 2 tokens: J = 2.5 / 2, the same here; weights do not change denominators
    loss_t, _ = run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo", aggregation="token_mean"), w=w)
    assert float(loss_t.detach()) == pytest.approx(-1.25, rel=1e-12)


def _weights(kind, mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "token":
        w = 2 * torch.rand(mask.shape, generator=g, dtype=torch.float64)
        w[0, :3] = 0.0  # masked tokens (icepop-style zeros)
        return torch.where(mask, w, NAN)  # NaN on padding must not leak
    return 2 * torch.rand(mask.shape[0], generator=g, dtype=torch.float64)


CASES = [("grpo", "token"), ("grpo", "seq"), ("gspo_token", "token"), ("gspo_token", "seq"), ("gspo", "seq")]


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
@pytest.mark.parametrize("name,kind", CASES)
def test_gradient_is_weight_times_uncorrected_gradient(name, kind, aggregation):
    """The weight is detached: d loss / d logp_t = w_t (or w_i) x the uncorrected gradient; the value
    is the weighted sum of the terms. Per-token advantages where the loss allows them."""
    token_adv = name != "gspo"
    logp, old, adv, mask, ref = make_batch(2, token_adv=token_adv)
    cfg = AlgoConfig(name=name, eps_low=0.05, eps_high=0.08, aggregation=aggregation)
    w = _weights(kind, mask)
    loss0, m0 = run(name, logp, old, adv, mask, cfg)
    g0 = grad(loss0, logp)
    w_live = w.clone().requires_grad_()  # a weight that carries a graph is still detached
    loss1, m1 = run(name, logp, old, adv, mask, cfg, w=w_live)
    g1 = grad(loss1, logp)
    w_BT = torch.where(mask, w if kind == "token" else w[:, None].expand(mask.shape), 0.0)
    torch.testing.assert_close(g1, w_BT * g0, rtol=1e-12, atol=1e-15)
    assert not torch.equal(g1, g0)
    assert m1.keys() == m0.keys() and float(m1["clip/token_frac"]) == float(m0["clip/token_frac"])
    # with unit weights the loss is the uncorrected one, bit for bit
    loss_1, _ = run(name, logp, old, adv, mask, cfg, w=torch.ones_like(w))
    assert torch.equal(loss_1, loss0)


@pytest.mark.parametrize("name,kind", CASES)
def test_weighted_loss_value_against_a_loop(name, kind):
    logp, old, adv, mask, _ = make_batch(5)
    cfg = AlgoConfig(name=name, eps_low=0.05, eps_high=0.08)
    w = _weights(kind, mask, seed=1)
    loss, _ = run(name, logp, old, adv, mask, cfg, w=w)
    ns, _ = counts(mask)
    total = 0.0
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten()
        if len(idx) == 0:
            continue
        d = (logp[i, idx] - old[i, idx]).detach()
        a = float(adv[i])
        if name == "grpo":
            r = d.exp()
        else:
            r = d.mean().exp().expand(len(idx))
        terms = torch.minimum(r * a, r.clamp(0.95, 1.08) * a)
        wt = w[i, idx] if kind == "token" else torch.full((len(idx),), float(w[i]), dtype=w.dtype)
        total -= float((wt * terms).mean()) / ns
    assert float(loss.detach()) == pytest.approx(total, rel=1e-10)


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
@pytest.mark.parametrize("name,kind", CASES)
def test_weights_leave_the_kl_term_alone(name, kind, aggregation):
    logp, old, adv, mask, ref = make_batch(6)
    w = _weights(kind, mask)
    loss = {}
    for beta in (0.0, 0.3):
        cfg = AlgoConfig(name=name, aggregation=aggregation, kl_coef=beta)
        for weighted in (False, True):
            loss[beta, weighted] = run(name, logp, old, adv, mask, cfg, ref=ref, w=w if weighted else None)[0]
    kl_w, kl = loss[0.3, True] - loss[0.0, True], loss[0.3, False] - loss[0.0, False]
    torch.testing.assert_close(kl_w, kl, rtol=1e-10, atol=1e-14)
    assert float(kl.detach()) > 0


@pytest.mark.parametrize("name,kind", CASES)
def test_weighted_loss_padding_and_microbatch_invariance(name, kind):
    logp, old, adv, mask, ref = make_batch(6, B=7, token_adv=name != "gspo")
    cfg = AlgoConfig(name=name, eps_low=0.05, eps_high=0.08, kl_coef=0.1, clip_ratio_c=1.03)
    w = _weights(kind, mask)
    num = counts(mask)
    loss, m = run(name, logp, old, adv, mask, cfg, ref=ref, num=num, w=w)
    parts = [
        run(name, logp[s], old[s], adv[s], mask[s], cfg, ref=ref[s], num=num, w=w[s])
        for s in (slice(0, 2), slice(2, 3), slice(3, 6), slice(6, 7))
    ]
    total = sum(p[0] for p in parts)
    g = grad(loss, logp)
    torch.testing.assert_close(total, loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad(total, logp), g, rtol=1e-12, atol=1e-15)
    dual = [float(p[1]["clip/dual_clip_frac"]) for p in parts]
    assert sum(dual) == pytest.approx(float(m["clip/dual_clip_frac"])) and sum(dual) > 0
    B, T = mask.shape
    logp_p = padded(logp, 50.0).requires_grad_()
    adv_p = (
        padded(adv, 7.0) if adv.dim() == 2 else torch.cat([adv, torch.tensor([7.0, -7.0], dtype=adv.dtype)])
    )
    w_p = padded(w, NAN) if w.dim() == 2 else torch.cat([w, torch.tensor([NAN, 5.0], dtype=w.dtype)])
    out_p = run(
        name,
        logp_p,
        padded(old, -50.0),
        adv_p,
        padded(mask, False),
        cfg,
        ref=padded(ref, 9.0),
        num=num,
        w=w_p,
    )
    torch.testing.assert_close(out_p[0], loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(out_p[1], m, rtol=1e-13, atol=1e-15)
    g_p = grad(out_p[0], logp_p)
    torch.testing.assert_close(g_p[:B, :T], g, rtol=1e-13, atol=1e-15)
    assert torch.count_nonzero(g_p[B:]) == 0 and torch.count_nonzero(g_p[:, T:]) == 0


def test_gspo_refuses_token_level_weights():
    logp, old, adv, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="gspo has one term per sequence.*use gspo_token"):
        run("gspo", logp, old, adv, mask, AlgoConfig(name="gspo"), w=_weights("token", mask))
    with pytest.raises(ValueError, match=r"is_weights must be \[B\]"):
        run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo"), w=torch.ones(3, dtype=torch.float64))


def test_gspo_and_gspo_token_agree_with_sequence_weights():
    logp, old, adv, mask, _ = make_batch(1)
    cfg = AlgoConfig(name="gspo", eps_low=0.05, eps_high=0.08, clip_ratio_c=1.05)
    w = _weights("seq", mask)
    loss, m = run("gspo", logp, old, adv, mask, cfg, w=w)
    g = grad(loss, logp)
    for a in (adv, adv[:, None].expand(mask.shape).clone()):
        loss_t, m_t = run("gspo_token", logp, old, a, mask, cfg, w=w)
        torch.testing.assert_close(loss_t, loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad(loss_t, logp), g, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(m_t, m)
    assert float(m["clip/dual_clip_frac"]) > 0


# ---------------------------------------------------------------------------------------
# Dual clip


def _single(ratios_rows, advs):
    """Sequences of given token ratios (same length), old log-probs spread over [-3, -0.5]."""
    r = torch.tensor(ratios_rows, dtype=torch.float64)
    old = torch.linspace(-3.0, -0.5, r.numel(), dtype=torch.float64).reshape(r.shape)
    logp = (old + r.log()).requires_grad_()
    return logp, old, torch.tensor(advs, dtype=torch.float64), torch.ones_like(r, dtype=torch.bool)


def test_dual_clip_grpo_hand_worked():
    # seq 0, A = -1, ratios 0.5, 1, 2, 4, band [0.8, 1.27], c = 3. Term min(wA, clip(w)A) = -max(w, clip(w)):
    #   0.5 -> -0.8 (clipped, no grad); 1 -> -1; 2 -> -2; 4 -> -4, dual clip max(-4, -3) = -3 (no grad)
    # seq 1, A = +1, ratios 4, 1, 1, 1: 4 -> 1.27 (clipped); the dual clip never touches A > 0
    # J = [(-0.8 - 1 - 2 - 3) / 4 + (1.27 + 3) / 4] / 2 = (-1.7 + 1.0675) / 2 = -0.31625
    logp, old, adv, mask = _single([[0.5, 1.0, 2.0, 4.0], [4.0, 1.0, 1.0, 1.0]], [-1.0, 1.0])
    cfg = AlgoConfig(name="grpo", clip_ratio_c=3.0)
    loss, m = run("grpo", logp, old, adv, mask, cfg)
    assert float(loss.detach()) == pytest.approx(0.31625, rel=1e-12)
    # d(-J)/dlogp = -(1/2)(1/4) w A on free tokens: seq 0: 1/8, 2/8; seq 1: -1/8 x 3
    expected = [[0.0, 0.125, 0.25, 0.0], [0.0, -0.125, -0.125, -0.125]]
    torch.testing.assert_close(grad(loss, logp), torch.tensor(expected, dtype=torch.float64))
    assert float(m["clip/dual_clip_frac"]) == 1 / 8
    loss_off, m_off = run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo"))
    assert float(loss_off.detach()) == pytest.approx(-((-0.8 - 1 - 2 - 4) / 4 + 4.27 / 4) / 2, rel=1e-12)
    assert float(m_off["clip/dual_clip_frac"]) == 0.0


def test_dual_clip_gspo_applies_to_the_sequence_term():
    # s = exp(mean(ln 4, ln 4)) = 4 > c = 3 with A = -1: the term is -3, no gradient, 2 tokens counted;
    # the second sequence (s = 2 < 3) keeps its term -2 and its gradient.
    logp, old, adv, mask = _single([[4.0, 4.0], [2.0, 2.0]], [-1.0, -1.0])
    cfg = AlgoConfig(name="gspo", clip_ratio_c=3.0)
    loss, m = run("gspo", logp, old, adv, mask, cfg)
    assert float(loss.detach()) == pytest.approx(-(-3.0 - 2.0) / 2, rel=1e-12)
    # d(-J)/dlogp_t = -(1/2) s A / |y| = 2 / 4 for the free sequence
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[0.0, 0.0], [0.5, 0.5]], dtype=torch.float64))
    assert float(m["clip/dual_clip_frac"]) == 0.5


def verl_dual_clip_objective(logp, old, adv_BT, lo, hi, c):
    """verl core_algos.compute_policy_loss_vanilla's per-token loss (pg_losses) without its +-20 clamp."""
    ratio = torch.exp(logp - old)
    pg1, pg2 = -adv_BT * ratio, -adv_BT * torch.clamp(ratio, 1 - lo, 1 + hi)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-adv_BT * c, clip1)
    return torch.where(adv_BT < 0, clip2, clip1)


def trl_delta_objective(logp, old, adv_BT, lo, hi, delta):
    """TRL GRPOTrainer's per-token loss with two-sided clipping (args.delta; huggingface/trl,
    trl/trainer/grpo_trainer.py, read at commit f2cd5771: coef_1 clamped at delta after coef_2 is
    taken, then -min(coef_1 A, coef_2 A))."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - lo, 1 + hi)
    coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * adv_BT, coef_2 * adv_BT)


@pytest.mark.parametrize("reference", [verl_dual_clip_objective, trl_delta_objective])
@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_dual_clip_matches_verl_and_trl(reference, aggregation):
    logp, old, adv, mask, _ = make_batch(4, B=8, T=12, spread=0.8, token_adv=True)
    lo, hi, c = 0.2, 0.27, 1.8  # c >= 1 + eps_high: TRL's delta is the dual clip only there
    cfg = AlgoConfig(name="grpo", eps_low=lo, eps_high=hi, clip_ratio_c=c, aggregation=aggregation)
    loss, m = run("grpo", logp, old, adv, mask, cfg)
    ns, nt = counts(mask)
    per_token = torch.where(mask, reference(logp, old, adv, lo, hi, c), 0.0)
    length = mask.sum(-1).clamp(min=1)
    expected = (per_token.sum(-1) / length).sum() / ns if aggregation == "seq_mean" else per_token.sum() / nt
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad(loss, logp), grad(expected, logp).nan_to_num(0.0), rtol=1e-12, atol=1e-15)
    binds = mask & (adv < 0) & ((logp - old).exp() > c)
    assert 0 < int(binds.sum()) and float(m["clip/dual_clip_frac"]) == pytest.approx(float(binds.sum()) / nt)


def test_trl_delta_is_the_dual_clip_only_from_one_plus_eps_high():
    """TRL's delta clamps r at delta before PPO's min. From delta = 1 + eps_high up that is the dual
    clip c = delta, token for token; below it is another objective (docs/algorithms.md#dual-clip)."""
    lo, hi = 0.2, 0.27
    r = torch.tensor([[1.2, 1.5, 2.5, 0.7, 1.1]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    old = torch.zeros_like(r)
    logp = r.log().requires_grad_()

    def ours(c):  # moe-rl's per-token loss: -clipped_surrogate with dual clip c
        return -clipped_surrogate(logp - old, adv, lo, hi, c)

    for delta in (1 + hi, 1.8, 3.0):
        trl, mine = trl_delta_objective(logp, old, adv, lo, hi, delta), ours(delta)
        torch.testing.assert_close(mine, trl, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad(mine.sum(), logp), grad(trl.sum(), logp), rtol=1e-12, atol=0)
    # delta = 1.1 < 1.27. Per token (loss = -objective):
    #   A = +1, r = 1.2: TRL's upper clip is delta: 1.2 -> -1.1, no gradient (here: -1.2, inside the band)
    #   A = -1, r = 1.5: TRL holds it at (1 + eps_high) = 1.27, no gradient (dual clip c = 1.1: 1.1)
    #   A = -1, r = 2.5: TRL 1.27 (dual clip: 1.1)
    #   A = -1, r = 0.7: both PPO's clip, 0.8;  A = +1, r = 1.1: both -1.1 (TRL's bound, r itself here)
    trl = trl_delta_objective(logp, old, adv, lo, hi, 1.1)
    torch.testing.assert_close(
        trl.detach(), torch.tensor([[-1.1, 1.27, 1.27, 0.8, -1.1]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        ours(1.1).detach(), torch.tensor([[-1.2, 1.1, 1.1, 0.8, -1.1]], dtype=torch.float64)
    )
    assert grad(trl.sum(), logp)[0, 0] == 0 and grad(ours(1.1).sum(), logp)[0, 0] != 0


def test_dual_clip_constant_must_exceed_one():
    logp, old, adv, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="clip_ratio_c=1.0 must be > 1"):  # the config refuses it
        AlgoConfig(name="grpo", clip_ratio_c=1.0)
    cfg = AlgoConfig(name="grpo")
    object.__setattr__(cfg, "clip_ratio_c", 1.0)  # past the config: the loss refuses it too
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        run("grpo", logp, old, adv, mask, cfg)


def test_dual_clip_with_huge_ratios_stays_finite():
    logp = torch.tensor([[300.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old, adv, mask = torch.zeros(1, 2, dtype=torch.float64), torch.tensor([-1.0]), torch.ones(1, 2)
    loss, m = run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo", clip_ratio_c=3.0))
    g = grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and float(g[0, 0]) == 0.0
    assert float(loss.detach()) == pytest.approx(-(-3.0 - 1.0) / 2)
