"""Issue 31, designs (a) to (d): routing noise on vs off with every arm and a
dense-equivalent; a router learning-rate dial on countdown, gauged first; each arm's critical
learning rate in the MoE and in the dense-equivalent; a confirmation of (a)'s R3 + gates lead on
fresh seeds with its noise-off control.

Each plan is data (studies/noise/{noise,dial,ladder,gates}.plan.yaml), pre-registered by
``--write-plan`` into studies/noise/results/noise[-b|-c|-d]-preregistration.json and committed before any
run; the runs, the analysis, the gate and the success rule are in :mod:`studies.noise.design`.

    python -m studies.noise.noise [--design b|c|d] --write-plan
    python -m studies.noise.noise [--design b|c|d] [--jobs 2] [--cells moe-noise] [--dry-run]   # resumable
    python -m studies.noise.noise [--design b|c|d] --report                                 # finished runs only
    python -m studies.noise.noise --smoke                                                   # tiny end-to-end check

Runs: runs/noise[-b|-c|-d]/<cell>/<arm>-s<seed>/ (a finished run writes status.json; a rerun skips it).
A plan with stages runs them in order, each later one only once the plan's gate passed.
Report: studies/noise/results/noise-<machine>-<design>-<commit>.json + .png (``headline``: every arm's
paired AUC difference to GRPO with its 95% interval and p, the chaos spread, routing_share, per
cell; the gate; design (c)'s critical learning rates and margins).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path

from moe_rl.argparsing import positive_int
from moe_rl.lab import runner
from moe_rl.lab.arms import DEMO
from moe_rl.lab.report import load_arm
from moe_rl.lab.results import commit, machine, result_path, write_json
from moe_rl.lab.runner import STATUS_FILE, local_launch, read_status, run_when_ready
from moe_rl.lab.starts import CACHE, SMOKE_BASE, cached_start, warm_start
from studies.noise import RESULTS
from studies.noise import design as noise

log = logging.getLogger("studies.noise.noise")
PLAN_FILE = RESULTS / "noise-preregistration.json"


def plan_file(design: str) -> Path:
    """Design (a)'s pre-registration keeps its first name; the others' carry their letter."""
    return PLAN_FILE if design == "a" else RESULTS / f"noise-{design}-preregistration.json"


SMOKE = {
    "cell_base": {
        **SMOKE_BASE,
        "train": {**SMOKE_BASE["train"], "rl_steps": 3, "eval_every": 1, "eval_prompts": 4, "sft_steps": 20},
    },
    "seeds": [0, 1],
    "order": [{"cell": "moe-noise", "arms": ["GRPO", "GRPO+R3", "CHAOS"]}],
}
"The smoke plan: the plan's cells and arms on the tiny policy, 1 cell x 3 arms x 2 seeds x 3 steps."


def plan_doc(plan: dict) -> dict:
    """The pre-registration: the plan, the number of runs, the analysis code's rules."""
    specs = noise.run_specs(plan)
    return {
        "bench": "noise",
        "design": noise.design_of(plan),
        "commit": commit(),
        "headline": {"runs_planned": len(specs), "seeds": plan["seeds"], "cells": list(plan["cells"])},
        "plan": plan,
        "analysis": {
            "auc": noise.auc.__doc__,
            "paired": "moe_rl.lab.stats.paired: mean, 95% t interval, exact two-sided sign-flip p",
            "success": noise.separates.__doc__,
            "success_rule": noise.success.__doc__,
            "gate": noise.gate.__doc__,
            **(
                {
                    "ladder": noise.ladder.__doc__,
                    "critical_lr": noise.critical_lr.__doc__,
                    "fell": noise.fell.__doc__,
                }
                if "ladder" in plan
                else {}
            ),
        },
    }


def execute(plan: dict, specs: list[noise.RunSpec], *, jobs: int, cache: Path = CACHE) -> None:
    """Every run of ``specs`` not finished yet, ``jobs`` at a time, each in its own process (one
    thread each when several run at once); starts trained once per SFT signature, in this process."""
    starts: dict[str, Path] = {}
    launch = local_launch(runner.child_launch(), jobs)

    def ready(spec) -> bool:
        if (spec.out / STATUS_FILE).exists():
            return True
        if spec.cell not in starts:
            hit = cached_start(DEMO, noise.start_overrides_of(plan, spec.cell), cache=cache)
            if hit is not None:
                starts[spec.cell] = hit[0]
        return spec.cell in starts

    def build(spec) -> None:
        starts[spec.cell], _ = warm_start(DEMO, noise.start_overrides_of(plan, spec.cell), cache=cache)

    def one(spec):
        start = None if (spec.out / STATUS_FILE).exists() else starts[spec.cell]
        ov = noise.run_overrides(plan, spec.cell, spec.arm, spec.seed)
        threads = 1 if jobs > 1 else None
        return runner.resumable_run(
            spec.label, DEMO, ov, spec.out, start=start, launch=launch, threads=threads
        )

    run_when_ready(specs, jobs=jobs, ready=ready, build=build, run=one)


def collect(specs: list[noise.RunSpec]) -> tuple[dict, list[dict]]:
    """Summaries of the finished runs, by (cell, arm, seed), and their cost rows."""
    results, cost = {}, []
    for spec in specs:
        st = read_status(spec.out / STATUS_FILE) if (spec.out / STATUS_FILE).exists() else None
        if st is None or st.get("status") != "done":
            continue
        summary = noise.summarize_run(load_arm(spec.out))
        results[(spec.cell, spec.arm, spec.seed)] = summary
        cost.append({"cell": spec.cell, "arm": spec.arm, "seed": spec.seed, "wall_s": st.get("wall_s")})
    return results, cost


def headline(analysis: dict) -> dict:
    out = {"success": analysis["success"], "cells": {}}
    if "gate" in analysis:
        out["gate"] = analysis["gate"]
    if "ladder" in analysis:
        lad = analysis["ladder"]
        out["ladder"] = {
            "contrast": lad["contrast"],
            "margins": {m: v["margin"] for m, v in lad["models"].items()},
            "critical_lr": {m: v["arms"] for m, v in lad["models"].items()},
        }
    for cell, c in analysis["cells"].items():
        out["cells"][cell] = {
            "chaos_spread": c["chaos_spread"],
            "arms": {
                arm: {
                    "auc_diff": row.get("auc_diff"),
                    "auc_mean": row["auc_mean"],
                    "n_runs": row["n_runs"],
                    "routing_share": row["gauges"]["ratio/routing_share"],
                    "routing_share_step_mean": row["gauges"]["ratio/routing_share_step_mean"],
                    "steps_outside_0.5_2": row["gauges"]["ratio/steps_outside_0.5_2"],
                    "token_frac_outside_0.5_2": row["gauges"]["ratio/token_frac_outside_0.5_2"],
                    "clip_token_frac": row["gauges"]["clip/token_frac"],
                    "rollout_vs_trainer_router_rate": row["gauges"]["flip/rollout_vs_trainer/router_rate"],
                    "collapsed": row["collapsed"],
                }
                for arm, row in c["arms"].items()
            },
        }
    return out


def plot(analysis: dict, results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(analysis["cells"])
    cols = len(cells) + ("ladder" in analysis)
    fig, axes = plt.subplots(2, max(1, cols), figsize=(5.5 * max(1, cols), 8), squeeze=False)
    if "ladder" in analysis:
        plot_ladder(analysis["ladder"], axes[0][-1], axes[1][-1])
    for j, cell in enumerate(cells):
        c = analysis["cells"][cell]
        ax = axes[0][j]
        arms = [a for a in c["arms"] if a != noise.REFERENCE]
        for i, arm in enumerate(arms):
            ref = {s: r for (cc, a, s), r in results.items() if cc == cell and a == noise.REFERENCE}
            pts = [
                r["auc"] - ref[s]["auc"]
                for (cc, a, s), r in results.items()
                if cc == cell and a == arm and s in ref
            ]
            ax.scatter([i] * len(pts), pts, s=14, alpha=0.6)
            d = c["arms"][arm].get("auc_diff") or {}
            if d.get("n"):
                lo, hi = d["ci95"]
                ax.errorbar([i + 0.15], [d["mean"]], yerr=[[d["mean"] - lo], [hi - d["mean"]]] if math.isfinite(lo) else None,
                            fmt="o", color="k", capsize=3)  # fmt: skip
        spread = c["chaos_spread"]
        if math.isfinite(spread):
            ax.axhspan(-spread, spread, color="grey", alpha=0.2, label="chaos spread (sd)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{cell}: AUC - GRPO's, per seed (mean, 95% CI)", fontsize=9)
        ax = axes[1][j]
        for arm in c["arms"]:
            curves = [r["evals"] for (cc, a, _), r in results.items() if cc == cell and a == arm]
            if not curves:
                continue
            xs = [x for x, _ in curves[0]]
            med = [sorted(cv[k][1] for cv in curves if len(cv) > k)[len(curves) // 2] for k in range(len(xs))]
            ax.plot(xs, med, marker=".", label=f"{arm} (median of {len(curves)})")
        ax.set_xlabel("RL steps")
        ax.set_ylabel("held-out accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_ladder(lad: dict, top, bottom) -> None:
    """Design (c)'s primary, drawn: each seed's critical learning rate per model and arm (a
    censored ladder drawn above the top rung), and each seed's margin per model with the contrast
    (first model's margin minus the second's), mean and 95% interval."""
    models = list(lad["models"])
    high, low = list(lad["models"][models[0]]["arms"])
    found = [
        lr for m in models for row in lad["models"][m]["arms"].values() for lr in row["critical_lr"].values()
    ]
    above = 1.25 * max(found, default=1.0)
    for i, model in enumerate(models):
        for j, (arm, row) in enumerate(lad["models"][model]["arms"].items()):
            seeds = sorted(set(row["critical_lr"]) | set(row["censored"]))
            xs = [k + 0.12 * (2 * i + j) - 0.18 for k in range(len(seeds))]
            ys = [row["critical_lr"].get(s, float("nan")) for s in seeds]
            top.scatter(xs, ys, marker="os"[i], label=f"{model} {arm}", alpha=0.8)
            cens = [x for x, s in zip(xs, seeds) if s in row["censored"]]
            top.scatter(cens, [above] * len(cens), marker="^", color="grey")
        if i == 0:
            top.set_xticks(range(len(seeds)), [str(s) for s in seeds], fontsize=8)
    top.set_yscale("log")
    top.set_xlabel("seed")
    top.set_ylabel("critical learning rate (lowest rung that fell)")
    top.set_title("critical learning rate per seed (^: none fell)", fontsize=9)
    top.legend(fontsize=7)
    series = [(m, lad["models"][m]["margins"], lad["models"][m]["margin"]) for m in models]
    seeds = sorted(set(series[0][1]) & set(series[1][1]))
    diffs = {s: series[0][1][s] - series[1][1][s] for s in seeds}
    series.append((f"{models[0]} - {models[1]}", diffs, lad["contrast"]))
    for i, (_, per_seed, stat) in enumerate(series):
        pts = list(per_seed.values())
        bottom.scatter([i] * len(pts), pts, s=14, alpha=0.6)
        if stat.get("n") and math.isfinite(stat["ci95"][0]):
            lo, hi = stat["ci95"]
            bottom.errorbar([i + 0.15], [stat["mean"]], yerr=[[stat["mean"] - lo], [hi - stat["mean"]]],
                            fmt="o", color="k", capsize=3)  # fmt: skip
    bottom.axhline(0, color="grey", lw=0.8)
    bottom.set_xticks(range(len(series)), [n for n, _, _ in series], fontsize=8)
    bottom.set_ylabel(f"log2(critical LR {high} / {low})")
    bottom.set_title(f"margin per seed; primary: the contrast (p = {lad['contrast'].get('p', float('nan')):.2f})",
                     fontsize=9)  # fmt: skip


def report(plan: dict, specs: list[noise.RunSpec], preset: str, t0: float) -> Path:
    results, cost = collect(specs)
    analysis = noise.analyse(plan, results)
    stage = preset if len(results) == len(specs) else f"{preset}-partial"
    out = result_path("noise", stage, folder=RESULTS)
    png = out.with_suffix(".png")
    plot(analysis, results, png)
    walls = [c["wall_s"] for c in cost if c["wall_s"]]
    doc = {
        "bench": "noise",
        "design": noise.design_of(plan),
        "machine": machine(),
        "commit": commit(),
        "runs_finished": len(results),
        "runs_planned": len(specs),
        "wall_s": time.perf_counter() - t0,
        "headline": {
            **headline(analysis),
            "runs_finished": len(results),
            "runs_planned": len(specs),
            "cost_per_run_s": sum(walls) / len(walls) if walls else None,
        },
        "analysis": analysis,
        "runs": [{"cell": c, "arm": a, "seed": s, **r} for (c, a, s), r in results.items()],
        "cost": cost,
        "plot": png.name,
    }
    write_json(out, doc)
    print(f"{len(results)}/{len(specs)} runs finished; success: {analysis['success']}")
    for key in ("gate", "ladder"):
        if key in analysis:
            print(f"{key}: {headline(analysis)[key]}")
    for cell, c in analysis["cells"].items():
        spread = c["chaos_spread"]
        measured = spread is not None and math.isfinite(spread)
        print(f"{cell}: chaos spread {f'{spread:.4f}' if measured else 'not measured (no CHAOS arm)'}")
        for arm, row in c["arms"].items():
            d = row.get("auc_diff")
            diff = (
                f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] p={d['p']:.3f} n={d['n']}"
                if d
                else ""
            )
            g = row["gauges"]
            print(
                f"  {arm:<15} auc {row['auc_mean']:.4f} {diff}  share {g['ratio/routing_share']:.3f}"
                f"  steps outside [0.5, 2] {g['ratio/steps_outside_0.5_2']:.2f}"
            )
    print(f"wrote {out}")
    return out


def run_stages(plan: dict, root: Path, cells: list[str] | None, *, jobs: int, cache: Path) -> bool:
    """Each stage of the plan in turn (resumable); a later stage only once the gate passed.
    Returns whether every stage ran."""
    for stage in noise.stages(plan):
        if stage > 1 and "gate" in plan:
            results, _ = collect(noise.run_specs(plan, root, stage=1))
            verdict = noise.gate(plan, noise.analyse(plan, results)["cells"])
            if verdict["passed"] is not True:
                log.warning("gate not passed (%s): stage %d and later not run", verdict, stage)
                return False
        specs = noise.run_specs(plan, root, cells, stage=stage)
        runner.stop_cleanly(lambda specs=specs: execute(plan, specs, jobs=jobs, cache=cache))
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.noise.noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", choices=sorted(noise.DESIGNS), default="a", help="which plan (default a)")
    ap.add_argument("--write-plan", action="store_true", help="write the pre-registration and stop")
    ap.add_argument("--jobs", type=positive_int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--cells", default=None, help="comma-separated cells to run (default: the plan's order)")
    ap.add_argument("--dry-run", action="store_true", help="list the runs and stop")
    ap.add_argument("--report", action="store_true", help="analyse the finished runs only")
    ap.add_argument("--smoke", action="store_true", help="the tiny end-to-end check (runs/noise-smoke)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    plan = noise.load_plan(args.design)
    root, preset = noise.runs_root(plan), noise.design_of(plan)
    if args.smoke:
        plan = {**plan, **SMOKE}
        root, preset = noise.RUNS.parent / "noise-smoke", "smoke"
    if args.write_plan:
        path = plan_file(noise.design_of(plan))
        write_json(path, plan_doc(plan))
        print(f"wrote {path}")
        return 0
    cells = args.cells.split(",") if args.cells else None
    specs = noise.run_specs(plan, root, cells)
    if args.dry_run:
        for s in specs:
            print(s.label, " ".join(noise.run_overrides(plan, s.cell, s.arm, s.seed)))
        return 0
    t0 = time.perf_counter()
    if not args.report:
        run_stages(plan, root, cells, jobs=args.jobs, cache=root / "cache" if args.smoke else CACHE)
    report(plan, noise.run_specs(plan, root), preset, t0)
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
