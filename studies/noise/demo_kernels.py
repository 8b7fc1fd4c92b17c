"""Issue 31, item 8: does ``make demo``'s conclusion hold under other CPU kernels?

``make demo`` (``moe-rl demo``: GRPO, GRPO + R2 and the chaos null, 3 seeds, 40 steps of design
(b)'s moe-dial30 cell: countdown, the router's learning rate x30, recipes/demo/dial_demo.yaml) run
once per ATen CPU kernel set (``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``, ``avx512``; the
machine's own is the last where it has AVX-512), each into its own folder. Per kernel set, per seed
and arm: the share of RL steps with a token ratio outside [0.5, 2] (the mechanism R2 removes,
:func:`studies.noise.design.outlier_steps`) and the held-out accuracy AUC (the outcome,
:func:`studies.noise.design.auc`); every arm's seed-paired difference to GRPO
(:func:`studies.noise.design.analyse`); the demo's two claims (:func:`mechanism`, :func:`within_noise`);
across kernel sets, whether they hold under each, and how far the kernels alone move one run.

The plan, predictions and rule are pre-registered by ``--write-plan`` into
studies/noise/results/demo_kernels-dial-preregistration.json, committed before the runs (the first
demo's, GRPO + R3 under routing noise, is ``demo_kernels-preregistration.json`` with its result
``demo_kernels-cpu2-x86_64-noise-demo-f26aa0b.json``).

    python -m studies.noise.demo_kernels --write-plan
    python -m studies.noise.demo_kernels [--caps default avx2 avx512]   # resumable (moe-rl compare)
    python -m studies.noise.demo_kernels --report                      # what finished

Runs: runs/demo-kernels-dial/<cap>/<arm>/s<seed>/. Result: studies/noise/results/demo_kernels-<machine>-
dial-demo-<commit>.json + .png, ``headline``: per kernel set the paired differences to GRPO (AUC and
outlier-step share) with 95% intervals and p, the chaos null's largest differences, the two claims;
whether they hold under every set; the kernels' own spread.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from moe_rl.files import read_json
from moe_rl.lab.arms import DEMO_ARMS, DEMO_SEEDS, arm_dir
from moe_rl.lab.demo import DEFAULT_RECIPE
from moe_rl.lab.report import load_arm
from moe_rl.lab.results import commit, machine, result_path, write_json
from moe_rl.lab.runner import STATUS_FILE
from moe_rl.lab.stats import mean, paired
from studies.noise import RESULTS
from studies.noise import design as noise

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "runs" / "demo-kernels-dial"
CAPS = ("default", "avx2", "avx512")
PLAN_FILE = RESULTS / "demo_kernels-dial-preregistration.json"
REF, ARM, NULL = DEMO_ARMS
"GRPO, the arm the demo is about (GRPO + R2) and the chaos null."
OUTLIERS = "ratio/steps_outside_0.5_2"
# as pre-registered (PLAN_FILE holds it, a test holds them equal): its text names the paths of the
# time (benchmarks/, moe_rl/lab/noise.py, recipes/demo/*.plan.yaml), now in studies/noise/
PLAN = {
    "recipe": DEFAULT_RECIPE,
    "arms": list(DEMO_ARMS),
    "seeds": DEMO_SEEDS,
    "caps": list(CAPS),
    "command": "ATEN_CPU_CAPABILITY=<cap> moe-rl demo --out runs/demo-kernels-dial/<cap> --jobs 2",
    "endpoints": {
        "mechanism": "per run, the share of RL steps with any token ratio to pi_old outside [0.5, 2] "
        "(moe_rl.lab.noise.outlier_steps); per seed, GRPO+R2's minus GRPO's",
        "outcome": "held-out accuracy AUC over the 40 steps (evaluations every 10 steps, 128 prompts), "
        "seed-paired difference to GRPO (moe_rl.lab.noise.analyse)",
    },
    "predictions": {
        "GRPO+R2": "mechanism: below GRPO in every seed (design (b), first 40 steps of its 100: GRPO "
        "0.46-0.71 of steps, R2 0.07-0.24, 6 of 6 seeds); outcome: within the chaos null (design (b), "
        "100 steps: R2 - GRPO AUC -0.31 points [-2.56, +1.94], n = 6)",
        "CHAOS": "mechanism and outcome both differ from GRPO by no more than chance (design (b), 40 "
        "steps: CHAOS 0.59-0.71 of steps; AUC spread sd 1.6 points over 100 steps)",
        "kernels": "the demo's runs equal across kernel sets or differ by about a chaos draw",
    },
    "rule": "Two claims, each read under every kernel set. (1) The mechanism: GRPO+R2's share of "
    "ratio-outlier steps is below GRPO's in every seed, each by more than the largest |CHAOS - GRPO| "
    "difference in that share over the seeds (what a no-op moves it). (2) The outcome: "
    "|mean(GRPO+R2 - GRPO)| held-out AUC is at most the larger of the largest |CHAOS - GRPO| AUC "
    "difference over the seeds and the kernel sets' own spread of GRPO's AUC. The README states a "
    "claim only if it holds under every kernel set. With 3 seeds the exact sign-flip p is at least "
    "0.25: the demo alone never claims a separation in accuracy.",
}


def _diffs(results: dict, cap: str, arm: str, value) -> list[float]:
    """Per seed both ran under ``cap``: ``value(arm's run) - value(GRPO's run)``."""
    return [
        value(results[(cap, arm, s)]) - value(results[(cap, REF, s)])
        for s in range(DEMO_SEEDS)
        if (cap, arm, s) in results and (cap, REF, s) in results
    ]


def _outliers(run: dict) -> float:
    return run["gauges"][OUTLIERS]


def mechanism(results: dict, cap: str) -> bool | None:
    """Claim (1) under ``cap``: GRPO+R2's outlier-step share below GRPO's in every seed, each by
    more than the largest |CHAOS - GRPO| in that share (None: a seed of an arm not measured)."""
    arm, null = _diffs(results, cap, ARM, _outliers), _diffs(results, cap, NULL, _outliers)
    if len(arm) < DEMO_SEEDS or len(null) < DEMO_SEEDS or any(map(math.isnan, arm + null)):
        return None
    floor = max(abs(d) for d in null)
    return all(d < -floor for d in arm)


def within_noise(results: dict, cap: str, kernel_range: float) -> bool | None:
    """Claim (2) under ``cap``: |mean(GRPO+R2 - GRPO)| AUC at most the larger of the largest
    |CHAOS - GRPO| AUC over the seeds and the kernel sets' spread of GRPO's AUC (None: not
    measured)."""
    arm, null = _diffs(results, cap, ARM, lambda r: r["auc"]), _diffs(results, cap, NULL, lambda r: r["auc"])
    if not arm or not null:
        return None
    floor = max(max(abs(d) for d in null), kernel_range if math.isfinite(kernel_range) else 0.0)
    return bool(abs(mean(arm)) <= floor)


def capability(cap: str) -> str:
    """The kernel set torch uses under ``ATEN_CPU_CAPABILITY=cap`` (asked of a fresh process)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def run_cap(cap: str, jobs: int) -> dict:
    """``moe-rl demo`` under ``cap`` into RUNS/cap (resumable: finished runs are skipped)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    cmd = [sys.executable, "-m", "moe_rl.cli", "demo", "--out", str(RUNS / cap), "--jobs", str(jobs)]
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    return {"returncode": rc, "wall_s": time.perf_counter() - t0}


def collect(caps: list[str]) -> dict[tuple[str, str, int], dict]:
    """(cap, arm, seed) -> :func:`studies.noise.design.summarize_run` of every finished run."""
    out = {}
    for cap in caps:
        for arm in DEMO_ARMS:
            for seed in range(DEMO_SEEDS):
                d = RUNS / cap / arm_dir(arm) / f"s{seed}"
                if (d / STATUS_FILE).exists():
                    out[(cap, arm, seed)] = noise.summarize_run(load_arm(d))
    return out


def kernel_spread(results: dict, caps: list[str]) -> dict:
    """Per arm: the mean over seeds of the range of a run's AUC across kernel sets (the same arm,
    seed and start; only the kernels differ)."""
    out = {}
    for arm in DEMO_ARMS:
        ranges = []
        for seed in range(DEMO_SEEDS):
            aucs = [results[(c, arm, seed)]["auc"] for c in caps if (c, arm, seed) in results]
            if len(aucs) == len(caps) and len(caps) > 1:
                ranges.append(max(aucs) - min(aucs))
        out[arm] = {"mean_range": mean(ranges) if ranges else math.nan, "n": len(ranges)}
    return out


def report(caps: list[str], walls: dict) -> Path:
    results = collect(caps)
    analysis = noise.analyse({"cells": {c: [] for c in caps}}, results)
    cells = analysis["cells"]
    spread = kernel_spread(results, caps)
    mech = {c: mechanism(results, c) for c in caps}
    within = {c: within_noise(results, c, spread[REF]["mean_range"]) for c in caps}

    def per_seed(c: str, arm: str) -> dict:
        return {
            "outlier_steps": {
                s: results[(c, arm, s)]["gauges"][OUTLIERS]
                for s in range(DEMO_SEEDS)
                if (c, arm, s) in results
            },
            "auc": {s: results[(c, arm, s)]["auc"] for s in range(DEMO_SEEDS) if (c, arm, s) in results},
        }

    head = {
        "per_kernel_set": {
            c: {
                "capability": walls.get(c, {}).get("capability"),
                "wall_s": walls.get(c, {}).get("wall_s"),
                "grpo_auc": cells.get(c, {}).get("arms", {}).get(REF, {}).get("auc_mean"),
                **{
                    f"{arm}_minus_GRPO_auc": cells.get(c, {}).get("arms", {}).get(arm, {}).get("auc_diff")
                    for arm in DEMO_ARMS[1:]
                },
                **{
                    f"{arm}_minus_GRPO_outlier_steps": paired(_diffs(results, c, arm, _outliers))
                    for arm in DEMO_ARMS[1:]
                },
                "per_seed": {arm: per_seed(c, arm) for arm in DEMO_ARMS},
                "chaos_spread_auc": cells.get(c, {}).get("chaos_spread"),
                "mechanism": mech[c],
                "within_noise": within[c],
            }
            for c in caps
        },
        "mechanism_holds_across_kernels": all(mech.values()) if None not in mech.values() else None,
        "outcome_within_noise_across_kernels": all(within.values()) if None not in within.values() else None,
        "kernel_spread_auc": spread,
        "runs_finished": len(results),
        "runs_planned": len(caps) * len(DEMO_ARMS) * DEMO_SEEDS,
    }
    doc = {
        "bench": "demo_kernels",
        "machine": machine(),
        "commit": commit(),
        "headline": head,
        "plan": PLAN,
        "cells": cells,
        "runs": {
            f"{c}/{a}/s{s}": {k: v for k, v in r.items() if k != "evals"} for (c, a, s), r in results.items()
        },
        "evals": {f"{c}/{a}/s{s}": r["evals"] for (c, a, s), r in results.items()},
    }
    path = result_path("demo_kernels", "dial-demo", folder=RESULTS)
    write_json(path, doc)
    plot(doc, caps, path.with_suffix(".png"))
    return path


def plot(doc: dict, caps: list[str], path: Path) -> None:
    """Per kernel set: every run's held-out accuracy over steps (top) and every run's share of
    ratio-outlier steps by arm (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(caps), figsize=(4.4 * len(caps), 7.0), sharey="row", squeeze=False)
    colors = dict(zip(DEMO_ARMS, ("tab:blue", "tab:orange", "tab:gray")))
    for j, cap in enumerate(caps):
        top, bottom = axes[0][j], axes[1][j]
        for key, evals in doc["evals"].items():
            c, arm, _ = key.split("/")
            if c == cap and evals:
                xs, ys = zip(*evals)
                top.plot(xs, ys, color=colors.get(arm, "k"), alpha=0.7, lw=1.2, label=arm)
        h = doc["headline"]["per_kernel_set"][cap]
        d = h.get(f"{ARM}_minus_GRPO_auc") or {}
        lo, hi = d.get("ci95", [math.nan, math.nan])
        ci = f"{100 * d['mean']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]" if d.get("n") else "n/a"
        top.set_title(f"ATEN_CPU_CAPABILITY={cap}\n{ARM} - GRPO AUC (points): {ci}", fontsize=9)
        top.set_xlabel("RL step")
        handles, labels = top.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        top.legend(uniq.values(), uniq.keys(), fontsize=8, loc="lower left")
        for i, arm in enumerate(DEMO_ARMS):
            vals = list(h["per_seed"][arm]["outlier_steps"].values())
            bottom.scatter([i] * len(vals), vals, color=colors[arm], s=30, zorder=3)
        bottom.set_xticks(range(len(DEMO_ARMS)), DEMO_ARMS, fontsize=8)
        bottom.set_title(
            f"mechanism claim: {h['mechanism']}; outcome within noise: {h['within_noise']}", fontsize=9
        )
        bottom.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy")
    axes[1][0].set_ylabel("share of steps with a token\nratio outside [0.5, 2] (per seed)")
    hd = doc["headline"]
    fig.suptitle(
        f"make demo under CPU kernel sets ({doc['machine']}, {doc['commit']}): mechanism under every set "
        f"= {hd['mechanism_holds_across_kernels']}, outcome within noise under every set = "
        f"{hd['outcome_within_noise_across_kernels']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kernel_check_args(doc: str, caps: tuple, default: list, argv) -> argparse.Namespace:
    """The command line of a kernel check: ``--caps``, ``--jobs``, ``--write-plan``, ``--report``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", nargs="+", default=list(default), choices=caps)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write-plan", action="store_true", help="write the pre-registration and stop")
    ap.add_argument("--report", action="store_true", help="only report what finished")
    return ap.parse_args(argv)


def write_plan(path: Path, bench: str, plan: dict) -> None:
    """A kernel check's pre-registration: its plan, at this commit."""
    write_json(path, {"bench": bench, "commit": commit(), "headline": {"caps": plan["caps"]}, "plan": plan})
    print(f"wrote {path}")


def run_caps(caps: list[str], walls_file: Path, run_one) -> dict:
    """Each kernel set in turn (``run_one(cap)`` -> exit status, resumable), after checking that
    torch runs it on this machine; the wall time of a whole, uninterrupted run is recorded once per
    set into ``walls_file``. A run that fails ends the command (rerunning it continues). Returns
    the recorded walls (with no ``caps``: those recorded so far)."""
    walls = read_json(walls_file) if walls_file.exists() else {}
    for cap in caps:
        got = capability(cap)
        if got.lower() != cap.lower():
            sys.exit(f"--caps {cap}: torch runs {got!r} under ATEN_CPU_CAPABILITY={cap} on this machine")
        t0 = time.perf_counter()
        rc = run_one(cap)
        if rc:
            sys.exit(f"the check under {cap} ended with {rc}: rerun the same command to continue")
        if cap not in walls:
            walls[cap] = {"capability": got, "wall_s": time.perf_counter() - t0}
            walls_file.parent.mkdir(parents=True, exist_ok=True)
            write_json(walls_file, walls)
    return walls


def main(argv=None) -> None:
    args = kernel_check_args(__doc__, CAPS, CAPS, argv)
    if args.write_plan:
        write_plan(PLAN_FILE, "demo_kernels", PLAN)
        return
    caps = [] if args.report else args.caps  # --report: the walls recorded, nothing run
    walls = run_caps(caps, RUNS / "walls.json", lambda cap: run_cap(cap, args.jobs)["returncode"])
    print(f"wrote {report(args.caps, walls)}")


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
