"""CPU seconds per phase of whole RL steps, and a change measured paired against another commit.

``--rl MODEL`` (tiny, small, or micro: the smoke preset's stand-in) measures whole RL
steps of benchmarks/throughput.py's cpu preset in this one process (1 thread by default): the
trainer's own ``rl_step`` on that model, GSPO under routing none, R2 and R3 interleaved at the
same step indices, CPU seconds per phase (rollout, old_logprob, train, probe, sync, step) as min
and median over ``--repeats`` steps after one warm-up, the probe's share of the step and the
replay overheads. CPU seconds, not wall: the figures to compare before/after a change on a
shared machine (the min is the least disturbed step):

    python -m benchmarks.step_time --rl small [--repeats 3] [--out path.json]

Writes benchmarks/results/step_time-<machine>-rl-<model>-<commit>.json.

``--against REV`` measures a change by its mechanism, paired: this checkout's RL steps against
commit REV's (a git worktree of it), ``--pairs`` pairs of fresh processes, each side's run the
``--rl`` measurement above, the side that runs first alternating from pair to pair. Per pair, the
ratio (this / REV) of each phase's median CPU seconds; the result holds every pair's ratios and
their median [lowest, highest] (for 4 pairs an 88% interval for the median; 6 pairs 97%). Each
finished run is kept as it completes (``--work``, a folder named by both commits under the
system's temp folder by default): a rerun resumes.

    python -m benchmarks.step_time --rl tiny --against 0126d68 --pairs 4

Writes benchmarks/results/step_time-<machine>-rl-<model>-vs-<rev>-<commit>.json and its PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import positive_int
from moe_rl.lab.results import write_json

ROOT = Path(__file__).resolve().parents[1]


RL_COMBOS = (("gspo", "none"), ("gspo", "r2"), ("gspo", "r3"))
RL_PHASES = ("rollout", "old_logprob", "train", "probe", "sync", "step")


def rl_steps(model: str, repeats: int, threads: int) -> dict:
    """CPU seconds per phase of RL steps of the throughput cpu preset (``model``: tiny, small, or
    micro, the smoke preset's small stand-in with its settings), every combo of ``RL_COMBOS``
    interleaved at the same step indices after one warm-up step each."""
    import torch

    from benchmarks.throughput import MICRO, MODELS, PRESETS, PeakMemory, bench_step, build_recipe, combo_run
    from moe_rl.trainer.context import Run

    torch.set_num_threads(threads)
    dims, preset = (MICRO["small"], "smoke") if model == "micro" else (MODELS[model], "cpu")
    recipe = build_recipe(dims, PRESETS[preset]["train"])
    cpu: dict[str, dict[str, list[float]]] = {f"{a}/{r}": {p: [] for p in RL_PHASES} for a, r in RL_COMBOS}
    run = Run(recipe)
    try:
        run.make_optimizer("rl")
        run.ensure_engine()
        mem = PeakMemory(run.info.device)
        for rep in range(1 + repeats):
            for algo, routing in RL_COMBOS:
                rec = bench_step(combo_run(run, algo, routing, "recompute"), rep, mem)
                for p in RL_PHASES if rep else ():
                    cpu[f"{algo}/{routing}"][p].append(rec[p]["cpu_s"])
    finally:
        run.close()
    return summarize_rl(cpu, model, preset, repeats, threads)


def summarize_rl(cpu: dict[str, dict[str, list[float]]], model: str, preset: str, repeats: int, threads: int):
    """Min and median CPU seconds per phase, the probe's share and the replay overheads (of both,
    and paired per step)."""
    from benchmarks.throughput_report import paired_probe_fracs, paired_replay_overheads

    combos = {
        name: {p: {"min": min(v), "median": statistics.median(v)} for p, v in phases.items()}
        for name, phases in cpu.items()
    }
    base = combos["gspo/none"]["step"]
    out = {"model": model, "settings": preset, "threads": threads, "timed_steps": repeats, "combos": combos}
    for stat in ("min", "median"):
        out[f"probe_frac_{stat}"] = combos["gspo/none"]["probe"][stat] / base[stat]
        out[f"replay_overhead_{stat}"] = {
            r: combos[f"gspo/{r}"]["step"][stat] / base[stat] - 1 for r in ("r2", "r3")
        }
    none = cpu["gspo/none"]
    out["probe_frac_paired"] = statistics.median(paired_probe_fracs(none))
    out["replay_overhead_paired"] = {
        r: statistics.median(paired_replay_overheads(none, cpu[f"gspo/{r}"], r)) for r in ("r2", "r3")
    }
    out["cpu_s_per_step"] = cpu
    return {"headline": rl_headline(out), **out}


def rl_headline(res: dict) -> dict:
    """The figures issue 17 names, from :func:`summarize_rl`'s result: the probe's share of the
    step and the replay overheads, each the median over the timed steps of a per-step figure paired
    at the same step index (``benchmarks.throughput_report.paired_*``; ratios of the phases' min
    and median beside them), and the step's CPU seconds under routing none (min)."""
    return {
        "probe_frac": res["probe_frac_paired"],
        "probe_frac_of_min": res["probe_frac_min"],
        "replay_overhead": res["replay_overhead_paired"],
        "replay_overhead_of_min": res["replay_overhead_min"],
        "replay_overhead_of_median": res["replay_overhead_median"],
        "step_cpu_s": res["combos"]["gspo/none"]["step"]["min"],
        "measure": "CPU seconds at 1 thread, combos interleaved at the same steps, paired per step",
    }


SIDES = ("rev", "here")


def paired_runs(work: Path, pairs: int, run) -> dict[str, list[dict]]:
    """Every side's ``--rl`` result of pairs 1..``pairs``: ``work/<side>-<i>.json``, made by
    ``run(side, path)`` where missing (each kept as it completes, so a rerun resumes), REV first in
    odd pairs (:func:`benchmarks.common.round_order`)."""
    from benchmarks.common import round_order

    for i in range(1, pairs + 1):
        for side in round_order(SIDES, i - 1):
            path = work / f"{side}-{i}.json"
            if not path.exists():
                run(side, path)
    return {
        side: [json.loads((work / f"{side}-{i}.json").read_text()) for i in range(1, pairs + 1)]
        for side in SIDES
    }


def paired_ratios(runs: dict[str, list[dict]]) -> dict:
    """Per combo and phase: each pair's ratio of median CPU seconds (this checkout / REV), and
    their median [lowest, highest]."""
    out = {}
    for combo in runs["here"][0]["combos"]:
        out[combo] = {}
        for phase in RL_PHASES:
            if phase == "sync":  # a version bump: microseconds, no figure
                continue
            ratios = [
                here["combos"][combo][phase]["median"] / rev["combos"][combo][phase]["median"]
                for here, rev in zip(runs["here"], runs["rev"])
            ]
            out[combo][phase] = {
                "median": statistics.median(ratios),
                "range": [min(ratios), max(ratios)],
                "pairs": ratios,
            }
    return out


def rl_against(model: str, rev: str, pairs: int, repeats: int, threads: int, work: str | None) -> dict:
    """The paired A/B of ``--against`` (module docstring)."""
    from benchmarks.common import commit

    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = commit()
    folder = (
        Path(work) if work else Path(tempfile.gettempdir()) / "moe_rl_step_ab" / f"{model}-{here}-vs-{sha}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    tree = folder / "tree"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(threads)}

    def run(side: str, path: Path) -> None:
        if side == "rev" and not (tree / ".git").exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT, check=True)
        flags = ["--rl", model, "--repeats", str(repeats), "--threads", str(threads), "--out", str(path)]
        print(f"[step_time] {side} ({sha if side == 'rev' else here}) -> {path.name}", flush=True)
        cmd = [sys.executable, "-m", "benchmarks.step_time", *flags]
        subprocess.run(
            cmd, cwd=tree if side == "rev" else ROOT, check=True, env=env, stdout=subprocess.DEVNULL
        )

    try:
        runs = paired_runs(folder, pairs, run)
    finally:
        if (tree / ".git").exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    ratios = paired_ratios(runs)
    none = ratios["gspo/none"]
    headline = {f"{p}_ratio": none[p]["median"] for p in none}
    headline.update({f"{p}_ratio_range": none[p]["range"] for p in none})
    headline.update(
        pairs=pairs,
        against=sha,
        measure=f"CPU seconds of gspo/none's phases at {threads} thread(s), this checkout / {sha}: median "
        "over pairs of fresh processes of the ratio of each run's median step",
    )
    return {
        "headline": headline,
        "model": model,
        "against": sha,
        "commit": here,
        "pairs": pairs,
        "repeats": repeats,
        "threads": threads,
        "ratios": ratios,
        "runs": {side: [r["combos"] for r in rs] for side, rs in runs.items()},
    }


def plot_against(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = list(res["ratios"])
    phases = list(res["ratios"][combos[0]])
    fig, ax = plt.subplots(figsize=(1.6 * len(phases) + 2, 3.4))
    width = 0.8 / len(combos)
    for j, combo in enumerate(combos):
        med = [res["ratios"][combo][p]["median"] for p in phases]
        lo = [m - res["ratios"][combo][p]["range"][0] for m, p in zip(med, phases)]
        hi = [res["ratios"][combo][p]["range"][1] - m for m, p in zip(med, phases)]
        xs = [i + (j - (len(combos) - 1) / 2) * width for i in range(len(phases))]
        ax.bar(xs, [m - 1 for m in med], width, bottom=1, yerr=[lo, hi], capsize=3, label=combo)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(phases)), phases)
    ax.set_ylabel(f"CPU s, {res['commit']} / {res['against']}")
    ax.set_title(f"{res['model']}: median [range] of {res['pairs']} paired runs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    from benchmarks.common import result_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per process")
    ap.add_argument(
        "--rl",
        required=True,
        choices=("micro", "tiny", "small"),
        help="whole RL steps of this model, per phase",
    )
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed RL steps per combo")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    ap.add_argument("--against", metavar="REV", help="this checkout against commit REV, paired")
    ap.add_argument("--pairs", type=positive_int, default=4, help="--against: pairs of runs")
    ap.add_argument("--work", default=None, help="--against: folder of the finished runs (resumes)")
    a = ap.parse_args(argv)
    if a.against:
        res = rl_against(a.rl, a.against, a.pairs, a.repeats, a.threads, a.work)
        path = result_path("step_time", f"rl-{a.rl}-vs-{res['against']}", a.out)
        write_json(path, res)
        plot_against(res, path.with_suffix(".png"))
        for combo, phases in res["ratios"].items():
            print(
                combo,
                " ".join(
                    f"{p}={v['median']:.3f} [{v['range'][0]:.3f}, {v['range'][1]:.3f}]"
                    for p, v in phases.items()
                ),
            )
        return res
    res = rl_steps(a.rl, a.repeats, a.threads)
    path = result_path("step_time", f"rl-{a.rl}", a.out)
    write_json(path, res)
    for name, phases in res["combos"].items():
        print(name, " ".join(f"{p}={v['min']:.3f}/{v['median']:.3f}" for p, v in phases.items()))
    print("probe_frac (min/median)", f"{res['probe_frac_min']:.4f}/{res['probe_frac_median']:.4f}")
    print("replay_overhead min", res["replay_overhead_min"], "median", res["replay_overhead_median"])
    return res


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
