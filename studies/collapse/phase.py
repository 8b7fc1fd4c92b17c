"""Phase diagram of collapse over the mechanisms: a pre-registered sweep, one lever at a time.

From a stable base (:data:`STABLE_BASE` on recipes/demo/base.yaml) each lever of :data:`LEVERS`
is turned alone: rollout precision (``old_logprobs`` rollout or recompute, no correction),
minibatches per rollout batch, response length, routing granularity at equal active size, depth.
Each (cell, arm, seed) is one run from its cell's SFT start (cached by SFT signature), judged by
``moe_rl.lab.collapse.CRITERION`` and :data:`LEARNING`. The plan is data in
studies/collapse/phase.plan.yaml, written by ``--write-plan`` to
studies/collapse/results/phase-preregistration.json before any run.

    python -m studies.collapse.phase --write-plan
    python -m studies.collapse.phase --stage screen [--jobs 2] [--cells base,minibatches-4] [--dry-run]
    python -m studies.collapse.phase --stage confirm [--jobs 2]     # the best-separating screened cell
    python -m studies.collapse.phase --stage repro [--variant cpu|gpu] [--jobs 2]
    python -m studies.collapse.phase --stage explore [--jobs 2]    # cells outside the plan (EXPLORE)
    python -m studies.collapse.phase --stage screen --report        # tabulate the finished runs only
    python -m studies.collapse.phase --stage smoke                  # tiny end-to-end check

Runs: runs/phase/<cell>/<arm>-s<seed>/ (repro: runs/phase/repro-<variant>/<cell>/...); a finished
run writes status.json and a rerun skips it. Report: studies/collapse/results/phase-<machine>-<stage>-
<commit>.json + .png (collapse rate per arm per lever level, ingredients per cell, ``headline``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from moe_rl.argparsing import positive_int
from moe_rl.config import load_recipe
from moe_rl.lab import runner
from moe_rl.lab.arms import ARMS, DEMO, ROOT, arm_overrides, flatten, start_overrides
from moe_rl.lab.collapse import CRITERION, criterion_doc
from moe_rl.lab.results import commit, machine, result_path, write_json
from moe_rl.lab.runner import STATUS_FILE, arm_command, cpu_seconds, local_launch, run_when_ready
from moe_rl.lab.starts import CACHE, SMOKE_BASE, cached_start, sft_key, warm_start
from moe_rl.lab.stats import lstsq, mean
from studies.collapse import RESULTS, collapse
from studies.collapse.volatility import PAPER

log = logging.getLogger("studies.collapse.phase")
PLAN_FILE = RESULTS / "phase-preregistration.json"
RUNS = ROOT / "runs" / "phase"

# -- the pre-registered plan: data in studies/collapse/phase.plan.yaml ------------------------------
PLAN_YAML = Path(__file__).resolve().parent / "phase.plan.yaml"
"The plan as data beside the demo recipe (its comments say what each entry means)."


@dataclass(frozen=True)
class LearningRule:
    """A run learns when it did not collapse and the mean held-out greedy accuracy of its last
    ``last`` evaluations exceeds its first (step 0: the SFT start) by more than ``margin``."""

    last: int
    margin: float


def _load_plan(path: Path = PLAN_YAML) -> dict:
    """The plan's entries by their names here (``stable_base`` -> ``STABLE_BASE``); lists of names
    and seeds as tuples, the learning rule as a :class:`LearningRule`."""
    plan = {k.upper(): v for k, v in yaml.safe_load(path.read_text()).items()}
    for k in ("SCREEN_ARMS", "DECIDING_ARMS", "SCREEN_ORDER", "NEEDS_RECOMPUTE", "EXPLORE_ARMS"):
        plan[k] = tuple(plan[k])
    plan["SEEDS"] = {stage: tuple(seeds) for stage, seeds in plan["SEEDS"].items()}
    plan["CROSSED"] = {**plan["CROSSED"], "levers": tuple(plan["CROSSED"]["levers"])}
    plan["BASE_REVISIONS"], plan["PLAN_REVISIONS"] = (
        tuple(plan["BASE_REVISIONS"]),
        tuple(plan["PLAN_REVISIONS"]),
    )
    plan["LEARNING"] = LearningRule(**plan["LEARNING"])
    return plan


_PLAN = _load_plan()
STABLE_BASE: dict = _PLAN["STABLE_BASE"]
BASE_REVISIONS: tuple = _PLAN["BASE_REVISIONS"]
BASE_PROTOCOL: str = _PLAN["BASE_PROTOCOL"]
SCREEN_ARMS: tuple[str, ...] = _PLAN["SCREEN_ARMS"]
DECIDING_ARMS: tuple[str, ...] = _PLAN["DECIDING_ARMS"]
DECIDING_DOC: str = _PLAN["DECIDING_DOC"]
SCREEN_ORDER: tuple[str, ...] = _PLAN["SCREEN_ORDER"]
NEEDS_RECOMPUTE: tuple[str, ...] = _PLAN["NEEDS_RECOMPUTE"]
SKIP_DOC: str = _PLAN["SKIP_DOC"]
CROSSED: dict = _PLAN["CROSSED"]
LEVERS: dict[str, dict[str, dict]] = _PLAN["LEVERS"]
SEEDS: dict[str, tuple[int, ...]] = _PLAN["SEEDS"]
LEARNING: LearningRule = _PLAN["LEARNING"]
STABLE_RULE: str = _PLAN["STABLE_RULE"]
BEST_CELL_RULE: str = _PLAN["BEST_CELL_RULE"]
REPLAY_RULE: str = _PLAN["REPLAY_RULE"]
REPRO_SUCCESS: dict = _PLAN["REPRO_SUCCESS"]
REPRO_WALL_BUDGET_S: int = _PLAN["REPRO_WALL_BUDGET_S"]
REPRO_VARIANTS: dict[str, dict] = _PLAN["REPRO_VARIANTS"]
PLAN_REVISIONS: tuple = _PLAN["PLAN_REVISIONS"]
EXPLORE: dict[str, dict] = _PLAN["EXPLORE"]
EXPLORE_DOC: str = _PLAN["EXPLORE_DOC"]
EXPLORE_ARMS: tuple[str, ...] = _PLAN["EXPLORE_ARMS"]

_SMOKE_TRAIN = {"sft_steps": 20, "minibatches": 1, "eval_every": 1, "eval_prompts": 4}
SMOKE = {
    "base": {**SMOKE_BASE, "train": {**SMOKE_BASE["train"], **_SMOKE_TRAIN}},
    "cells": ("base", "precision-bf16-recompute"),
    "arms": ("GRPO", "GSPO"),
    "seeds": (0,),
    "steps": 3,
}
"The smoke stage (not part of the plan): the tiny policy, 2 cells x 2 arms x 1 seed x 3 steps."


def _merged(a: dict, b: dict) -> dict:
    """``b`` over ``a``, one level of sections deep (recipe overrides)."""
    return {k: {**a.get(k, {}), **b.get(k, {})} for k in {**a, **b}}


def reference_cell(lever: str) -> str:
    """The cell a lever is turned from: ``base``, or the crossed cell (:data:`CROSSED`)."""
    return f"{CROSSED['lever']}-{CROSSED['level']}" if lever in CROSSED["levers"] else "base"


def cells() -> dict[str, dict]:
    """Every cell of the plan: ``base`` then ``<lever>-<level>``, with its overrides, skipped arms
    and the cell it differs from in one lever (``reference``)."""
    out = {"base": {"lever": None, "level": None, "overrides": {}, "skip_arms": [], "reference": None}}
    crossed = LEVERS[CROSSED["lever"]][CROSSED["level"]]
    for lever, levels in LEVERS.items():
        for level, ov in list(levels.items())[1:]:
            bypass = ov.get("algo", {}).get("old_logprobs") == "rollout"
            skip = list(NEEDS_RECOMPUTE) if bypass else []
            ref = reference_cell(lever)
            ov = _merged(crossed, ov) if ref != "base" else ov
            out[f"{lever}-{level}"] = {
                "lever": lever,
                "level": level,
                "overrides": ov,
                "skip_arms": skip,
                "reference": ref,
            }
    return out


def cell_of(lever: str, level: str) -> str:
    """The cell name of ``lever`` at ``level`` (its first level is its reference cell)."""
    return reference_cell(lever) if level == next(iter(LEVERS[lever])) else f"{lever}-{level}"


def common_overrides(base: dict, cell: dict, variant: dict | None = None) -> list[str]:
    """The overrides of a cell on recipes/demo/base.yaml: base, then the lever, then the variant."""
    return flatten(base) + flatten(cell["overrides"]) + flatten(variant or {})


def plan_doc() -> dict:
    """The pre-registered plan as plain data (what ``--write-plan`` writes); its ``headline`` is the
    plan's size (no figure is measured before the runs)."""
    plan_cells = cells()
    bypass = [c for c in plan_cells if "bypass" in c]
    screen_runs = (len(plan_cells) * len(SCREEN_ARMS) - len(bypass) * len(NEEDS_RECOMPUTE)) * len(
        SEEDS["screen"]
    )
    return {
        "bench": "phase",
        "headline": {
            "cells": len(plan_cells),
            "arms": list(SCREEN_ARMS),
            "screen_runs": screen_runs,
            "screen_seeds": len(SEEDS["screen"]),
            "confirm_seeds": len(SEEDS["confirm"]),
            "repro_seeds": len(SEEDS["repro"]),
            "stable_base_is_placeholder": False,
        },
        "recipe": str(DEMO.relative_to(ROOT)),
        "stable_base": STABLE_BASE,
        "stable_base_is_placeholder": False,
        "stable_base_status": "candidate until the base gate passes",
        "stable_rule": STABLE_RULE,
        "base_protocol": BASE_PROTOCOL,
        "base_revisions": list(BASE_REVISIONS),
        "plan_revisions": list(PLAN_REVISIONS),
        "crossed": {**CROSSED, "levers": list(CROSSED["levers"])},
        "screen_order": list(SCREEN_ORDER),
        "deciding_arms": list(DECIDING_ARMS),
        "deciding_arms_doc": DECIDING_DOC,
        "levers": LEVERS,
        "cells": plan_cells,
        "arms": {a: flatten(ARMS[a]) for a in SCREEN_ARMS},
        "skipped_in_bypass_cells": {"arms": list(NEEDS_RECOMPUTE), "doc": SKIP_DOC},
        "seeds": SEEDS,
        "criterion": criterion_doc(),
        "learning_rule": {**asdict(LEARNING), "doc": LearningRule.__doc__.strip()},
        "best_cell_rule": BEST_CELL_RULE,
        "replay_rule": REPLAY_RULE,
        "repro_success": REPRO_SUCCESS,
        "repro_variants": REPRO_VARIANTS,
        "p_value": "one-sided Fisher exact test, GRPO vs GSPO collapse counts (GRPO collapses more)",
    }


# -- rules ---------------------------------------------------------------------------------------
def learned(evals: list, collapsed: bool, rule: LearningRule = LEARNING) -> bool:
    """:data:`LEARNING` on a run's held-out evaluations ``[(step, accuracy), ...]`` (one per step)."""
    by_step = dict(sorted((int(s), float(a)) for s, a in evals))  # the final eval repeats the last step
    acc = list(by_step.values())
    if collapsed or len(acc) < rule.last + 1:
        return False
    return sum(acc[-rule.last :]) / rule.last > acc[0] + rule.margin


def fisher_greater(a: int, n1: int, b: int, n2: int) -> float:
    """One-sided Fisher exact p-value that group 1 (a of n1) has the higher rate than group 2 (b of n2).

    P(X >= a) for X hypergeometric: n1 draws from n1 + n2 with a + b successes in all.
    """
    k, n = a + b, n1 + n2
    total = math.comb(n, n1)
    return sum(math.comb(k, x) * math.comb(n - k, n1 - x) for x in range(a, min(n1, k) + 1)) / total


def ranking(table: dict[str, dict], order: list[str] | None = None) -> list[dict]:
    """The cells with GRPO and GSPO runs, best-separating first by :data:`BEST_CELL_RULE`, from
    ``{cell: {arm: {"collapsed", "runs", "cpu_s"}}}``; ``order`` is the plan order of the cells."""
    order = order or list(table)
    scored = []
    for name in order:
        arms = table.get(name, {})
        if "GRPO" not in arms or "GSPO" not in arms:
            continue
        g, s = arms["GRPO"], arms["GSPO"]
        cpu = mean(a.get("cpu_s") for a in arms.values())
        sep = g["collapsed"] - s["collapsed"]
        key = (-sep, s["collapsed"], cpu if cpu == cpu else math.inf, order.index(name))
        scored.append((key, {"cell": name, "separation": sep, "separates": sep > 0, **_counts(g, s)}))
    return [row for _, row in sorted(scored, key=lambda t: t[0])]


def best_cell(table: dict[str, dict], order: list[str] | None = None) -> dict | None:
    """The first cell of :func:`ranking` (None when no cell has runs of GRPO and GSPO)."""
    return next(iter(ranking(table, order)), None)


def _counts(g: dict, s: dict) -> dict:
    return {f"{n}_{k}": x[k] for n, x in (("grpo", g), ("gspo", s)) for k in ("collapsed", "runs")}


# -- the runs ------------------------------------------------------------------------------------
@dataclass
class Stage:
    """What one invocation runs: cells x arms x seeds on a base, under ``root``."""

    name: str
    base: dict
    cells: dict[str, dict]
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    root: Path
    steps: int | None = None
    variant: dict | None = None

    def items(self) -> list[tuple[str, str, int, Path]]:
        """``(cell, arm, seed, out_dir)`` of every run: the :data:`DECIDING_ARMS` of every cell and
        seed first, then the other arms; within each, seeds outermost (early seeds of all cells
        first), then cells in their order."""
        tiers = [
            tuple(a for a in self.arms if a in DECIDING_ARMS),
            tuple(a for a in self.arms if a not in DECIDING_ARMS),
        ]
        return [
            (c, a, s, self.root / c / f"{a}-s{s}")
            for arms in tiers
            for s in self.seeds
            for c, cell in self.cells.items()
            for a in arms
            if a not in cell["skip_arms"]
        ]

    def overrides(self, cell: str, arm: str, seed: int) -> list[str]:
        common = common_overrides(self.base, self.cells[cell], self.variant)
        return common + arm_overrides(arm, seed, self.steps)


def execute(st: Stage, *, jobs: int, cache: Path, launch: str | None) -> list[dict]:
    """Every run of ``st`` not finished yet, ``jobs`` at a time (:func:`run_when_ready`: one worker
    trains the SFT starts the runs lack, in run order, while the others run the runs whose start
    is cached). The screen runs the base gate of
    :data:`BASE_PROTOCOL` first and stops if it fails."""
    if st.name == "screen" and "base" in st.cells and len(st.cells) > 1:
        gate = Stage(st.name, st.base, {"base": st.cells["base"]}, DECIDING_ARMS, st.seeds, st.root, st.steps)
        execute(gate, jobs=jobs, cache=cache, launch=launch)
        verdict = stable_base(cell_tables(analyse(*finished(gate))))
        if not (verdict and verdict["stable"]):
            raise SystemExit(f"the base is not stable ({verdict}): {BASE_PROTOCOL}")
    starts: dict[str, Path] = {}  # cells whose SFT start is cached (several cells share one)
    uncached: set[str] = set()  # cells found without a start since the last build

    def common(c: str) -> list[str]:
        return common_overrides(st.base, st.cells[c], st.variant)

    def ready(item) -> bool:
        c, _, _, out = item
        if (out / STATUS_FILE).exists():  # a finished run needs no start
            return True
        if c not in starts and c not in uncached:
            hit = cached_start(DEMO, common(c), cache=cache)
            if hit is None:
                uncached.add(c)
            else:
                starts[c] = hit[0]
        return c in starts

    def build(item) -> None:  # trains the start in this process; warm_start caches it by signature
        starts[item[0]], _ = warm_start(DEMO, common(item[0]), cache=cache, launch=launch)
        uncached.clear()  # cells of the same signature share this start

    run_launch = local_launch(launch, jobs)

    def one(item):
        c, a, s, out = item
        start = None if (out / STATUS_FILE).exists() else starts[c]  # a finished run is skipped
        ov = st.overrides(c, a, s)
        return runner.resumable_run(f"{c} {a} seed {s}", DEMO, ov, out, start=start, launch=run_launch)

    return run_when_ready(st.items(), jobs=jobs, ready=ready, build=build, run=one)


def finished(st: Stage) -> tuple[list[tuple], list[dict]]:
    """The items of ``st`` whose runs finished, and their statuses."""
    done = [(it, it[3] / STATUS_FILE) for it in st.items() if (it[3] / STATUS_FILE).exists()]
    # status files older than its ended_at field: written last, so the file's time is the end
    statuses = [{"ended_at": f.stat().st_mtime, **json.loads(f.read_text())} for _, f in done]
    return [it for it, _ in done], statuses


TIMING_KEYS = ("step_s",)
"Summary fields that are times: they vary between reruns of one computation."


def same_runs(runs: list[dict], results: Path) -> dict:
    """Each of ``runs`` against the run of the same cell, arm and seed in the committed screen and
    confirmation reports under ``results`` (``phase-*-screen-*.json``, ``phase-*-confirm-*.json``;
    where several hold it, the last by name): identical when every summary number but the times
    and every held-out evaluation are equal. The repro's seeds are those runs' seeds
    (studies/collapse/README.md), so this says whether a run is reproducible bit for bit."""
    earlier = {}
    for f in sorted(results.glob("phase-*-screen-*.json")) + sorted(results.glob("phase-*-confirm-*.json")):
        for r in json.loads(f.read_text()).get("runs", []):
            earlier[(r["cell"], r["arm"], r["seed"])] = (f.name, r)

    def kept(r: dict) -> dict:
        row = json.loads(json.dumps({"summary": r["summary"], "eval": r["eval"]}))  # tuples as lists
        return row | {"summary": {k: v for k, v in row["summary"].items() if k not in TIMING_KEYS}}

    out = {"compared": 0, "identical": 0, "differ": [], "from": set()}
    for r in runs:
        hit = earlier.get((r["cell"], r["arm"], r["seed"]))
        if hit is None:
            continue
        out["compared"] += 1
        out["from"].add(hit[0])
        if kept(r) == kept(hit[1]):
            out["identical"] += 1
        else:
            out["differ"].append(f"{r['arm']}-s{r['seed']}")
    return out | {"from": sorted(out["from"])}


def runs_span_s(statuses: list[dict]) -> float:
    """Wall seconds from the first run's start to the last run's end (each ``ended_at`` less its
    ``wall_s``): what the runs took on this machine, whatever invocations ran or reported them."""
    return max(s["ended_at"] for s in statuses) - min(s["ended_at"] - s["wall_s"] for s in statuses)


def analyse(items: list[tuple], statuses: list[dict]) -> list[dict]:
    """Per run: ``studies.collapse.collapse.analyse_run`` plus its cell, CPU time and :func:`learned`."""
    runs = []
    for (c, a, s, _), st in zip(items, statuses):
        r = collapse.analyse_run(a, s, st)
        runs.append({**r, "cell": c, "learned": learned(r["eval"], r["collapsed"])})
    return runs


INGREDIENTS = (
    "flip_step flip_drift flip_rollout flip_rollout_token_any mismatch_k3 mismatch_extreme clip_token "
    "clip_seq clip_token_of_clipped_seqs grad_norm entropy final_acc sft_acc"
).split()
"""The ingredients reported beside each cell: means over its runs (per arm and over all its arms).
In bypass cells the trainer does not recompute pi_old, so mismatch_* and flip_rollout* are
measured only by the arms that run the old-policy pass anyway (GRPO+R2); the recompute cell of
the same engine precision measures them for every arm."""


_ALIAS = {"final_acc": "eval_end", "sft_acc": "eval_start"}


def ingredients(runs: list[dict]) -> dict:
    """Means of :data:`INGREDIENTS` over ``runs`` (analysed runs and their summaries)."""
    flat = [{**r.get("summary", {}), **r} for r in runs]
    return {k: mean(f.get(_ALIAS.get(k, k)) for f in flat) for k in INGREDIENTS}


def cell_tables(runs: list[dict]) -> dict[str, dict]:
    """Per cell: per arm collapse and learning counts with ingredients, and the cell's ingredients."""
    out = {}
    for c in dict.fromkeys(r["cell"] for r in runs):
        rs = [r for r in runs if r["cell"] == c]
        arms = collapse.analyse_arms(rs)
        for a, row in arms.items():
            ra = [r for r in rs if r["arm"] == a]
            row.update(learned=sum(r["learned"] for r in ra), cpu_s=mean(r["cpu_s"] for r in ra))
            row["ingredients"] = ingredients(ra)
        out[c] = {"arms": arms, "ingredients": ingredients(rs)}
    return out


def diagram(tables: dict[str, dict], arms: tuple[str, ...]) -> dict:
    """Per lever, per level present: the cell, the collapse rate of each arm run there and the
    cell's ingredients (levers whose only level present is the base are left out, unless all are)."""
    out = {}
    for lever, levels in LEVERS.items():
        rows = []
        for level in levels:
            c = cell_of(lever, level)
            if c in tables:
                t = tables[c]["arms"]
                run = [a for a in arms if a in t and t[a]["runs"]]
                rate = {a: t[a]["collapsed"] / t[a]["runs"] for a in run}
                counts = {a: f"{t[a]['collapsed']}/{t[a]['runs']}" for a in run}
                rows.append({"level": level, "cell": c, "collapse_rate": rate, "collapsed": counts})
                rows[-1].update(tables[c]["ingredients"])
        if rows:
            out[lever] = rows
    return {k: v for k, v in out.items() if len(v) > 1} or out  # levers with a level beside the base


def stable_base(tables: dict) -> dict | None:
    """:data:`STABLE_RULE` on the base cell (None when it has no runs of GRPO and GSPO)."""
    arms = tables.get("base", {}).get("arms", {})
    if "GRPO" not in arms or "GSPO" not in arms:
        return None
    ok = all(arms[a]["learned"] == arms[a]["runs"] and arms[a]["collapsed"] == 0 for a in ("GRPO", "GSPO"))
    learned_ = {f"{a}_learned": f"{arms[a]['learned']}/{arms[a]['runs']}" for a in ("GRPO", "GSPO")}
    return {"stable": ok, **learned_}


def repro_headline(arms: dict[str, dict], replay: str | None) -> dict:
    """The repro's headline from its per-arm table (:func:`cell_tables`), judged by :data:`REPRO_SUCCESS`."""
    g, s = arms["GRPO"], arms["GSPO"]
    gspo_acc = s["ingredients"]["final_acc"]
    sft_acc = mean(a["ingredients"]["sft_acc"] for a in arms.values())
    ok = REPRO_SUCCESS
    success = (
        g["runs"] == s["runs"] == ok["seeds"]
        and g["collapsed"] >= ok["grpo_min_collapsed"]
        and s["collapsed"] <= ok["gspo_max_collapsed"]
        and gspo_acc >= sft_acc
    )
    return {
        "grpo_collapsed": g["collapsed"],
        "gspo_collapsed": s["collapsed"],
        "seeds": g["runs"],
        "p_value": fisher_greater(g["collapsed"], g["runs"], s["collapsed"], s["runs"]),
        "gspo_final_acc": gspo_acc,
        "sft_acc": sft_acc,
        "replay_arm": replay,
        "others": {a: _arm_counts(t) for a, t in arms.items() if a not in ("GRPO", "GSPO")},
        "learned": {a: t["learned"] for a, t in arms.items()},
        "success": success,
        "success_rule": ok,
    }


PAPER_LEVELS = {"flip_step": PAPER["flip_per_step"], "flip_rollout": 0.10}
"""The ingredient levels of the 30B-scale reports (docs/algorithms.md, "Paper figures"): about 10% of routing decisions
change per optimizer step, and about 10% differ between the rollout engine and the trainer."""


def paper_gap(tables: dict[str, dict], best: dict | None) -> dict:
    """How far the screened cells got from :data:`PAPER_LEVELS`, and the best cell's effect sizes.

    ``reached``: per ingredient, the cell with the highest mean (over its runs) and the factor it
    stayed below the paper's level (> 1: below). ``effect``: for ``best`` (a :func:`ranking` row),
    the collapse rates of GRPO and GSPO, their difference, the one-sided Fisher p-value, and
    GSPO's minus GRPO's mean final held-out accuracy. ``trend``: :func:`scale_trends`."""
    reached = {}
    for k, level in PAPER_LEVELS.items():
        vals = {c: t["ingredients"][k] for c, t in tables.items() if not math.isnan(t["ingredients"][k])}
        if vals:
            c = max(vals, key=vals.get)
            reached[k] = {
                "cell": c,
                "value": vals[c],
                "paper": level,
                "below_by": level / max(vals[c], 1e-12),
            }
    effect = None
    if best is not None:
        g, s = (tables[best["cell"]]["arms"][a] for a in ("GRPO", "GSPO"))
        rate = {a: t["collapsed"] / t["runs"] for a, t in (("GRPO", g), ("GSPO", s))}
        effect = {
            "cell": best["cell"],
            "collapse_rate": rate,
            "risk_difference": rate["GRPO"] - rate["GSPO"],
            "p_value": fisher_greater(g["collapsed"], g["runs"], s["collapsed"], s["runs"]),
            "final_acc_gspo_minus_grpo": s["ingredients"]["final_acc"] - g["ingredients"]["final_acc"],
        }
    return {"reached": reached, "effect": effect, "trend": scale_trends(tables)}


SCALE_LEVERS = {
    "depth": {"x": "num_layers", "paper": PAPER["layers"], "of_level": int},
    "granularity": {
        "x": "num_experts",
        "paper": PAPER["experts"],
        "of_level": lambda lv: int(lv.split("x")[0]),
    },
}
"""Levers that are a model's scale, the quantity their level sets, its value in the 30B-scale
reports (Qwen3-30B-A3B: 48 layers, 128 experts) and how to read it from a level name."""

SCALE_INGREDIENTS = ("flip_step",)
"""The ingredients of :data:`PAPER_LEVELS` the scale levers exercise. Their cells run the base's fp32
engine, so what they log as rollout-vs-trainer disagreement is fp32 round-off (measured at most
4e-7), not the cross-engine mismatch the R3 paper measures; how that mismatch changes with depth
and granularity at bf16 is ``studies/mismatch/mismatch.py``'s (tiny vs deep policy)."""


def scale_trends(tables: dict[str, dict]) -> dict:
    """Per scale lever (:data:`SCALE_LEVERS`) and ingredient of :data:`SCALE_INGREDIENTS`: the power law
    ``value = exp(c) * x**exponent`` fitted (least squares in log-log) to the cells' means, what it
    predicts at the paper's scale, and the ``x`` at which it would reach the paper's level (None when
    the trend does not rise). Levels whose mean is not a positive number are left out; a lever needs
    two levels with values."""
    out: dict = {}
    for lever, sc in SCALE_LEVERS.items():
        for k in SCALE_INGREDIENTS:
            target, pts = PAPER_LEVELS[k], []
            for level in LEVERS[lever]:
                c = cell_of(lever, level)
                v = tables.get(c, {}).get("ingredients", {}).get(k, math.nan)
                if v > 0 and math.isfinite(v):
                    pts.append((sc["of_level"](level), v))
            if len({x for x, _ in pts}) < 2:
                continue
            c0, b = lstsq([[1.0, math.log(x)] for x, _ in pts], [math.log(v) for _, v in pts])
            out.setdefault(lever, {})[k] = {
                "x": sc["x"],
                "measured": {str(x): v for x, v in pts},
                "exponent": b,
                "paper_x": sc["paper"],
                "at_paper_x": math.exp(c0 + b * math.log(sc["paper"])),
                "paper_level": target,
                "reaches_paper_level_at_x": math.exp((math.log(target) - c0) / b) if b > 0 else None,
            }
    return out


def _arm_counts(t: dict) -> dict:
    return {k: t[k] for k in ("collapsed", "runs", "learned")} | {"final_acc": t["ingredients"]["final_acc"]}


# -- stages --------------------------------------------------------------------------------------
def screen_stage(runs_dir: Path, selected: dict | None = None) -> Stage:
    """The screen over ``selected`` cells (default all), in :data:`SCREEN_ORDER`."""
    pool = selected or cells()
    ordered = {c: pool[c] for c in SCREEN_ORDER if c in pool}
    return Stage("screen", STABLE_BASE, ordered, SCREEN_ARMS, SEEDS["screen"], runs_dir)


def chosen_cell(runs_dir: Path) -> str:
    """The best-separating cell of the finished screen (:data:`BEST_CELL_RULE`)."""
    full = screen_stage(runs_dir)
    st = Stage(full.name, full.base, full.cells, DECIDING_ARMS, full.seeds, full.root)
    items, statuses = finished(st)
    if len(items) < len(st.items()):
        raise SystemExit(
            f"the screen has {len(items)} of {len(st.items())} deciding runs ({', '.join(DECIDING_ARMS)}) "
            f"finished under {runs_dir}: finish them (--stage screen) or name the cell (--cells NAME)"
        )
    tables = cell_tables(analyse(items, statuses))
    return best_cell({c: t["arms"] for c, t in tables.items()}, list(st.cells))["cell"]


def replay_arm(runs_dir: Path, cell: str) -> str:
    """:data:`REPLAY_RULE` on the cell's finished confirmation runs."""
    st = Stage("confirm", STABLE_BASE, {cell: cells()[cell]}, SCREEN_ARMS, SEEDS["confirm"], runs_dir)
    items, statuses = finished(st)
    arms = cell_tables(analyse(items, statuses)).get(cell, {}).get("arms", {}) if items else {}
    r2, r3 = arms.get("GRPO+R2"), arms.get("GRPO+R3")
    if r2 and r3 and r2["collapsed"] < r3["collapsed"]:
        return "GRPO+R2"
    return "GRPO+R3"


def make_stage(args) -> Stage:
    all_cells, runs_dir = (EXPLORE if args.stage == "explore" else cells()), Path(args.runs_dir)
    names = [c.strip() for c in (args.cells or "").split(",") if c.strip()]
    unknown = [c for c in names if c not in all_cells]
    if unknown:
        raise SystemExit(f"unknown cell(s) {unknown}: use {', '.join(all_cells)}")
    pick = {c: all_cells[c] for c in names} or None
    if args.stage == "smoke":
        sm = SMOKE
        sel = pick or {c: all_cells[c] for c in sm["cells"]}
        return Stage("smoke", sm["base"], sel, sm["arms"], sm["seeds"], runs_dir / "smoke", sm["steps"])
    if args.stage == "screen":
        return screen_stage(runs_dir, pick)
    if args.stage == "explore":
        return Stage(
            "explore", STABLE_BASE, pick or dict(EXPLORE), EXPLORE_ARMS, SEEDS["screen"], runs_dir / "explore"
        )
    if pick is None:
        c = chosen_cell(runs_dir)
        log.info("best-separating screened cell: %s", c)
        pick = {c: all_cells[c]}
    if args.stage == "confirm":
        return Stage("confirm", STABLE_BASE, pick, SCREEN_ARMS, SEEDS["confirm"], runs_dir)
    (c,) = pick  # the repro is one cell
    arms = ("GRPO", replay_arm(runs_dir, c), "GSPO")
    name, variant = f"repro-{args.variant}", REPRO_VARIANTS[args.variant]
    return Stage(name, STABLE_BASE, pick, arms, SEEDS["repro"], runs_dir / name, None, variant)


def dry_run(st: Stage, cache: Path, launch: str | None) -> list[str]:
    """The commands of every run of ``st`` (the SFT starts they load named by cache key)."""

    def start_of(c: str) -> Path:  # the finished start, else where warm_start will put it
        common = common_overrides(st.base, st.cells[c], st.variant)
        hit = cached_start(DEMO, common, cache=cache)
        return (
            hit[0]
            if hit
            else cache / sft_key(load_recipe(DEMO, [*common, "train.stages=[sft]"])) / "checkpoints"
        )

    starts = {c: start_of(c) for c in st.cells}  # once per cell: a shipped start is hashed to check it
    lines = []
    for c, a, s, out in st.items():
        ov = [*st.overrides(c, a, s), "train.stages=[rl]", *start_overrides(starts[c])]
        done = "# done: " if (out / STATUS_FILE).exists() else ""
        lines.append(done + arm_command(DEMO, ov, out, launch))
    return lines


# -- report --------------------------------------------------------------------------------------
PANEL_INGREDIENTS = [
    ("flip_step", "flip / optimizer step"),
    ("flip_drift", "drift vs pi_old"),
    ("flip_rollout", "rollout-vs-trainer flip"),
    ("mismatch_extreme", "mismatch extreme frac"),
    ("clip_token", "clipped tokens"),
    ("clip_seq", "clipped sequences"),
]


def plot_diagram(diag: dict, arms: tuple[str, ...], out_png: Path, title: str) -> Path:
    """One row per lever: collapse rate per arm (left) and the cell's ingredients (right) per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(diag), 2, figsize=(15, 3.4 * len(diag) + 1), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for (left, right), (lever, rows) in zip(axes, diag.items()):
        x, labels = range(len(rows)), [r["level"].replace("-", "\n") for r in rows]
        w = 0.8 / len(arms)
        for i, a in enumerate(arms):  # grouped bars, the count "collapsed/runs" above each
            xs = [j + (i - (len(arms) - 1) / 2) * w for j in x]
            ys = [r["collapse_rate"].get(a, math.nan) for r in rows]
            left.bar(xs, [0.01 if y == 0 else y for y in ys], w, color=cmap(i), label=a, alpha=0.85)
            for xi, r in zip(xs, rows):
                y, n = r["collapse_rate"].get(a, 0), r["collapsed"].get(a, "-")
                left.text(xi, 0.03 + y, n, ha="center", fontsize=6)
        left.set_ylim(0, 1.15)
        left.set_ylabel(f"{lever}\ncollapse rate")
        for i, (k, name) in enumerate(PANEL_INGREDIENTS):
            right.plot(x, [r[k] for r in rows], marker="s", color=plt.get_cmap("Dark2")(i), label=name)
        right.axhline(
            PAPER_LEVELS["flip_step"], color="0.4", ls="--", lw=1, label="30B scale: ~10% flip (paper)"
        )
        right.set_yscale("symlog", linthresh=1e-4)
        right.set_ylabel("mean over the cell's runs")
        for ax in (left, right):
            ax.set_xticks(list(x), labels)
            ax.grid(alpha=0.3)
    axes[0][0].set_title("collapsed runs / runs, per arm (fixed criterion)", fontsize=10, loc="right")
    axes[0][1].set_title("ingredients of the cell", fontsize=10, loc="right")
    for ax in axes[0]:
        ax.legend(fontsize=7, ncol=3, loc="lower left", bbox_to_anchor=(0, 1.08))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def report(st: Stage, out: str | None, wall_s: float, cpu_s: float) -> dict:
    """Analyse the finished runs of ``st``; write the JSON (+ PNG) result and return it."""
    items, statuses = finished(st)
    if not items:
        raise SystemExit(f"no finished runs of stage {st.name} under {st.root}")
    runs = analyse(items, statuses)
    tables = cell_tables(runs)
    path = result_path("phase", st.name, out, folder=RESULTS)
    if st.name.startswith("repro"):
        (c,) = st.cells
        replay = next((a for a in st.arms if "+R" in a), None)
        span = runs_span_s(statuses)
        headline = {"cell": c, **repro_headline(tables[c]["arms"], replay), "wall_s": span}
        headline["same_as_earlier_runs"] = same_runs(runs, RESULTS)
        if st.name == "repro-cpu":
            headline |= {"wall_budget_s": REPRO_WALL_BUDGET_S, "within_budget": span <= REPRO_WALL_BUDGET_S}
        diag, png = None, collapse.plot(runs, path.with_suffix(".png"))
    elif st.name == "explore":  # cells outside the plan: counts, ingredients and curves, no diagram
        ranked = ranking({c: t["arms"] for c, t in tables.items()}, list(st.cells))
        gap = paper_gap(tables, ranked[0] if ranked else None)
        headline = {
            "exploratory": EXPLORE_DOC,
            "ranking": ranked,
            "reached": gap["reached"],
            "effect": gap["effect"],
        }
        diag, png = None, collapse.plot(runs, path.with_suffix(".png"))
    else:
        ranked = ranking({c: t["arms"] for c, t in tables.items()}, list(st.cells))
        best = ranked[0] if ranked else None
        headline = {
            "best": best,
            "stable_base": stable_base(tables),
            "ranking": ranked,
            "paper_gap": paper_gap(tables, best),
        }
        title = f"phase diagram ({st.name}, {machine()}): collapse rate per arm, ingredients per cell"
        diag = diagram(tables, st.arms)
        png = plot_diagram(diag, st.arms, path.with_suffix(".png"), title)
        if best:  # the best cell's runs over time: reward, accuracy and ingredients per arm
            best_runs = [r for r in runs if r["cell"] == best["cell"]]
            headline["best_plot"] = collapse.plot(best_runs, path.with_name(path.stem + "-best.png")).name
    doc = {
        "bench": "phase",
        "stage": st.name,
        "machine": machine(),
        "commit": commit(),
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "runs_finished": len(items),
        "runs_planned": len(st.items()),
        "headline": headline,
        "plan": {k: getattr(st, k) for k in ("base", "cells", "arms", "seeds", "steps", "variant")},
        "rules": {
            "criterion": asdict(CRITERION),
            "learning": asdict(LEARNING),
            "best_cell": BEST_CELL_RULE,
        },
        "cells": tables,
        "diagram": diag,
        "runs": runs,
        "plot": png.name,
    }
    write_json(path, doc)
    log.info("wrote %s and %s", path, png)
    return doc


# -- driver --------------------------------------------------------------------------------------
def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m studies.collapse.phase", description=__doc__.split("\n")[0])
    ap.add_argument("--stage", default="screen", choices=("screen", "confirm", "repro", "explore", "smoke"))
    ap.add_argument("--cells", default=None, help="comma-separated cells (default: the stage's)")
    ap.add_argument("--variant", default="cpu", choices=REPRO_VARIANTS, help="repro settings")
    ap.add_argument(
        "--jobs", type=positive_int, default=1, help="runs at once (> 1: each in its own process)"
    )
    ap.add_argument("--runs-dir", default=str(RUNS), help="run directories go under here")
    ap.add_argument("--cache", default=str(CACHE), help="SFT start cache directory")
    ap.add_argument("--launch", default=None, help="command prefix that runs 'RECIPE overrides' per run")
    ap.add_argument("--out", default=None, help="result JSON (default: the study's results/); PNG beside")
    ap.add_argument("--dry-run", action="store_true", help="print the run commands and stop")
    ap.add_argument("--report", action="store_true", help="only analyse the finished runs of the stage")
    ap.add_argument("--write-plan", action="store_true", help=f"write the plan to {PLAN_FILE.name} and stop")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.write_plan:
        path = Path(args.out) if args.out else PLAN_FILE
        write_json(path, plan_doc(), newline=True)
        print(f"wrote {path}")
        return plan_doc()
    st = make_stage(args)
    if args.dry_run:
        print("\n".join(dry_run(st, Path(args.cache), args.launch)))
        return {}
    t0, c0 = time.perf_counter(), cpu_seconds()
    if not args.report:
        execute(st, jobs=args.jobs, cache=Path(args.cache), launch=args.launch)
    doc = report(st, args.out, time.perf_counter() - t0, cpu_seconds() - c0)
    print(json.dumps(doc["headline"], indent=1, default=str))
    return doc


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
