"""Design (e)'s analysis, fixed with its plan: per state the paired differences of dJ between arms,
over states their mean, 95% t interval and exact sign-flip p; the gate, the SE rule, the success
rule, the MoE-vs-dense interaction and what a per-update effect predicts for a run.

A state's record is :func:`studies.one_update.harness.score_state`'s, with ``state`` (set, seed,
step) added by the driver; arms are keyed ``<arm>@M<m>``.
"""

from __future__ import annotations

import math
import random

from moe_rl.lab.stats import paired

QUANT_TOTAL = 2**22
"""The sign-flip test's resolution: |Delta| quantised to QUANT_TOTAL // n steps of the largest (the
dynamic programme's table then holds at most 2 QUANT_TOTAL + 1 sums)."""
PERMUTATIONS = 100_000
"Relabellings of the MoE-vs-dense permutation test."
RUN_SD_R2_AUC = 0.0214
"""Design (b)'s paired run-level sd of GRPO + R2's held-out AUC difference to GRPO in moe-dial30
(benchmarks/results/noise-cpu2-x86_64-b-61b8ba6.json, 6 seeds): the yardstick of a run-level test."""
Z_ALPHA, Z_POWER = 1.959964, 0.841621
"Two-sided alpha 0.05 and 80% power, normal quantiles."

CONTRASTS = {
    "Delta_R2": ("GRPO+R2", "GRPO"),
    "Delta_GSPO": ("GSPO", "GRPO"),
    "Delta_R3": ("GRPO+R3", "GRPO'"),
    "Delta_null_order": ("NULL-order", "GRPO"),
    "Delta_null_jitter": ("NULL-jitter", "GRPO"),
}
"Each contrast: (arm, reference), dJ(arm) - dJ(reference) per state."


# -- exact sign-flip p for any n ------------------------------------------------------------------
def sign_flip_bounds(diffs: list[float], steps: int | None = None) -> tuple[float, float]:
    """Bounds (lower, upper) on the exact two-sided sign-flip p of the mean of ``diffs``: the share of
    the 2^n sign patterns whose |sum| is at least the observed one.

    The |d| are quantised to integers a = round(|d| / q), q = max|d| / ``steps`` (default
    :data:`QUANT_TOTAL` // n), and the exact
    distribution of sum(+-a) is built by dynamic programming (each pattern equally likely). A
    pattern's true |sum| is within n q / 2 of q |its integer sum|, so the patterns at least as
    extreme as the observed one lie between those with |S| >= |T| + n and those with |S| >= |T| - n
    (T the observed integer sum): those two shares bound the p."""
    import numpy as np

    d = [float(x) for x in diffs]
    n = len(d)
    if n == 0:
        return math.nan, math.nan
    top, steps = max(abs(x) for x in d), steps or max(1, QUANT_TOTAL // n)
    if top == 0:
        return 1.0, 1.0
    a = [round(abs(x) / top * steps) for x in d]
    t = abs(sum(ai if x >= 0 else -ai for ai, x in zip(a, d)))
    total = sum(a)
    pmf, reach = np.zeros(2 * total + 1), 0  # pmf[total + k] = P(partial sum = k); |k| <= reach
    pmf[total] = 1.0
    for ai in (x for x in a if x):
        lo, hi = total - reach, total + reach + 1
        window = pmf[lo:hi].copy()
        pmf[lo:hi] = 0.0
        pmf[lo + ai : hi + ai] += 0.5 * window
        pmf[lo - ai : hi - ai] += 0.5 * window
        reach += ai
    s = np.abs(np.arange(-total, total + 1))
    return float(pmf[s >= t + n].sum()), float(pmf[s >= max(t - n, 0)].sum())


def paired_exact(diffs: list[float]) -> dict:
    """:func:`moe_rl.lab.stats.paired` (mean, 95% t interval, sd, n) with the exact sign-flip p for
    any n: enumerated up to 20 differences, else the upper of :func:`sign_flip_bounds` (``p_bounds``)."""
    v = [float(x) for x in diffs if x is not None and math.isfinite(float(x))]
    out = paired(v)
    if 0 < len(v) <= 20:
        out["p_bounds"] = [out["p"], out["p"]]
    elif v:
        lo, hi = sign_flip_bounds(v)
        out["p"], out["p_bounds"] = hi, [lo, hi]
    out["positive"] = sum(x > 0 for x in v)
    return out


def permutation_p(a: list[float], b: list[float], n: int = PERMUTATIONS, seed: int = 50) -> float:
    """Two-sided permutation p of mean(a) - mean(b): the share of ``n`` random relabellings (and the
    observed one) at least as far from 0."""
    pooled, k = list(a) + list(b), len(a)
    if not a or not b:
        return math.nan
    observed = abs(sum(a) / k - sum(b) / len(b)) - 1e-15
    rng, hits = random.Random(seed), 1
    for _ in range(n):
        rng.shuffle(pooled)
        hits += abs(sum(pooled[:k]) / k - sum(pooled[k:]) / len(b)) >= observed
    return hits / (n + 1)


# -- per state ------------------------------------------------------------------------------------
def arm_value(rec: dict, arm: str, m: int, v: str = "V1", key: str = "dJ") -> float | None:
    """``key`` of ``arm`` at M = ``m`` in one state's record (on scoring set ``v``; None: not scored)."""
    a = rec["arms"].get(f"{arm}@M{m}")
    if a is None:
        return None
    if key == "dJ_per_kl":  # the step's gain per unit of its size
        return a[v]["dJ"] / a[v]["kl"] if a[v]["kl"] > 0 else None
    return a[v][key] if v in a and key in a[v] else a.get(key)


def deltas(records: list[dict], contrast: str, m: int, v: str = "V1", key: str = "dJ") -> list[float]:
    """Per state (in ``records``' order), ``key`` of the contrast's arm minus its reference's."""
    arm, ref = CONTRASTS[contrast]
    out = []
    for rec in records:
        x, y = arm_value(rec, arm, m, v, key), arm_value(rec, ref, m, v, key)
        if x is not None and y is not None:
            out.append(x - y)
    return out


def efficiency(records: list[dict], arm: str, m: int) -> float:
    """dJ per unit KL of ``arm`` at M = ``m``: mean dJ / mean KL over the states (on V)."""
    dj = [arm_value(r, arm, m) for r in records]
    kl = [arm_value(r, arm, m, key="kl") for r in records]
    dj, kl = [x for x in dj if x is not None], [x for x in kl if x is not None]
    return (sum(dj) / len(dj)) / (sum(kl) / len(kl)) if dj and kl and sum(kl) > 0 else math.nan


# -- the rules ------------------------------------------------------------------------------------
def gate_reading(records: list[dict], m: int, gate: dict) -> dict:
    """The plan's gate on ``records`` (the first 10 MoE states) at M = ``m``: GRPO's mean drift per
    slot after the last update and its mean token share outside [0.5, 2] (the trainer's, over the M
    updates); ``passed`` when both reach the plan's minimums."""
    drift = [arm_value(r, "GRPO", m, key="drift_slot") for r in records]
    share = [r["arms"][f"GRPO@M{m}"]["train"]["ratio/token_frac_outside_0.5_2"] for r in records]
    final = [arm_value(r, "GRPO", m, key="token_out_final") for r in records]
    out = {
        "minibatches": m,
        "states": len(records),
        "drift_slot": sum(drift) / len(drift),
        "token_share": sum(share) / len(share),
        "token_share_final": sum(final) / len(final),
    }
    out["passed"] = bool(
        out["drift_slot"] >= gate["min_drift_slot"] and out["token_share"] >= gate["min_token_share"]
    )
    return out


def se_reading(records: list[dict], m: int, rule: dict) -> dict:
    """The plan's SE rule: the standard error of Delta_R2 at M = ``m`` on V over ``records``;
    ``double`` when above the plan's ``max_se``."""
    d = deltas(records, "Delta_R2", m)
    se = paired(d)["sd"] / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return {"minibatches": m, "states": len(d), "se": se, "double": bool(se > rule["max_se"])}


def success(records: list[dict], m: int) -> dict:
    """The plan's success rule at the primary M on the MoE states: mean Delta_R2 > 0 with p < 0.01,
    positive in each run's block, and both nulls' |mean| under a third of it."""
    r2 = paired_exact(deltas(records, "Delta_R2", m))
    blocks = {}
    for seed in sorted({r["state"]["seed"] for r in records}):
        blocks[seed] = paired(deltas([r for r in records if r["state"]["seed"] == seed], "Delta_R2", m))[
            "mean"
        ]
    nulls = {k: paired(deltas(records, f"Delta_null_{k}", m))["mean"] for k in ("order", "jitter")}
    met = bool(
        r2["mean"] > 0
        and r2["p"] < 0.01
        and all(b > 0 for b in blocks.values())
        and all(abs(x) < r2["mean"] / 3 for x in nulls.values())
    )
    return {"minibatches": m, "Delta_R2": r2, "blocks": blocks, "null_means": nulls, "met": met}


def run_level(delta: dict, steps: int = 100, sd: float = RUN_SD_R2_AUC) -> dict:
    """What a per-update effect ``delta`` (paired stats of dJ differences: reward per RL step) predicts
    for a run: accumulated linearly, a gap of delta x t at step t, so delta x T / 2 in AUC over T
    steps (the interval scaled alike), and the seeds a paired run-level test at alpha 0.05 with 80%
    power would need against a run-level sd ``sd`` of the AUC difference."""
    gap = delta["mean"] * steps / 2
    ci = [x * steps / 2 for x in delta["ci95"]]
    need = ((Z_ALPHA + Z_POWER) * sd / abs(gap)) ** 2 if gap else math.inf
    return {"steps": steps, "auc_gap": gap, "auc_gap_ci95": ci, "run_sd": sd, "seeds_for_80pct_power": need}


# -- the whole analysis ---------------------------------------------------------------------------
def contrasts_table(records: list[dict], ms: list[int], v: str = "V1", key: str = "dJ") -> dict:
    """Every contrast at every M: paired stats over ``records`` (contrasts not scored are left out)."""
    out = {}
    for name in CONTRASTS:
        per_m = {f"M{m}": paired_exact(deltas(records, name, m, v, key)) for m in ms}
        per_m = {k: s for k, s in per_m.items() if s["n"]}
        if per_m:
            out[name] = per_m
    return out


def analyse(records: list[dict], decisions: dict, ms: list[int]) -> dict:
    """The report's figures from every scored state (``records``) and the sweep's ``decisions``."""
    moe = [r for r in records if r["state"]["set"] == "moe"]
    dense = [r for r in records if r["state"]["set"] == "dense"]
    primary = ms[-1]
    out = {
        "states": {"moe": len(moe), "dense": len(dense)},
        "minibatches": ms,
        "primary_minibatches": primary,
        "moe": {
            "dJ": contrasts_table(moe, ms),
            "dJ_clip": contrasts_table(moe, ms, key="dJ_clip"),
            "dJ_V2": contrasts_table(moe, ms, v="V2"),
            "kl": contrasts_table(moe, ms, key="kl"),
            "dJ_per_kl": contrasts_table(moe, ms, key="dJ_per_kl"),
        },
        "dense": {"dJ": contrasts_table(dense, ms), "kl": contrasts_table(dense, ms, key="kl")},
        "arms": arm_means(records, ms),
        "decisions": decisions,
    }
    if deltas(moe, "Delta_R2", primary):
        out["success"] = success(moe, primary)
        out["run_level"] = {
            f"M{m}": run_level(out["moe"]["dJ"]["Delta_R2"][f"M{m}"])
            for m in ms
            if f"M{m}" in out["moe"]["dJ"].get("Delta_R2", {})
        }
    if moe and dense:
        out["interaction_gspo"] = {
            f"M{m}": interaction(moe, dense, m) for m in ms if deltas(dense, "Delta_GSPO", m)
        }
    if dense:
        r2 = [d for m in ms for d in deltas(dense, "Delta_R2", m)]
        out["dense_r2_equals_grpo"] = {
            "states_x_m": len(r2),
            "max_abs": max((abs(x) for x in r2), default=0.0),
        }
    return out


def interaction(moe: list[dict], dense: list[dict], m: int) -> dict:
    """Mean Delta_GSPO over the MoE states minus over the dense ones, with a permutation p."""
    a, b = deltas(moe, "Delta_GSPO", m), deltas(dense, "Delta_GSPO", m)
    return {"moe": sum(a) / len(a), "dense": sum(b) / len(b), "difference": sum(a) / len(a) - sum(b) / len(b),
            "p": permutation_p(a, b), "n": [len(a), len(b)]}  # fmt: skip


def arm_means(records: list[dict], ms: list[int]) -> dict:
    """Per set, arm and M: mean dJ, KL, drift, token shares and dJ per unit KL over the states."""
    keys = ("dJ", "kl", "drift_slot", "token_out_final")
    out: dict = {}
    for s in ("moe", "dense"):
        recs = [r for r in records if r["state"]["set"] == s]
        arms = sorted({k.split("@M")[0] for r in recs for k in r["arms"]})
        for arm in arms:
            for m in ms:
                vals = {k: [arm_value(r, arm, m, key=k) for r in recs] for k in keys}
                vals = {k: [x for x in v if x is not None] for k, v in vals.items()}
                if not vals["dJ"]:
                    continue
                share = [r["arms"][f"{arm}@M{m}"]["train"].get("ratio/token_frac_outside_0.5_2") for r in recs
                         if f"{arm}@M{m}" in r["arms"]]  # fmt: skip
                row = {k: sum(v) / len(v) if v else math.nan for k, v in vals.items()}
                row["token_share"] = sum(share) / len(share) if share else math.nan
                row["dJ_per_kl"] = efficiency(recs, arm, m)
                row["n"] = len(vals["dJ"])
                out.setdefault(s, {})[f"{arm}@M{m}"] = row
    return out
