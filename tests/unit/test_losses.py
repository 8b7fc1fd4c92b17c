"""GRPO / GSPO / GSPO-token losses: hand-worked numbers, closed-form gradients, a slow
per-sequence reference, and padding / microbatch invariance.

Shape legend: B = sequences, T = padded tokens per sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.config import AlgoConfig
from moe_rl.losses import LOSSES, METRIC_REDUCTIONS, combine_metrics, get_loss, k3, loss_batch

ALGOS = ("grpo", "gspo", "gspo_token")
AGGS = ("seq_mean", "token_mean")
# Bands: the paper's (None) and a custom one; both give a mix of clipped and free elements below.
BANDS = {"paper": (None, None), "wide": (0.05, 0.08)}


def make_batch(seed: int, *, B: int = 6, T: int = 10, spread: float = 0.3, token_adv: bool = False):
    """Random float64 batch: response spans at random offsets, some rows empty, NaN on padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    lengths[-1] = 0 if B > 2 else lengths[-1]
    start = (torch.rand(B, generator=g) * (T - lengths + 1)).long()
    pos = torch.arange(T)
    mask = (pos >= start[:, None]) & (pos < (start + lengths)[:, None])
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logp = old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    shape = (B, T) if token_adv else (B,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    adv[1] = 0.0
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    logp, old, ref = (torch.where(mask, x, nan) for x in (logp, old, ref))
    return logp.requires_grad_(), old, adv, mask, ref


def counts(mask):
    return float((mask.sum(-1) > 0).sum()), float(mask.sum())


def cfg_for(name, band="wide", aggregation="seq_mean", kl_coef=0.0):
    lo, hi = BANDS[band]
    return AlgoConfig(name=name, eps_low=lo, eps_high=hi, aggregation=aggregation, kl_coef=kl_coef)


def run(name, logp, old, adv, mask, cfg, ref=None, num=None, w=None):
    """Loss ``name`` on these tensors: one :func:`loss_batch` (``num``: the global counts, by
    default this batch's; ``w``: correction weights), then the loss."""
    ns, nt = num or counts(mask)
    batch = loss_batch(logp, old, adv, mask, num_sequences=ns, num_tokens=nt, ref_logp_BT=ref, is_weights=w)
    return get_loss(name)(batch, cfg)


def grad(loss, x):
    return torch.autograd.grad(loss, x)[0]


# ---------------------------------------------------------------------------------------
# Slow reference: one sequence at a time, textbook min / clamp formulas.


def reference_loss(name, logp, old, adv, mask, cfg, ref=None):
    ns, nt = counts(mask)
    lo, hi = cfg.clip_low, cfg.clip_high
    total = torch.zeros((), dtype=torch.float64)
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten()
        n = len(idx)
        if n == 0:
            continue
        lp, od = logp[i, idx], old[i, idx]
        a = adv[i] if adv.dim() == 1 else adv[i, idx]
        if name == "gspo":
            s = torch.exp((lp - od).mean())
            j = torch.min(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a)
            total = total - (j / ns if cfg.aggregation == "seq_mean" else j * n / nt)
        else:
            if name == "grpo":
                r = torch.exp(lp - od)
            else:
                r = torch.exp((lp - od).mean()).detach() * torch.exp(lp - lp.detach())
            j = torch.min(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a).sum()
            total = total - (j / n / ns if cfg.aggregation == "seq_mean" else j / nt)
        if cfg.kl_coef > 0:
            kl = (torch.exp(ref[i, idx] - lp) - (ref[i, idx] - lp) - 1).sum()
            total = total + cfg.kl_coef * (kl / n / ns if cfg.aggregation == "seq_mean" else kl / nt)
    return total


def reference_metrics(logp, old, adv, mask, cfg):
    ns, nt = counts(mask)
    lo, hi = cfg.clip_low, cfg.clip_high
    tok_clip = seq_clip = tok_in_clip = 0
    log_sums, s_all, w_all, d_all, a_all = [], [], [], [], []
    for i in range(mask.shape[0]):
        idx = mask[i].nonzero().flatten()
        if len(idx) == 0:
            continue
        d = (logp[i, idx] - old[i, idx]).detach()
        a_t = adv[i].expand(len(idx)) if adv.dim() == 1 else adv[i, idx]
        a = a_t.mean()
        w = d.exp()
        tok_clip += int((((a_t > 0) & (w > 1 + hi)) | ((a_t < 0) & (w < 1 - lo))).sum())
        s = d.mean().exp()
        if (a > 0 and s > 1 + hi) or (a < 0 and s < 1 - lo):
            seq_clip += 1
            tok_in_clip += len(idx)
        log_sums.append(float(d.sum()))
        s_all.append(float(s))
        w_all += w.tolist()
        d_all += d.tolist()
        a_all.append(float(a))
    return {
        "clip/token_frac": tok_clip / nt,
        "clip/seq_frac": seq_clip / ns,
        "clip/token_frac_of_clipped_seqs": tok_in_clip / nt,
        "ratio/token_min": min(w_all),
        "ratio/token_max": max(w_all),
        "ratio/token_mean": sum(w_all) / nt,
        "ratio/seq_min": min(s_all),
        "ratio/seq_max": max(s_all),
        "ratio/seq_log_sum_min": min(log_sums),
        "ratio/seq_log_sum_max": max(log_sums),
        "ratio/seq_mean": sum(s_all) / ns,
        "ratio/token_frac_outside_0.5_2": sum(not 0.5 <= w <= 2 for w in w_all) / nt,
        "kl/old_k3": sum(math.exp(-d) + d - 1 for d in d_all) / nt,
        "kl/old_abs_log_ratio": sum(abs(d) for d in d_all) / nt,
        "adv/mean": sum(a_all) / ns,
        "adv/abs_mean": sum(abs(a) for a in a_all) / ns,
        "adv/min": min(a_all),
        "adv/max": max(a_all),
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("band", BANDS)
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", ALGOS)
def test_matches_per_sequence_reference(name, aggregation, band, seed):
    token_adv = name != "gspo" and seed % 2 == 1
    logp, old, adv, mask, ref = make_batch(seed, token_adv=token_adv)
    cfg = cfg_for(name, band, aggregation, kl_coef=0.1 if seed % 3 == 0 else 0.0)
    loss, metrics = run(name, logp, old, adv, mask, cfg, ref=ref)
    expected = reference_loss(name, logp, old, adv, mask, cfg, ref=ref)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad(loss, logp), grad(expected, logp).nan_to_num(0.0), rtol=1e-9, atol=1e-12)
    for k, v in reference_metrics(logp, old, adv, mask, cfg).items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-9, abs=1e-12), k
    pg = reference_loss(name, logp, old, adv, mask, cfg_for(name, band, aggregation))  # -J, no KL term
    assert float(metrics["loss/pg"]) == pytest.approx(float(pg), rel=1e-10, abs=1e-12)


def test_reference_batches_exercise_both_sides_of_the_band():
    """The random batches above hit clipped and free tokens / sequences for every band."""
    for band in BANDS:
        cfg_grpo, cfg_gspo = cfg_for("grpo", band), cfg_for("gspo", band)
        fracs = []
        for seed in range(6):
            logp, old, adv, mask, _ = make_batch(seed)
            fracs.append(float(run("grpo", logp, old, adv, mask, cfg_grpo)[1]["clip/token_frac"]))
            fracs.append(float(run("gspo", logp, old, adv, mask, cfg_gspo)[1]["clip/seq_frac"]))
        assert 0 < max(fracs[0::2]) and min(fracs[0::2]) < 1, (band, fracs)
        assert 0 < max(fracs[1::2]) and min(fracs[1::2]) < 1, (band, fracs)


# ---------------------------------------------------------------------------------------
# Hand-worked numbers (seeds/001): the 512-token response and the unbounded product.


def single_sequence(ratios, adv):
    """One sequence whose token ratios pi_theta / pi_old are ``ratios``."""
    old = torch.linspace(-4.0, -0.1, len(ratios), dtype=torch.float64)[None]
    logp = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_()
    mask = torch.ones_like(old, dtype=torch.bool)
    return logp, old, torch.tensor([adv], dtype=torch.float64), mask


def test_seed_example_sequence_ratio_0_9995():
    ratios = [1.9, 0.4] + [1.0] * 510
    logp, old, adv, mask = single_sequence(ratios, +1.0)
    cfg = AlgoConfig(name="gspo")  # paper band [1 - 3e-4, 1 + 4e-4]
    loss, m = run("gspo", logp, old, adv, mask, cfg)
    s1 = float(m["ratio/seq_min"])
    assert s1 == pytest.approx(0.9995, abs=1e-4)
    assert s1 == pytest.approx(0.76 ** (1 / 512), rel=1e-12)
    # s_1 = 0.99946 is below 1 - 3e-4 (the seed calls it "inside" the band), but with A = +1 that is
    # the side that keeps the gradient: not clipped, every token weighted by s_1 A / |y|.
    assert float(m["clip/seq_frac"]) == 0.0
    torch.testing.assert_close(grad(loss, logp), torch.full_like(logp, -s1 / 512))
    # With A = -1 the same sequence is clipped: no gradient, and all 512 tokens count as clipped.
    logp, old, adv, mask = single_sequence(ratios, -1.0)
    loss, m = run("gspo", logp, old, adv, mask, cfg)
    assert float(m["clip/seq_frac"]) == 1.0 and float(m["clip/token_frac_of_clipped_seqs"]) == 1.0
    assert torch.count_nonzero(grad(loss, logp)) == 0
    # GRPO on the same response (A = +1, band [0.8, 1.27]): only the 1.9 token is clipped.
    logp, old, adv, mask = single_sequence(ratios, +1.0)
    loss, m = run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo"))
    assert float(m["clip/token_frac"]) == pytest.approx(1 / 512)
    g = grad(loss, logp)[0]
    assert float(g[0]) == 0.0 and float(g[1]) == pytest.approx(-0.4 / 512)


@pytest.mark.parametrize("ratio", [1.19, 1.2, 1.5])
def test_token_clipping_leaves_the_sequence_product_unbounded(ratio):
    logp, old, adv, mask = single_sequence([ratio] * 100, +1.0)
    cfg = AlgoConfig(name="grpo", eps_low=0.2, eps_high=0.2)
    loss, m = run("grpo", logp, old, adv, mask, cfg)
    assert float(m["ratio/seq_log_sum_max"]) == pytest.approx(100 * math.log(ratio), rel=1e-12)
    assert math.exp(float(m["ratio/seq_log_sum_max"])) == pytest.approx(ratio**100, rel=1e-9)
    assert ratio**100 > 3e7
    # ... while GRPO's per-sequence objective stays at most (1 + eps_high) A.
    assert -float(loss.detach()) == pytest.approx(min(ratio, 1.2), rel=1e-12)
    assert float(m["clip/token_frac"]) == (1.0 if ratio > 1.2 + 1e-9 else 0.0)


# ---------------------------------------------------------------------------------------
# GSPO gradient in closed form, and GSPO-token == GSPO.


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("seed", range(4))
def test_gspo_gradient_closed_form(seed, aggregation):
    logp, old, adv, mask, _ = make_batch(seed, B=8, spread=0.2)
    lo, hi = 0.02, 0.03
    cfg = AlgoConfig(name="gspo", eps_low=lo, eps_high=hi, aggregation=aggregation)
    ns, nt = counts(mask)
    loss, _ = run("gspo", logp, old, adv, mask, cfg)
    length = mask.sum(-1)
    d = torch.where(mask, logp - old, 0.0).detach()
    s = (d.sum(-1) / length.clamp(min=1)).exp()
    clipped = ((adv > 0) & (s > 1 + hi)) | ((adv < 0) & (s < 1 - lo))
    per_token = s * adv / length.clamp(min=1) / ns if aggregation == "seq_mean" else s * adv / nt
    expected = torch.where(mask & ~clipped[:, None], -per_token[:, None], 0.0)
    assert clipped[length > 0].any() and (~clipped & (adv != 0) & (length > 0)).any()
    torch.testing.assert_close(grad(loss, logp), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("band", BANDS)
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_equals_gspo_value_and_gradient(seed, aggregation, band):
    logp, old, adv, mask, ref = make_batch(seed)
    cfg = cfg_for("gspo", band, aggregation, kl_coef=0.05)
    loss, m = run("gspo", logp, old, adv, mask, cfg, ref=ref)
    g = grad(loss, logp)
    adv_BT = adv[:, None].expand(mask.shape).clone()  # A_{i,t} = A_i, given per token
    for a in (adv, adv_BT):
        loss_t, m_t = run("gspo_token", logp, old, a, mask, cfg, ref=ref)
        torch.testing.assert_close(loss_t, loss, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad(loss_t, logp), g, rtol=1e-12, atol=1e-15)
        assert m_t.keys() == m.keys()


def test_gspo_token_differs_from_gspo_with_token_advantages():
    """Guards the test above: per-token advantages that vary within a sequence change the
    gradient (each token is weighted by its own A_{i,t}), even against GSPO with their mean."""
    logp, old, adv, mask, _ = make_batch(0, token_adv=True)
    cfg = cfg_for("gspo_token")
    loss_t, _ = run("gspo_token", logp, old, adv, mask, cfg)
    adv_B = torch.where(mask, adv, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    loss_s, _ = run("gspo", logp, old, adv_B, mask, cfg_for("gspo"))
    assert not torch.allclose(grad(loss_t, logp), grad(loss_s, logp))


def test_gspo_rejects_per_token_advantages():
    logp, old, adv, mask, _ = make_batch(0, token_adv=True)
    with pytest.raises(ValueError, match="gspo_token"):
        run("gspo", logp, old, adv, mask, cfg_for("gspo"))


@pytest.mark.parametrize("name", ("grpo", "gspo_token"))
def test_per_token_advantages_equal_to_sequence_advantages(name):
    logp, old, adv, mask, _ = make_batch(3)
    cfg = cfg_for(name)
    loss, m = run(name, logp, old, adv, mask, cfg)
    loss_t, m_t = run(name, logp, old, adv[:, None].expand(mask.shape), mask, cfg)
    torch.testing.assert_close(loss_t, loss)
    torch.testing.assert_close(m_t, m)


# ---------------------------------------------------------------------------------------
# Invariances: padding, microbatch split, metric reductions.


def padded(x: torch.Tensor, fill, pad: int = 3, rows: int = 2) -> torch.Tensor:
    """``x`` [B, T] with ``pad`` padding columns and ``rows`` padding rows filled with ``fill``."""
    b, t = x.shape
    x = torch.cat([x.detach(), torch.full((b, pad), fill, dtype=x.dtype)], 1)
    return torch.cat([x, torch.full((rows, t + pad), fill, dtype=x.dtype)], 0)


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", ALGOS)
def test_padding_invariance(name, aggregation):
    logp, old, adv, mask, ref = make_batch(4)
    cfg = cfg_for(name, aggregation=aggregation, kl_coef=0.1)
    num = counts(mask)
    loss, m = run(name, logp, old, adv, mask, cfg, ref=ref)
    B, T = mask.shape
    logp_p = padded(logp, 50.0).requires_grad_()
    mask_p = padded(mask, False)
    adv_p = torch.cat([adv, torch.tensor([7.0, -7.0], dtype=adv.dtype)])
    loss_p, m_p = run(name, logp_p, padded(old, -50.0), adv_p, mask_p, cfg, ref=padded(ref, 9.0), num=num)
    torch.testing.assert_close(loss_p, loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(m_p, m, rtol=1e-13, atol=1e-15)
    g_p = grad(loss_p, logp_p)
    torch.testing.assert_close(g_p[:B, :T], grad(loss, logp), rtol=1e-13, atol=1e-15)
    assert torch.count_nonzero(g_p[B:]) == 0 and torch.count_nonzero(g_p[:, T:]) == 0


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", ALGOS)
def test_microbatch_split_sums_to_full_batch(name, aggregation):
    logp, old, adv, mask, ref = make_batch(5, B=7)
    cfg = cfg_for(name, aggregation=aggregation, kl_coef=0.1)
    num = counts(mask)
    loss, m = run(name, logp, old, adv, mask, cfg, ref=ref, num=num)
    parts = [
        run(name, logp[s], old[s], adv[s], mask[s], cfg, ref=ref[s], num=num)
        for s in (slice(0, 2), slice(2, 3), slice(3, 6), slice(6, 7))
    ]  # the last one has no valid token
    total = sum(p[0] for p in parts)
    torch.testing.assert_close(total, loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad(total, logp), grad(loss, logp), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(combine_metrics(p[1] for p in parts), m, rtol=1e-12, atol=1e-15)
    empty = parts[-1][1]  # identities of min / max, zeros of sums
    assert set(empty) == set(m) and float(empty["ratio/token_min"]) == math.inf
    assert float(empty["adv/max"]) == -math.inf and float(empty["clip/token_frac"]) == 0.0


@pytest.mark.parametrize("name", ALGOS)
def test_metric_keys_are_shared_and_all_have_a_reduction(name):
    logp, old, adv, mask, ref = make_batch(1)
    _, m = run(name, logp, old, adv, mask, cfg_for(name))
    _, m_ref = run(name, logp, old, adv, mask, cfg_for(name), ref=ref)
    assert set(m_ref) - set(m) == {"kl/ref_k1", "kl/ref_k2", "kl/ref_k3", "loss/kl"}
    assert set(m_ref) == set(METRIC_REDUCTIONS)
    assert set(METRIC_REDUCTIONS.values()) <= {"sum", "min", "max"}
    assert all(v.dim() == 0 and not v.requires_grad for v in m_ref.values())


def test_clip_metrics_use_the_cfg_band_whatever_the_algorithm():
    logp, old, adv, mask, _ = make_batch(2)
    lo_hi = {"eps_low": 0.05, "eps_high": 0.08}
    clip_keys = ("clip/token_frac", "clip/seq_frac", "clip/token_frac_of_clipped_seqs")
    by_algo = [run(n, logp, old, adv, mask, AlgoConfig(name=n, **lo_hi))[1] for n in ALGOS]
    for k in clip_keys:
        assert float(by_algo[0][k]) == float(by_algo[1][k]) == float(by_algo[2][k]), k
    narrow = run("grpo", logp, old, adv, mask, AlgoConfig(name="grpo", eps_low=1e-3, eps_high=1e-3))[1]
    assert float(narrow["clip/token_frac"]) > float(by_algo[0]["clip/token_frac"])


# ---------------------------------------------------------------------------------------
# KL, robustness, registry.


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", ALGOS)
def test_k3_kl_term(name, aggregation):
    logp, old, adv, mask, ref = make_batch(6)
    ns, nt = counts(mask)
    beta = 0.3
    loss0, m0 = run(name, logp, old, adv, mask, cfg_for(name, aggregation=aggregation), ref=ref)
    loss1, m1 = run(name, logp, old, adv, mask, cfg_for(name, aggregation=aggregation, kl_coef=beta), ref=ref)
    r = torch.where(mask, ref - logp, 0.0)
    kl_BT = torch.exp(r) - r - 1
    length = mask.sum(-1).clamp(min=1)
    kl = (kl_BT.sum(-1) / length).sum() / ns if aggregation == "seq_mean" else kl_BT.sum() / nt
    torch.testing.assert_close(loss1 - loss0, beta * kl.detach(), rtol=1e-10, atol=1e-14)
    dkl = torch.where(mask, 1 - torch.exp(ref - logp), 0.0).detach()
    dkl = dkl / length[:, None] / ns if aggregation == "seq_mean" else dkl / nt
    torch.testing.assert_close(grad(loss1, logp) - grad(loss0, logp), beta * dkl, rtol=1e-9, atol=1e-14)
    assert (
        float(m1["kl/ref_k3"]) == pytest.approx(float(kl_BT.detach().sum() / nt), rel=1e-12)
        and float(m1["kl/ref_k3"]) > 0
    )
    assert float(m0["loss/kl"]) == 0.0 and float(m1["loss/kl"]) == pytest.approx(beta * float(kl.detach()))


def test_k3_is_zero_at_reference_and_matches_formula():
    x = torch.tensor([-2.0, -0.5, 0.0, 1e-9, 3.0], dtype=torch.float64)
    ref = torch.zeros_like(x)
    torch.testing.assert_close(k3(x, ref), torch.exp(-x) + x - 1)
    assert torch.all(k3(x, ref) >= 0) and float(k3(x, x).abs().max()) == 0.0


def test_kl_coef_without_reference_is_an_error():
    logp, old, adv, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="ref_logp"):
        run("gspo", logp, old, adv, mask, cfg_for("gspo", kl_coef=0.1))


@pytest.mark.parametrize("name", ALGOS)
def test_empty_rows_and_huge_clipped_log_ratios_give_finite_grads(name):
    # Row 0: log-ratio 200 with A > 0 and row 1: -200 with A < 0 (both clipped on the active side);
    # row 2: no valid token; NaN on padding.
    logp = torch.tensor([[200.0, 200.0], [-200.0, -200.0], [float("nan")] * 2], requires_grad=True)
    old = torch.zeros(3, 2)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    adv = torch.tensor([1.0, -1.0, 2.0])
    cfg = AlgoConfig(name=name, aggregation="token_mean")
    loss, m = run(name, logp, old, adv, mask, cfg, num=(2.0, 4.0))
    assert torch.isfinite(loss) and all(not torch.isnan(v) for v in m.values())
    assert torch.count_nonzero(grad(loss, logp)) == 0
    assert float(m["clip/token_frac"]) == 1.0 and float(m["clip/seq_frac"]) == 1.0


def test_bfloat16_inputs_are_computed_in_float32():
    logp, old, adv, mask, _ = make_batch(0)
    lp16 = logp.detach().to(torch.bfloat16).requires_grad_()
    loss, _ = run("grpo", lp16, old.to(torch.bfloat16), adv.to(torch.bfloat16), mask, cfg_for("grpo"))
    assert loss.dtype == torch.float32 and grad(loss, lp16).dtype == torch.bfloat16


def test_shape_errors_are_clear():
    logp, old, adv, mask, _ = make_batch(0)
    with pytest.raises(ValueError, match="old_logp has shape"):
        run("grpo", logp, old[:, :-1], adv, mask, cfg_for("grpo"))
    with pytest.raises(ValueError, match="adv must be"):
        run("grpo", logp, old, adv[:-1], mask, cfg_for("grpo"))
    with pytest.raises(ValueError, match="num_tokens must be a positive"):
        run("grpo", logp, old, adv, mask, cfg_for("grpo"), num=(1.0, 0.0))


def test_registry_and_unknown_name():
    assert set(LOSSES) == {"grpo", "gspo", "gspo_token"}
    assert get_loss("gspo") is LOSSES["gspo"].fn
    with pytest.raises(ValueError, match="'gpso'.*grpo, gspo, gspo_token"):
        get_loss("gpso")
