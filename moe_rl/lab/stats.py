"""Small statistics the experiments share: means over what was measured, least-squares fits, a run's
held-out AUC, ratio-outlier steps and routing share, paired differences across seeds (t interval,
exact sign-flip p), Kaplan-Meier and the log-rank test."""

from __future__ import annotations

import math


def mean(xs) -> float:
    """Mean of the finite numbers in ``xs`` (nan when there are none)."""
    v = [float(x) for x in xs if x is not None and x == x and abs(float(x)) != math.inf]
    return sum(v) / len(v) if v else math.nan


def lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """The least-squares solution ``c`` of ``rows @ c = ys`` (e.g. ``[1, log x]`` rows: a power law)."""
    import numpy as np

    sol, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys, dtype=float), rcond=None)
    return [float(x) for x in sol]


# -- per run --------------------------------------------------------------------------------------
def auc(evals: list[tuple[int, float]]) -> float:
    """Trapezoid area under (steps done, held-out accuracy) from the first evaluation to the last,
    divided by the steps between them: a mean accuracy over training (nan with < 2 evaluations)."""
    pts = sorted((int(s), float(a)) for s, a in evals)
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return math.nan
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def outlier_steps(rows: list[dict]) -> float:
    """The fraction of a run's RL steps (those that logged it) with any token ratio to pi_old
    outside [0.5, 2] (``ratio/token_frac_outside_0.5_2`` > 0): where routing's outliers show
    (nan if no step logged it)."""
    return mean(None if (f := r.get("ratio/token_frac_outside_0.5_2")) is None else f > 0 for r in rows)


def routing_share(rows: list[dict]) -> float:
    """A run's routing share, its steps pooled: 1 - sum Var(log rho, replayed) / sum Var(log rho,
    natural) over the steps that logged both (nan if none or no natural variance).

    The mean of the per-step shares is the same figure weighted equally per step, which one step
    with almost no natural variance (all of a probe's ratios ~1: 1e-9 against a run's 4e-4
    typical) can swing to -2,000; pooling weights each step's share by its natural variance."""
    pairs = [
        (r["ratio/log_rho_var_natural"], r["ratio/log_rho_var_replayed"])
        for r in rows
        if r.get("ratio/log_rho_var_natural") is not None and r.get("ratio/log_rho_var_replayed") is not None
    ]
    natural = sum(n for n, _ in pairs)
    return 1.0 - sum(v for _, v in pairs) / natural if natural > 0 else math.nan


# -- paired comparisons across seeds --------------------------------------------------------------
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
)
"Two-sided 95% Student t quantiles for 1..15 degrees of freedom (then 1.96 + 2.5 / df, within 0.5%)."


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.5 / df


def sign_flip_p(diffs: list[float]) -> float:
    """Two-sided exact sign-flip permutation p-value of the mean of paired differences (the null:
    each difference is as likely negative as positive): the share of the 2^n sign patterns whose
    |mean| is at least the observed one. Exact up to n = 20."""
    n = len(diffs)
    if n == 0 or n > 20:
        return math.nan
    observed = abs(sum(diffs)) - 1e-12
    hits = 0
    for mask in range(2**n):
        s = sum(-d if mask >> i & 1 else d for i, d in enumerate(diffs))
        hits += abs(s) >= observed
    return hits / 2**n


def paired(diffs: list[float]) -> dict:
    """Mean paired difference with its 95% t interval, the sign-flip p-value, sd and n."""
    v = [float(d) for d in diffs if d is not None and math.isfinite(float(d))]
    n = len(v)
    if n == 0:
        return {"n": 0, "mean": math.nan, "sd": math.nan, "ci95": [math.nan, math.nan], "p": math.nan}
    m = sum(v) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1)) if n > 1 else math.nan
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else math.nan
    return {"n": n, "mean": m, "sd": sd, "ci95": [m - half, m + half], "p": sign_flip_p(v)}


# -- time to event ----------------------------------------------------------------------------------
def kaplan_meier(times: list[float], events: list[bool]) -> list[tuple[float, float]]:
    """The Kaplan-Meier survival curve ``[(t, S(t)), ...]`` from 0, stepping at each event time
    (``events[i]`` False: censored at ``times[i]``)."""
    curve, s = [(0.0, 1.0)], 1.0
    for t in sorted({t for t, e in zip(times, events) if e}):
        at_risk = sum(1 for x in times if x >= t)
        died = sum(1 for x, e in zip(times, events) if e and x == t)
        s *= 1 - died / at_risk
        curve.append((float(t), s))
    return curve


def log_rank_p(t1: list[float], e1: list[bool], t2: list[float], e2: list[bool]) -> float:
    """Two-sided log-rank test p-value of two survival samples (chi-square, 1 degree of freedom);
    1.0 when neither sample has an event."""
    times = sorted({t for t, e in zip(t1 + t2, e1 + e2) if e})
    o_minus_e, var = 0.0, 0.0
    for t in times:
        n1 = sum(1 for x in t1 if x >= t)
        n2 = sum(1 for x in t2 if x >= t)
        d1 = sum(1 for x, e in zip(t1, e1) if e and x == t)
        d = d1 + sum(1 for x, e in zip(t2, e2) if e and x == t)
        n = n1 + n2
        if n < 2:
            continue
        o_minus_e += d1 - d * n1 / n
        var += d * (n1 / n) * (n2 / n) * (n - d) / (n - 1)
    if var <= 0:
        return 1.0
    chi2 = o_minus_e**2 / var
    return math.erfc(math.sqrt(chi2 / 2))
