"""Design (e)'s report: the result JSON (``headline`` first) and its picture."""

from __future__ import annotations

import math
from pathlib import Path

from moe_rl.lab.results import write_json
from studies.one_update import analysis

SHOWN = ("Delta_R2", "Delta_GSPO", "Delta_R3", "Delta_null_order", "Delta_null_jitter")


def _short(stats: dict) -> dict:
    keys = ("n", "mean", "ci95", "p", "p_bounds", "positive", "sd")
    return {k: stats[k] for k in keys if k in stats}


def headline(res: dict) -> dict:
    """The figures the README and the doc quote: every contrast's mean, 95% interval and exact p on
    the MoE states at each M, the success rule, the gate's and the SE rule's readings, the cost per
    state, the MoE-vs-dense interaction and the run-level prediction."""
    dj = res["moe"]["dJ"]
    out = {
        "states": res["states"],
        "primary_minibatches": res["primary_minibatches"],
        "Delta_R2": {m: _short(s) for m, s in dj.get("Delta_R2", {}).items()},
        "Delta_GSPO": {m: _short(s) for m, s in dj.get("Delta_GSPO", {}).items()},
        "Delta_GSPO_dJ_per_kl": {
            m: _short(s) for m, s in res["moe"]["dJ_per_kl"].get("Delta_GSPO", {}).items()
        },
        "Delta_R3": {m: _short(s) for m, s in dj.get("Delta_R3", {}).items()},
        "Delta_null": {
            k: {m: _short(s) for m, s in dj.get(f"Delta_null_{k}", {}).items()} for k in ("order", "jitter")
        },
        "gate": res["decisions"].get("gate"),
        "se_rule": res["decisions"].get("se"),
        "stopped": res["decisions"].get("stopped"),
        "cost_per_state": res["cost_per_state"],
    }
    if "success" in res:
        s = res["success"]
        out["success"] = {"met": s["met"], "blocks": s["blocks"], "null_means": s["null_means"]}
    for k in ("interaction_gspo", "run_level", "dense_r2_equals_grpo"):
        if k in res:
            out[k] = res[k]
    return out


def cost(records: list[dict]) -> dict:
    """Mean wall and CPU seconds per scored state, per set."""
    out = {}
    for s in ("moe", "dense"):
        c = [r["cost"] for r in records if r["state"]["set"] == s and "cost" in r]
        if c:
            out[s] = {k: sum(x[k] for x in c) / len(c) for k in ("wall_s", "cpu_s")} | {"states": len(c)}
    return out


def write(records: list[dict], decisions: dict, out: Path, meta: dict) -> dict:
    """Analyse ``records`` and write ``out`` (.json) and its picture (.png); the result."""
    ms = sorted({int(k.split("@M")[1]) for r in records for k in r["arms"]})
    res = analysis.analyse(records, decisions, ms)
    res["cost_per_state"] = cost(records)
    doc = {"headline": headline(res), **meta, "analysis": res, "records": records}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    plot(res, records, out.with_suffix(".png"))
    return doc


def plot(res: dict, records: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in records if r["state"]["set"] == "moe"]
    ms, primary = res["minibatches"], res["primary_minibatches"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for i, name in enumerate(SHOWN):
        for j, m in enumerate(ms):
            d = analysis.deltas(moe, name, m)
            s = res["moe"]["dJ"].get(name, {}).get(f"M{m}")
            if not d or s is None:
                continue
            x = i + (j - (len(ms) - 1) / 2) * 0.3
            ax.scatter([x] * len(d), d, s=6, alpha=0.35, color=f"C{j}", label=f"M = {m}" if i == 0 else None)
            if math.isfinite(s["ci95"][0]):
                ax.errorbar([x], [s["mean"]], yerr=[[s["mean"] - s["ci95"][0]], [s["ci95"][1] - s["mean"]]],
                            fmt="o", color="k", capsize=3, ms=4)  # fmt: skip
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(SHOWN)), [n.replace("Delta_", "") for n in SHOWN], rotation=20, fontsize=8)
    ax.set_ylabel("dJ(arm) - dJ(reference), per state")
    ax.set_title("paired one-step differences (MoE states; mean, 95% CI)", fontsize=9)
    _legend(ax)
    ax = axes[1]
    for k, arm in enumerate(("GRPO", "GRPO+R2", "GSPO", "GRPO'", "GRPO+R3")):
        pts = [
            (analysis.arm_value(r, arm, primary, key="kl"), analysis.arm_value(r, arm, primary)) for r in moe
        ]
        pts = [p for p in pts if None not in p]
        if pts:
            ax.scatter(*zip(*pts), s=8, alpha=0.5, color=f"C{k}", label=arm)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel("KL(pi_s || pi_theta') (k3, per sequence)")
    ax.set_ylabel("dJ")
    ax.set_title(f"each arm's step at M = {primary}: size (KL) and gain (dJ)", fontsize=9)
    _legend(ax)
    ax = axes[2]
    for j, m in enumerate(ms):
        pts = [(analysis.arm_value(r, "GRPO", m, key="drift_slot"), d)
               for r, d in zip(moe, analysis.deltas(moe, "Delta_R2", m))]  # fmt: skip
        pts = [p for p in pts if None not in p]
        if pts:
            ax.scatter(*zip(*pts), s=8, alpha=0.5, color=f"C{j}", label=f"M = {m}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("GRPO's drift per slot after the last update")
    ax.set_ylabel("Delta_R2")
    ax.set_title("R2's gain against the routing drift it removes", fontsize=9)
    _legend(ax)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
