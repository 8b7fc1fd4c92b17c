"""Issue 31, item 8: does ``make demo``'s conclusion hold under other CPU kernels?

``make demo`` (``moe-rl demo``: GRPO, GRPO + R3 and the chaos null, 3 seeds, 40 steps of the noise
design's moe-noise cell, recipes/demo/noise_demo.yaml) run once per ATen CPU kernel set
(``ATEN_CPU_CAPABILITY``: ``default``, ``avx2``, ``avx512``; the machine's own is the last
where it has AVX-512), each into its own folder. Per kernel set, every arm's seed-paired
difference to GRPO in held-out accuracy AUC (:func:`moe_rl.lab.noise.analyse`, the design's own
analysis) and the design's verdict (:func:`moe_rl.lab.noise.separates`); across kernel sets,
whether the verdicts agree, and how far the kernels alone move one run (per arm and seed, the
range of its AUC across kernel sets) against the chaos null's spread.

The plan, predictions and rule are pre-registered by ``--write-plan`` into
benchmarks/results/demo_kernels-preregistration.json, committed before the runs.

    python -m benchmarks.demo_kernels --write-plan
    python -m benchmarks.demo_kernels [--caps default avx2 avx512]   # resumable (moe-rl compare)
    python -m benchmarks.demo_kernels --report                      # what finished

Runs: runs/demo-kernels/<cap>/<arm>/s<seed>/. Result: benchmarks/results/demo_kernels-<machine>-<commit>
.json + .png, ``headline``: per kernel set the paired AUC differences to GRPO with 95% intervals
and p, the chaos spread and the verdict; whether they agree; the kernels' own spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, commit, machine, result_path
from moe_rl.lab import noise
from moe_rl.lab.arms import DEMO_ARMS, DEMO_SEEDS, arm_dir
from moe_rl.lab.demo import DEFAULT_RECIPE
from moe_rl.lab.report import load_arm
from moe_rl.lab.results import write_json
from moe_rl.lab.runner import STATUS_FILE
from moe_rl.lab.stats import mean

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "demo-kernels"
CAPS = ("default", "avx2", "avx512")
PLAN_FILE = RESULTS / "demo_kernels-preregistration.json"
PLAN = {
    "recipe": DEFAULT_RECIPE,
    "arms": list(DEMO_ARMS),
    "seeds": DEMO_SEEDS,
    "caps": list(CAPS),
    "command": "ATEN_CPU_CAPABILITY=<cap> moe-rl demo --out runs/demo-kernels/<cap> --jobs 2",
    "endpoint": "held-out accuracy AUC over the 40 steps (evaluations every 10 steps, 128 prompts), "
    "seed-paired difference to GRPO (moe_rl.lab.noise.analyse)",
    "predictions": {
        "GRPO+R3": "not separated from GRPO under any kernel set: the noise design's 100-step cell "
        "measured +0.27 AUC points [-0.13, +0.68] (n = 6), and the demo is shorter with fewer seeds",
        "CHAOS": "differs from GRPO by about the kernel sets' own spread (both are numerical no-ops)",
        "kernels": "a run's AUC moves across kernel sets by an amount of the order of the chaos "
        "null's difference to GRPO: another CPU's kernels are another chaos draw",
    },
    "rule": "the demo's claim, 'GRPO + R3 is not separated from GRPO beyond numerical chaos', holds "
    "under a kernel set when |mean(GRPO+R3 - GRPO)| AUC is at most the larger of |mean(CHAOS - GRPO)| "
    "and the kernel sets' own spread of GRPO's AUC (within_noise); it holds across kernels when it "
    "holds under every kernel set. The design's own verdict (noise.separates: positive, p < 0.05, "
    "above the chaos spread) is reported too, but with 3 seeds the exact sign-flip p is at least "
    "0.25, so the demo alone can never claim a separation. The README states the demo's claim only "
    "if it holds across kernels",
}


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
    """(cap, arm, seed) -> :func:`moe_rl.lab.noise.summarize_run` of every finished run."""
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


def within_noise(cell: dict | None, kernel_range: float) -> bool | None:
    """The pre-registered claim under one kernel set: |mean(GRPO+R3 - GRPO)| AUC at most the larger
    of |mean(CHAOS - GRPO)| and the kernel sets' spread of GRPO's AUC (None: not measured)."""
    arms = (cell or {}).get("arms", {})
    r3, chaos = arms.get("GRPO+R3", {}).get("auc_diff"), arms.get("CHAOS", {}).get("auc_diff")
    if not r3 or not chaos or not r3["n"] or not chaos["n"]:
        return None
    floor = max(abs(chaos["mean"]), kernel_range if math.isfinite(kernel_range) else 0.0)
    return bool(abs(r3["mean"]) <= floor)


def report(caps: list[str], walls: dict) -> Path:
    results = collect(caps)
    analysis = noise.analyse({"cells": {c: [] for c in caps}}, results)
    cells = analysis["cells"]
    verdicts = {c: noise.separates(cells.get(c)) for c in caps}
    decided = [v for v in verdicts.values() if v is not None]
    spread = kernel_spread(results, caps)
    within = {c: within_noise(cells.get(c), spread["GRPO"]["mean_range"]) for c in caps}
    head = {
        "per_kernel_set": {
            c: {
                "capability": walls.get(c, {}).get("capability"),
                "wall_s": walls.get(c, {}).get("wall_s"),
                "grpo_auc": cells.get(c, {}).get("arms", {}).get("GRPO", {}).get("auc_mean"),
                **{
                    f"{arm}_minus_GRPO_auc": cells.get(c, {}).get("arms", {}).get(arm, {}).get("auc_diff")
                    for arm in DEMO_ARMS[1:]
                },
                "chaos_spread": cells.get(c, {}).get("chaos_spread"),
                "r3_separates": verdicts[c],
                "within_noise": within[c],
            }
            for c in caps
        },
        "verdicts_agree": (len(set(decided)) == 1) if len(decided) == len(caps) else None,
        "claim_holds_across_kernels": all(within.values()) if None not in within.values() else None,
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
    path = result_path("demo_kernels", "noise-demo")
    write_json(path, doc)
    plot(doc, caps, path.with_suffix(".png"))
    return path


def plot(doc: dict, caps: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(caps), figsize=(4.2 * len(caps), 3.6), sharey=True, squeeze=False)
    colors = {"GRPO": "tab:blue", "GRPO+R3": "tab:orange", "CHAOS": "tab:gray"}
    for ax, cap in zip(axes[0], caps):
        for key, evals in doc["evals"].items():
            c, arm, _ = key.split("/")
            if c == cap and evals:
                xs, ys = zip(*evals)
                ax.plot(xs, ys, color=colors.get(arm, "k"), alpha=0.7, lw=1.2, label=arm)
        h = doc["headline"]["per_kernel_set"][cap]
        d = h.get("GRPO+R3_minus_GRPO_auc") or {}
        lo, hi = d.get("ci95", [math.nan, math.nan])
        ci = f"{100 * d['mean']:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]" if d.get("n") else "n/a"
        ax.set_title(f"ATEN_CPU_CAPABILITY={cap}\nR3 - GRPO AUC (points): {ci}", fontsize=9)
        ax.set_xlabel("RL step")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="lower left")
    axes[0][0].set_ylabel("held-out accuracy")
    fig.suptitle(
        f"make demo under CPU kernel sets ({doc['machine']}, {doc['commit']}): R3 within numerical "
        f"noise under every set = {doc['headline']['claim_holds_across_kernels']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", nargs="+", default=list(CAPS), choices=CAPS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write-plan", action="store_true", help="write the pre-registration and stop")
    ap.add_argument("--report", action="store_true", help="only report what finished")
    args = ap.parse_args(argv)
    if args.write_plan:
        write_json(PLAN_FILE, {"bench": "demo_kernels", "commit": commit(), "headline": {"caps": PLAN["caps"]},
                               "plan": PLAN})  # fmt: skip
        print(f"wrote {PLAN_FILE}")
        return
    walls_file = RUNS / "walls.json"
    walls = json.loads(walls_file.read_text()) if walls_file.exists() else {}
    if not args.report:
        for cap in args.caps:
            got = capability(cap)
            res = run_cap(cap, args.jobs)
            if res["returncode"] == 0 and cap not in walls:  # the wall time of a whole, uninterrupted demo
                walls[cap] = {"capability": got, "wall_s": res["wall_s"]}
                walls_file.parent.mkdir(parents=True, exist_ok=True)
                write_json(walls_file, walls)
            elif res["returncode"] != 0:
                sys.exit(f"the demo under {cap} ended with {res['returncode']}: rerun to continue")
    print(f"wrote {report(args.caps, walls)}")


if __name__ == "__main__":
    main()
