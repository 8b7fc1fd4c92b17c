"""Issue 31, design (a): routing noise on vs off, every arm, plus the dense-equivalent (the plan is
data in recipes/demo/noise.plan.yaml; ``python -m benchmarks.noise`` runs and reports it).

A run is (cell, arm, seed): recipes/demo/base.yaml + the plan's ``cell_base`` + the cell's parts
(``noise``, ``dense``) + the arm's overrides + the seed's, from the cell's SFT start (one per
model: the MoE cells share theirs, the dense cell has its own, trained by the same SFT recipe).

Analysis (fixed with the plan): per run the held-out accuracy AUC (:func:`auc`), the collapse
verdict of its training reward (time to collapse, censored at the last step) and its gauges; per
cell and arm the paired differences to GRPO over seeds (:func:`moe_rl.lab.stats.paired`), the
chaos null's spread, Kaplan-Meier and the log-rank p against GRPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_rl.lab.arms import ARMS, FIRST_SEED, ROOT, arm_dir, flatten
from moe_rl.lab.collapse import collapse_verdict
from moe_rl.lab.stats import kaplan_meier, log_rank_p, mean, paired

PLAN_YAML = ROOT / "recipes" / "demo" / "noise.plan.yaml"
RUNS = ROOT / "runs" / "noise"
GAUGES = (
    "ratio/routing_share",
    "flip/rollout_vs_trainer/router_rate",
    "flip/step/router_rate",
    "flip/drift/router_rate",
    "mismatch/k3",
    "entropy/mean",
)
"Per-step metrics averaged per run and reported per cell and arm (the plan's ``gauges``)."
REFERENCE = "GRPO"
CHAOS = "CHAOS"


def load_plan(path: Path = PLAN_YAML) -> dict:
    return yaml.safe_load(Path(path).read_text())


@dataclass(frozen=True)
class RunSpec:
    cell: str
    arm: str
    seed: int
    out: Path

    @property
    def label(self) -> str:
        return f"{self.cell} {self.arm} seed {self.seed}"


def arm_sections(plan: dict, arm: str) -> list[dict]:
    """The recipe sections of ``arm``: one of :data:`ARMS`, or a plan ``extra_arms`` entry over its
    ``of`` arm."""
    extra = plan.get("extra_arms", {})
    if arm in extra:
        return [*arm_sections(plan, extra[arm]["of"]), extra[arm]["overrides"]]
    if arm not in ARMS:
        raise KeyError(f"unknown arm {arm!r}: use one of {', '.join([*ARMS, *extra])}")
    return [ARMS[arm]]


def cell_overrides(plan: dict, cell: str) -> list[str]:
    """base.yaml overrides of ``cell``: ``cell_base`` then its parts (``noise``, ``dense``)."""
    if cell not in plan["cells"]:
        raise KeyError(f"unknown cell {cell!r}: use one of {', '.join(plan['cells'])}")
    return flatten(plan["cell_base"]) + [ov for part in plan["cells"][cell] for ov in flatten(plan[part])]


def start_overrides_of(plan: dict, cell: str) -> list[str]:
    """The overrides that fix a cell's SFT start: ``cell_base`` and its model part (``dense``); the
    noise is RL-only (its SFT signature is the MoE cells')."""
    parts = [p for p in plan["cells"][cell] if "model" in plan[p]]
    return flatten(plan["cell_base"]) + [ov for p in parts for ov in flatten(plan[p])]


def run_overrides(plan: dict, cell: str, arm: str, seed: int, steps: int | None = None) -> list[str]:
    ov = cell_overrides(plan, cell)
    for sections in arm_sections(plan, arm):
        ov += flatten(sections)
    ov += [f"train.seed={FIRST_SEED + seed}", f"task.seed={seed}"]
    return ov + ([f"train.rl_steps={steps}"] if steps else [])


def run_specs(plan: dict, root: Path = RUNS, cells: list[str] | None = None) -> list[RunSpec]:
    """Every run of the plan in its ``order`` (each entry's arms, every seed), seed by seed within
    an entry: a partial sweep holds whole seed-paired sets of the entry's arms."""
    out = []
    for entry in plan["order"]:
        if cells and entry["cell"] not in cells:
            continue
        for seed in plan["seeds"]:
            for arm in entry["arms"]:
                out.append(
                    RunSpec(entry["cell"], arm, seed, root / entry["cell"] / f"{arm_dir(arm)}-s{seed}")
                )
    return out


# -- per run --------------------------------------------------------------------------------------
def auc(evals: list[tuple[int, float]]) -> float:
    """Trapezoid area under (steps done, held-out accuracy) from the first evaluation to the last,
    divided by the steps between them: a mean accuracy over training (nan with < 2 evaluations)."""
    pts = sorted((int(s), float(a)) for s, a in evals)
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return math.nan
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


def summarize_run(arm: dict) -> dict:
    """What the analysis reads of one finished run (``arm``: :func:`moe_rl.lab.report.load_arm`)."""
    evals = [(r["step"], r["eval/accuracy"]) for r in arm["eval"] if r.get("eval/accuracy") is not None]
    rewards = [r.get("reward/mean") for r in arm["rl"]]
    v = collapse_verdict(rewards)
    return {
        "auc": auc(evals),
        "final_acc": evals[-1][1] if evals else math.nan,
        "start_acc": evals[0][1] if evals else math.nan,
        "steps": len(arm["rl"]),
        "collapsed": v.collapsed,
        "collapse_step": v.step if v.collapsed else None,
        "time": float(v.step if v.collapsed else len(rewards)),
        "evals": evals,
        "gauges": {g: mean(r.get(g) for r in arm["rl"]) for g in GAUGES},
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
                "gauges": {g: mean(r["gauges"][g] for r in mine.values()) for g in GAUGES},
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
    return {"cells": cells, "success": success(cells)}


def separates(cell: dict | None, arm: str = "GRPO+R3") -> bool | None:
    """The success rule's contrast in one cell: ``arm``'s paired AUC difference to GRPO positive
    with p < 0.05 and larger than the chaos spread (None: not measured)."""
    if cell is None or arm not in cell["arms"] or "auc_diff" not in cell["arms"][arm]:
        return None
    d, spread = cell["arms"][arm]["auc_diff"], cell["chaos_spread"]
    if d["n"] == 0 or not math.isfinite(spread):
        return None
    return bool(d["mean"] > 0 and d["p"] < 0.05 and d["mean"] > spread)


def success(cells: dict) -> dict:
    """The plan's success rule on what finished (None where a cell's contrast is not measured)."""
    on = separates(cells.get("moe-noise"))
    quiet, dense = separates(cells.get("moe-quiet")), separates(cells.get("dense-noise"))
    decided = None not in (on, quiet, dense)
    return {
        "moe_noise_separates": on,
        "moe_quiet_separates": quiet,
        "dense_noise_separates": dense,
        "met": bool(on and quiet is False and dense is False) if decided else None,
    }
