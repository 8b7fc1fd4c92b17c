"""Issue 31's designs as pre-registered plans: (a) routing noise on vs off, every arm, plus the
dense-equivalent (studies/noise/noise.plan.yaml); (b) a router learning-rate dial on countdown, a
higher-entropy task (studies/noise/dial.plan.yaml); (c) each arm's critical learning rate in the
MoE and the dense-equivalent (studies/noise/ladder.plan.yaml, :func:`ladder`).
``python -m studies.noise.noise [--design b|c]`` runs and reports them.

A run is (cell, arm, seed): recipes/demo/base.yaml + the plan's ``cell_base`` + the cell's parts
(``noise``, ``dense``, ``dial_30``, ...) + the arm's overrides + the seed's, from the cell's SFT
start (one per model: cells whose parts change no ``model`` key share theirs, a dense cell has its
own, trained by the same SFT recipe). An ``order`` entry may name its own ``seeds`` and a
``stage``: a later stage runs only once the plan's ``gate`` on the earlier one passed
(:func:`gate`).

Analysis (fixed with the plan): per run the held-out accuracy AUC (:func:`auc`), the collapse
verdict of its training reward (time to collapse, censored at the last step) and its gauges; per
cell and arm the paired differences to GRPO over seeds (:func:`moe_rl.lab.stats.paired`), the
chaos null's spread, Kaplan-Meier and the log-rank p against GRPO; the plan's success rule
(:func:`success`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from moe_rl.lab import cells as cell_plans
from moe_rl.lab.arms import ROOT, arm_dir
from moe_rl.lab.cells import arm_sections, cell_overrides, run_overrides, start_overrides_of  # noqa: F401 (re-exported)
from moe_rl.lab.collapse import collapse_verdict
from moe_rl.lab.stats import auc, kaplan_meier, log_rank_p, mean, outlier_steps, paired, routing_share

HERE = Path(__file__).resolve().parent
PLAN_YAML = HERE / "noise.plan.yaml"
DESIGNS = {
    "a": PLAN_YAML,
    "b": HERE / "dial.plan.yaml",
    "c": HERE / "ladder.plan.yaml",
    "d": HERE / "gates.plan.yaml",
}
"Each design's plan file."
RUNS = ROOT / "runs" / "noise"
SUCCESS_A = {"arm": "GRPO+R3", "decides": "moe-noise", "controls": ["moe-quiet", "dense-noise"]}
"Design (a)'s success rule (its plan states it in words only; a plan's ``success_rule`` otherwise)."
GAUGES = (
    "ratio/routing_share",
    "flip/rollout_vs_trainer/router_rate",
    "flip/step/router_rate",
    "flip/drift/router_rate",
    "mismatch/k3",
    "entropy/mean",
    "ratio/token_frac_outside_0.5_2",
    "clip/token_frac",
)
"""Per-step metrics averaged per run and reported per cell and arm (the plan's ``gauges``);
``ratio/routing_share`` pooled over the run's steps (:func:`routing_share`), not averaged."""
RUN_GAUGES = (*GAUGES, "ratio/routing_share_step_mean", "ratio/steps_outside_0.5_2")
"""What :func:`summarize_run` reports per run: the gauges, the per-step mean of the share and the
fraction of steps with any token ratio outside [0.5, 2] (where routing's outliers show)."""
REFERENCE = "GRPO"
CHAOS = "CHAOS"


def load_plan(path: Path | str = PLAN_YAML) -> dict:
    """A plan, by path or by design letter (:data:`DESIGNS`)."""
    return cell_plans.load_plan(DESIGNS.get(str(path), path))


def design_of(plan: dict) -> str:
    return str(plan.get("design", "a"))


def runs_root(plan: dict) -> Path:
    """Where a plan's runs live: runs/noise for design (a), runs/noise-<design> for the others."""
    d = design_of(plan)
    return RUNS if d == "a" else RUNS.parent / f"noise-{d}"


@dataclass(frozen=True)
class RunSpec:
    cell: str
    arm: str
    seed: int
    out: Path

    @property
    def label(self) -> str:
        return f"{self.cell} {self.arm} seed {self.seed}"


def run_specs(
    plan: dict, root: Path | None = None, cells: list[str] | None = None, stage: int | None = None
) -> list[RunSpec]:
    """Every run of the plan in its ``order`` (each entry's arms, its seeds or the plan's), seed by
    seed within an entry: a partial sweep holds whole seed-paired sets of the entry's arms. A run
    that two entries name (a gauge run the deciding stage reuses) is listed once, at its first."""
    root = runs_root(plan) if root is None else root
    out, seen = [], set()
    for entry in plan["order"]:
        if (cells and entry["cell"] not in cells) or (stage is not None and entry.get("stage", 1) != stage):
            continue
        for seed in entry.get("seeds", plan["seeds"]):
            for arm in entry["arms"]:
                if (entry["cell"], arm, seed) in seen:
                    continue
                seen.add((entry["cell"], arm, seed))
                out.append(
                    RunSpec(entry["cell"], arm, seed, root / entry["cell"] / f"{arm_dir(arm)}-s{seed}")
                )
    return out


def stages(plan: dict) -> list[int]:
    return sorted({int(e.get("stage", 1)) for e in plan["order"]})


# -- per run --------------------------------------------------------------------------------------
def summarize_run(arm: dict) -> dict:
    """What the analysis reads of one finished run (``arm``: :func:`moe_rl.lab.report.load_arm`)."""
    evals = [(r["step"], r["eval/accuracy"]) for r in arm["eval"] if r.get("eval/accuracy") is not None]
    rewards = [r.get("reward/mean") for r in arm["rl"]]
    v = collapse_verdict(rewards)
    gauges = {g: mean(r.get(g) for r in arm["rl"]) for g in GAUGES}
    # the share pooled over steps; the per-step mean kept beside it
    gauges["ratio/routing_share_step_mean"] = gauges["ratio/routing_share"]
    gauges["ratio/routing_share"] = routing_share(arm["rl"])
    gauges["ratio/steps_outside_0.5_2"] = outlier_steps(arm["rl"])
    return {
        "auc": auc(evals),
        "final_acc": evals[-1][1] if evals else math.nan,
        "start_acc": evals[0][1] if evals else math.nan,
        "steps": len(arm["rl"]),
        "collapsed": v.collapsed,
        "collapse_step": v.step if v.collapsed else None,
        "time": float(v.step if v.collapsed else len(rewards)),
        "evals": evals,
        "gauges": gauges,
    }


# -- per cell and arm -----------------------------------------------------------------------------
def analyse(plan: dict, results: dict[tuple[str, str, int], dict]) -> dict:
    """Per cell: every arm's paired differences to GRPO (AUC, final accuracy) over the seeds both
    finished, the chaos spread, Kaplan-Meier and log-rank against GRPO, the gauges; and the verdict
    of the plan's success rule."""
    cells = {}
    for cell in plan["cells"]:
        arms = sorted({a for (c, a, _) in results if c == cell})
        if REFERENCE not in arms:
            continue
        ref = {s: r for (c, a, s), r in results.items() if c == cell and a == REFERENCE}
        table = {}
        for arm in arms:
            mine = {s: r for (c, a, s), r in results.items() if c == cell and a == arm}
            seeds = sorted(set(mine) & set(ref))
            row = {
                "n_runs": len(mine),
                "auc_mean": mean(r["auc"] for r in mine.values()),
                "final_acc_mean": mean(r["final_acc"] for r in mine.values()),
                "collapsed": sum(r["collapsed"] for r in mine.values()),
                "gauges": {g: mean(r["gauges"].get(g) for r in mine.values()) for g in RUN_GAUGES},
                "km": kaplan_meier(
                    [r["time"] for r in mine.values()], [r["collapsed"] for r in mine.values()]
                ),
            }
            if arm != REFERENCE:
                row["auc_diff"] = paired([mine[s]["auc"] - ref[s]["auc"] for s in seeds])
                row["final_acc_diff"] = paired([mine[s]["final_acc"] - ref[s]["final_acc"] for s in seeds])
                row["log_rank_p"] = log_rank_p(
                    [mine[s]["time"] for s in seeds],
                    [mine[s]["collapsed"] for s in seeds],
                    [ref[s]["time"] for s in seeds],
                    [ref[s]["collapsed"] for s in seeds],
                )
            table[arm] = row
        chaos = table.get(CHAOS, {}).get("auc_diff", {})
        cells[cell] = {"arms": table, "chaos_spread": chaos.get("sd", math.nan)}
    out = {"cells": cells, "success": success(cells, plan.get("success_rule", SUCCESS_A))}
    if "gate" in plan:
        out["gate"] = gate(plan, cells)
    if "ladder" in plan:
        out["ladder"] = ladder(plan, results)
        out["success"] = out["ladder"]["success"]
    return out


def separates(cell: dict | None, arm: str = "GRPO+R3") -> bool | None:
    """The success rule's contrast in one cell: ``arm``'s paired AUC difference to GRPO positive
    with p < 0.05 and larger than the chaos spread (None: not measured)."""
    if cell is None or arm not in cell["arms"] or "auc_diff" not in cell["arms"][arm]:
        return None
    d, spread = cell["arms"][arm]["auc_diff"], cell["chaos_spread"]
    if d["n"] == 0 or not math.isfinite(spread):
        return None
    return bool(d["mean"] > 0 and d["p"] < 0.05 and d["mean"] > spread)


def success(cells: dict, rule: dict = SUCCESS_A) -> dict:
    """The plan's success rule on what finished: ``rule["arm"]`` separates from GRPO
    (:func:`separates`) in the ``decides`` cell and in none of the ``controls`` (None where a cell's
    contrast is not measured)."""
    names = [rule["decides"], *rule["controls"]]
    seps = {c: separates(cells.get(c), rule["arm"]) for c in names}
    decided = None not in seps.values()
    met = bool(seps[rule["decides"]] and all(seps[c] is False for c in rule["controls"]))
    return {
        **{f"{c.replace('-', '_')}_separates": v for c, v in seps.items()},
        "met": met if decided else None,
    }


def gate(plan: dict, cells: dict) -> dict:
    """The plan's ``gate`` on its gauge stage: the ``gauge`` (a per-step metric averaged per run) of
    ``arm`` in the ``dialled`` cell is at least ``ratio`` x its value in the ``baseline`` cell, and
    ``routing_share`` there at least ``min_routing_share``. ``passed`` is None until both cells hold
    the gate's ``runs`` finished runs of the arm; the later stages run only when it is True."""
    g = plan["gate"]
    rows = [cells.get(c, {}).get("arms", {}).get(g["arm"]) for c in (g["baseline"], g["dialled"])]
    if None in rows or any(r["n_runs"] < g.get("runs", 1) for r in rows):
        return {**g, "passed": None}
    base, dial = (r["gauges"][g["gauge"]] for r in rows)
    share = rows[1]["gauges"]["ratio/routing_share"]
    vals = {"baseline_value": base, "dialled_value": dial, "dialled_routing_share": share}
    if not all(isinstance(v, float) and math.isfinite(v) for v in vals.values()):
        return {**g, **vals, "passed": None}
    return {**g, **vals, "passed": bool(dial >= g["ratio"] * base and share >= g["min_routing_share"])}


# -- design (c): critical learning rates ----------------------------------------------------------
def fell(summary: dict, drop: float) -> bool:
    """Design (c)'s collapse: the training reward's fixed criterion (``collapsed``), or a held-out
    evaluation after the start more than ``drop`` (absolute) below the start's accuracy."""
    evals = summary["evals"]
    if summary["collapsed"]:
        return True
    return bool(evals) and any(acc < evals[0][1] - drop for _, acc in evals[1:])


def critical_lr(rungs: list[dict | None], lrs: list[float], drop: float) -> float | None:
    """The lowest rung's learning rate whose run fell (:func:`fell`), climbing from the bottom;
    ``math.inf`` when every rung finished and none fell (censored above the top); None while a
    rung below the first fall has not finished."""
    for lr, r in zip(lrs, rungs):
        if r is None:
            return None
        if fell(r, drop):
            return lr
    return math.inf


def next_rungs(plan: dict, results: dict[tuple[str, str, int], dict]) -> list:
    """Each ladder climbed from the bottom: per model, arm (the plan's ``margin`` pair) and seed, the
    ``(cell, arm, seed)`` of its lowest rung not finished yet, unless a lower rung's run fell (its
    critical learning rate is then known: :func:`critical_lr` reads no higher rung). Empty once
    every ladder is decided."""
    lad = plan["ladder"]
    drop = float(lad["heldout_drop"])
    out = []
    for cells in lad["models"].values():
        for arm in lad["margin"]:
            for seed in plan["seeds"]:
                for cell in cells:
                    r = results.get((cell, arm, seed))
                    if r is None:
                        out.append((cell, arm, seed))
                        break
                    if fell(r, drop):
                        break
    return out


def ladder(plan: dict, results: dict[tuple[str, str, int], dict]) -> dict:
    """Per model and arm, each seed's critical learning rate; per model and seed, the margin
    log2(critical LR of ``high`` / critical LR of ``low``) (a ladder censored above its top counts
    as ``censor_factor`` x the top rung: an understated margin); the contrast: per seed, the first
    model's margin minus the second's (paired by seed), its mean, 95% t interval and sign-flip p.
    ``success.met``: that mean positive with p < 0.05, over every seed (None until all are in)."""
    lad = plan["ladder"]
    lrs, drop = [float(x) for x in lad["lrs"]], float(lad["heldout_drop"])
    top = lrs[-1] * float(lad["censor_factor"])
    high, low = lad["margin"]
    models: dict = {}
    for model, cells in lad["models"].items():
        crit, arms = {}, {}
        for arm in (high, low):
            crit[arm] = {
                s: critical_lr([results.get((c, arm, s)) for c in cells], lrs, drop) for s in plan["seeds"]
            }
            known = {s: c for s, c in crit[arm].items() if c is not None}
            arms[arm] = {
                "critical_lr": {s: c for s, c in known.items() if math.isfinite(c)},
                "censored": [s for s, c in known.items() if not math.isfinite(c)],
            }
        margins = {}
        for seed in plan["seeds"]:
            a, b = crit[high][seed], crit[low][seed]
            if a is not None and b is not None:
                margins[seed] = math.log2(min(a, top) / min(b, top))
        models[model] = {"arms": arms, "margins": margins, "margin": paired(list(margins.values()))}
    first, second = list(lad["models"])
    seeds = sorted(set(models[first]["margins"]) & set(models[second]["margins"]))
    contrast = paired([models[first]["margins"][s] - models[second]["margins"][s] for s in seeds])
    done = len(seeds) == len(plan["seeds"])
    met = bool(contrast["mean"] > 0 and contrast["p"] < 0.05) if done else None
    return {"models": models, "contrast": contrast, "success": {"contrast_n": len(seeds), "met": met}}
