"""Collapse reproduction: matched A/B arms from one SFT start under a stress setting.

Arms (``moe_rl.lab.arms.ARMS``): GRPO (clip 0.2 / 0.27), GRPO + R2, GRPO + R3, GSPO (clip
3e-4 / 4e-4), GSPO + R2. Every arm starts from the same SFT checkpoint; replicate ``s`` sets the
same ``train.seed`` (sampling) and ``task.seed`` (prompt order) in every arm, so arms differ only
in the ``algo`` section.

Stress setting: what the GSPO paper's mechanism says hurts token-level ratios most on an MoE:
several minibatch updates per rollout batch (M = 8: the later updates are off-policy, and the
routes of pi_theta have drifted from pi_old's), long responses (arithmetic with 3 to 7
operands, every step written out: about twice the demo's), and a deeper MoE than the demo's
(8 layers), at the demo's learning rate.

Collapse is decided by :func:`collapse_verdict`, with constants fixed in :data:`CRITERION`
before any run (both in ``moe_rl.lab.collapse``, shared with ``moe-rl demo``; see its
docstring): the trainer sentinel's rule (``moe_rl.trainer.sentinel.reward_drop``) over a
smoothed reward curve; a run the trainer stops (non-finite steps) counts as
collapsed too. Reported per arm: collapsed runs / runs, final and best reward, held-out accuracy,
clip fractions at both granularities, flip rates, the sequence log-ratio range; curves in a PNG.

    python -m studies.collapse.collapse --preset smoke|cpu-short|cpu|gpu [--jobs 2] [--arms GRPO,GSPO]
        [--set optim.lr=1e-3 ...] [--tag NAME]
    # a paper-scale recipe, unchanged (arms are overrides), each arm launched and waited for:
    python -m studies.collapse.collapse --recipe recipes/cluster/qwen3_30b_a3b_gspo.yaml --seeds 1 \\
        --launch "sbatch --wait --nodes=3 launch/slurm.sbatch"      # SGLANG_NODES=1 in the env
    python -m studies.collapse.collapse --recipe ... --dry-run             # print the arm commands
    python -m studies.collapse.collapse --recipe ... --report-only         # tabulate finished arm dirs

Writes studies/collapse/results/collapse-<machine>-<preset>-<commit>.json and .png.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

from moe_rl.argparsing import positive_int
from moe_rl.files import read_json
from moe_rl.lab.arms import ARMS, DEMO, ROOT, arm_overrides, flatten
from moe_rl.lab.collapse import CRITERION, collapse_verdict, criterion_doc, held_out_drop, smoothed
from moe_rl.lab.report import CLIPPED_OWN, PANELS, series
from moe_rl.lab.results import commit, machine, result_path, write_json
from moe_rl.lab.runner import (
    STATUS_FILE,
    arm_command,
    cpu_seconds,
    in_pool,
    local_launch,
    read_arm,
    read_status,
    resumable_run,
    stop_cleanly,
)
from moe_rl.lab.starts import CACHE, SMOKE_BASE, warm_start
from moe_rl.lab.stats import mean
from studies.collapse import RESULTS

log = logging.getLogger("studies.collapse.collapse")


# -- presets -------------------------------------------------------------------------------------
STRESS = {  # the demo policy (width 128, 8 experts top-2) at twice its depth, the demo's LR
    "model": {"num_layers": 8},
    "task": {"arithmetic": {"min_operands": 3, "max_operands": 7}},  # responses ~2x the demo's
    "optim": {"lr": 2e-4},
    "train": {
        "sft_steps": 500,
        "prompts_per_step": 8,
        "group_size": 8,
        "minibatches": 8,  # 8 updates per rollout batch (the demo: 4)
        "max_new_tokens": 64,
        "eval_every": 5,
        "eval_prompts": 64,
        "flip_probe_sequences": 8,
        "log_every": 100,
    },
}
PRESETS = {
    "smoke": {
        "base": {**SMOKE_BASE, "train": {**SMOKE_BASE["train"], "eval_prompts": 4}},
        "steps": 3,
        "seeds": 1,
    },
    "cpu-short": {"base": STRESS, "steps": 30, "seeds": 2},
    "cpu": {"base": STRESS, "steps": 80, "seeds": 3},
    "gpu": {
        "base": {
            "model": {
                "hidden_size": 256,
                "head_dim": 64,
                "moe_ffn_hidden_size": 256,
                "num_layers": 12,
                "num_experts": 16,
            },
            "task": {"arithmetic": {"min_operands": 3, "max_operands": 8}},
            "optim": {"lr": 3e-4},
            "train": {
                "sft_steps": 600,
                "sft_batch_size": 64,
                "prompts_per_step": 16,
                "group_size": 8,
                "minibatches": 8,
                "max_new_tokens": 80,
                "eval_every": 5,
                "eval_prompts": 128,
                "flip_probe_sequences": 16,
                "log_every": 100,
            },
        },
        "steps": 50,
        "seeds": 2,
    },
}


# -- analysis ------------------------------------------------------------------------------------
def _vals(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def analyse_run(arm: str, seed: int, status: dict) -> dict:
    """Verdict and summary numbers of one finished (or stopped) run."""
    from moe_rl.lab.report import summarize

    data = read_arm(status["out_dir"])
    rl = data["rl"]
    rewards = [r.get("reward/mean") for r in rl]
    evals = [(r["step"], r["eval/accuracy"]) for r in data["eval"] if r.get("eval/accuracy") is not None]
    v = collapse_verdict(rewards)
    clipped_own = (
        "clip/token_frac_of_clipped_seqs" if ARMS[arm]["algo"]["name"] == "gspo" else "clip/token_frac"
    )
    out = {
        "arm": arm,
        "seed": seed,
        **{k: status[k] for k in ("status", "reason", "wall_s", "cpu_s", "out_dir")},
        "verdict": asdict(v),
        "collapsed": v.collapsed or status["status"] != "done",
        "held_out_drop": held_out_drop([a for _, a in evals]),
        "reward": rewards,
        "eval": evals,
        "clip_token_own_granularity": mean(_vals(rl, clipped_own)),
        "clip_token_of_clipped_seqs": mean(_vals(rl, "clip/token_frac_of_clipped_seqs")),
        "seq_log_ratio_min": min(_vals(rl, "ratio/seq_log_sum_min"), default=math.nan),
        "seq_log_ratio_max": max(_vals(rl, "ratio/seq_log_sum_max"), default=math.nan),
        "token_ratio_outside_0.5_2": mean(_vals(rl, "ratio/token_frac_outside_0.5_2")),
        "entropy": mean(_vals(rl, "entropy/mean")),
        "grad_norm": mean(_vals(rl, "grad_norm")),
        "flip_rollout_token_any": mean(_vals(rl, "flip/rollout_vs_trainer/token_any")),
    }
    if rl:
        out["summary"] = summarize(f"{arm}-s{seed}", data)
    return out


ARM_KEYS = (
    "final_reward",
    "best_reward",
    "eval_start",
    "eval_end",
    "clip_token",
    "clip_seq",
    "clip_token_own_granularity",
    "clip_token_of_clipped_seqs",
    "flip_step",
    "flip_drift",
    "token_ratio_outside_0.5_2",
    "step_s",
)


def analyse_arms(runs: list[dict]) -> dict:
    """Per arm: collapsed / runs and the means over its runs."""
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        sm = [r.get("summary", {}) for r in rs]
        a = {
            "runs": len(rs),
            "collapsed": sum(r["collapsed"] for r in rs),
            "held_out_drop": sum(r["held_out_drop"] for r in rs),
            "states": [r["verdict"]["state"] for r in rs],
            "final_reward": mean(s.get("reward_last") for s in sm),
            "best_reward": mean(r["verdict"]["best"] for r in rs),
            "eval_start": mean(s.get("eval_start") for s in sm),
            "eval_end": mean(s.get("eval_end") for s in sm),
            "clip_token": mean(s.get("clip_token") for s in sm),
            "clip_seq": mean(s.get("clip_seq") for s in sm),
            "flip_step": mean(s.get("flip_step") for s in sm),
            "flip_drift": mean(s.get("flip_drift") for s in sm),
            "step_s": mean(s.get("step_s") for s in sm),
            "seq_log_ratio_min": min((r["seq_log_ratio_min"] for r in rs), default=math.nan),
            "seq_log_ratio_max": max((r["seq_log_ratio_max"] for r in rs), default=math.nan),
        }
        for k in ("clip_token_own_granularity", "clip_token_of_clipped_seqs", "token_ratio_outside_0.5_2"):
            a[k] = mean(r[k] for r in rs)
        out[arm] = a
    return out


def format_table(arms: dict) -> str:
    head = (
        f"{'arm':<9} {'collapsed':>9} {'acc-drop':>8} {'rew_best':>8} {'rew_end':>8} {'acc0':>6} {'acc_end':>7} "
        f"{'clip/tok':>9} {'clip/seq':>9} {'tok_in_clipseq':>14} {'flip/step':>9} {'flip/drift':>10} "
        f"{'seq log-ratio':>15} {'step_s':>6}"
    )
    lines = [head, "-" * len(head)]
    for name, a in arms.items():
        lines.append(
            f"{name:<9} {a['collapsed']:>4}/{a['runs']:<4} {a['held_out_drop']:>3}/{a['runs']:<4} "
            f"{a['best_reward']:>8.3f} {a['final_reward']:>8.3f} {a['eval_start']:>6.3f} {a['eval_end']:>7.3f} "
            f"{a['clip_token']:>9.5f} {a['clip_seq']:>9.4f} {a['clip_token_of_clipped_seqs']:>14.4f} "
            f"{a['flip_step']:>9.4f} {a['flip_drift']:>10.4f} "
            f"{a['seq_log_ratio_min']:>7.1f}..{a['seq_log_ratio_max']:<6.1f} {a['step_s']:>6.2f}"
        )
    return "\n".join(lines)


def observations(arms: dict) -> list[str]:
    """Plain statements the numbers support (no interpretation beyond them)."""
    out = [
        f"{n}: {a['collapsed']}/{a['runs']} collapsed ({', '.join(a['states'])}); best smoothed reward "
        f"{a['best_reward']:.3f}, last-5-step reward {a['final_reward']:.3f}; held-out accuracy "
        f"{a['eval_start']:.3f} -> {a['eval_end']:.3f}"
        for n, a in arms.items()
    ]
    g, s = arms.get("GRPO"), arms.get("GSPO")
    if g and s and g["clip_token"] > 0:
        out.append(
            f"clipped tokens, each at its own granularity: GSPO {100 * s['clip_token_own_granularity']:.2f}% "
            f"(tokens of clipped sequences) vs GRPO {100 * g['clip_token']:.3f}% (token ratio), "
            f"{s['clip_token_own_granularity'] / g['clip_token']:.0f}x (paper: ~15% vs 0.13%, ~100x)"
        )
    return out


# -- plot ----------------------------------------------------------------------------------------
CURVES = (
    "reward/mean",
    "eval/accuracy",
    "flip/step/rate",
    CLIPPED_OWN,
    "ratio/seq_log_sum_abs",
    "entropy/mean",
)
"The curves of every run (titles: :data:`moe_rl.lab.report.PANELS`; the reward smoothed as the criterion)."


def plot(runs: list[dict], out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    colors = {a: plt.get_cmap("tab10")(i) for i, a in enumerate(dict.fromkeys(r["arm"] for r in runs))}
    for ax, key in zip(axes.flat, CURVES):
        for r in runs:
            data = read_arm(r["out_dir"])
            gspo = ARMS[r["arm"]]["algo"]["name"] == "gspo"
            k = (
                key
                if key != CLIPPED_OWN
                else ("clip/token_frac_of_clipped_seqs" if gspo else "clip/token_frac")
            )
            xs, ys = series(data["eval"] if k == "eval/accuracy" else data["rl"], k)
            if k == "reward/mean" and len(ys) >= CRITERION.smooth:
                ys, xs = smoothed(ys, CRITERION.smooth), xs[CRITERION.smooth - 1 :]
            label = r["arm"] if r["seed"] == min(x["seed"] for x in runs if x["arm"] == r["arm"]) else None
            ax.plot(
                xs,
                ys,
                color=colors[r["arm"]],
                alpha=0.8,
                lw=1.2,
                ls="-" if r["seed"] % 2 == 0 else "--",
                label=label,
                marker="x" if r["collapsed"] and xs and k == "reward/mean" else None,
                markevery=[len(xs) - 1] if xs else None,
            )
        smooth = f"reward (trailing mean of {CRITERION.smooth} steps)"
        ax.set_title(smooth if key == "reward/mean" else PANELS[key], fontsize=10)
        ax.set_xlabel("RL step")
        if key == CLIPPED_OWN:
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("matched arms from one SFT start (line style = seed; x = collapsed by the fixed criterion)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


# -- driver --------------------------------------------------------------------------------------
def parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m studies.collapse.collapse", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--preset", default="cpu-short", choices=PRESETS)
    ap.add_argument(
        "--recipe", default=None, help="base recipe used unchanged (default: the demo + the preset)"
    )
    ap.add_argument(
        "--sft",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="warm-start every arm from one cached SFT run (default: on for presets, off for --recipe)",
    )
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument(
        "--seeds", type=positive_int, default=None, help="replicates per arm (default: the preset's)"
    )
    ap.add_argument(
        "--steps", type=positive_int, default=None, help="RL steps per run (default: the preset's / recipe's)"
    )
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every arm")
    ap.add_argument(
        "--launch",
        default=None,
        help="command prefix that runs 'RECIPE overrides' per arm (default: in this process)",
    )
    ap.add_argument(
        "--jobs", type=positive_int, default=1, help="arms at once (> 1 launches each in its own process)"
    )
    ap.add_argument(
        "--runs-dir", default=str(ROOT / "runs" / "collapse"), help="arm output directories go under here"
    )
    ap.add_argument("--cache", default=str(CACHE), help="SFT start cache directory")
    ap.add_argument(
        "--tag", default=None, help="name of this variant in the result file (default: the preset)"
    )
    ap.add_argument("--out", default=None, help="result JSON (default: the study's results/); PNG beside it")
    ap.add_argument("--dry-run", action="store_true", help="print the arm commands and stop")
    ap.add_argument("--report-only", action="store_true", help="analyse the arm directories already there")
    ap.add_argument("--replot", default=None, metavar="JSON", help="redraw the PNG of a result file")
    return ap.parse_args(argv)


def setting(args) -> tuple[str, dict]:
    """The result's name and what runs: base recipe, common overrides, arms, seeds, steps, SFT start."""
    p = PRESETS[args.preset]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}: use {', '.join(ARMS)}")
    return args.tag or (f"recipe-{Path(args.recipe).stem}" if args.recipe else args.preset), {
        "base": Path(args.recipe) if args.recipe else DEMO,
        "overrides": ([] if args.recipe else flatten(p["base"])) + list(args.set),
        "arms": arms,
        "seeds": args.seeds or (1 if args.recipe else p["seeds"]),
        "steps": args.steps or (None if args.recipe else p["steps"]),
        "sft": args.sft if args.sft is not None else not args.recipe,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.replot:
        doc = read_json(args.replot)
        plot(doc["runs"], Path(args.replot).with_suffix(".png"))
        return doc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    name, st = setting(args)
    base, common, launch = st["base"], st["overrides"], local_launch(args.launch, args.jobs)
    root = Path(args.runs_dir) / name
    plan = [
        (a, s, arm_overrides(a, s, st["steps"]), root / f"{a}-s{s}")
        for s in range(st["seeds"])
        for a in st["arms"]
    ]
    if args.dry_run:
        for _, _, ov, out in plan:
            print(arm_command(base, [*common, *ov], out, args.launch))
        return {}
    t0, c0 = time.perf_counter(), cpu_seconds()
    start, sft_info = None, None
    if st["sft"] and not args.report_only:
        start, sft_info = warm_start(base, common, cache=Path(args.cache), launch=args.launch)
        sft_info = {k: v for k, v in sft_info.items() if k != "signature"}

    def one(item):
        a, s, ov, out = item
        if args.report_only:  # only runs that finished: their status file says how
            st = read_status(out / STATUS_FILE) if (out / STATUS_FILE).exists() else None
            return None if st is None else {**st, "out_dir": str(out)}
        return resumable_run(f"{a} seed {s}", base, [*common, *ov], out, start=start, launch=launch)

    statuses = in_pool(one, plan, args.jobs)
    unfinished = [str(out) for (_, _, _, out), st in zip(plan, statuses) if st is None]
    if unfinished:
        log.warning("%d of %d runs have not finished (left out): %s", len(unfinished), len(plan), unfinished)
    runs = [analyse_run(a, s, st) for (a, s, _, _), st in zip(plan, statuses) if st is not None]
    arms_out = analyse_arms(runs)
    table = format_table(arms_out)
    path = result_path("collapse", name, args.out, folder=RESULTS)
    png = plot(runs, path.with_suffix(".png"))
    doc = {
        "bench": "collapse",
        "preset": name,
        "machine": machine(),
        "commit": commit(),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": cpu_seconds() - c0,
        "criterion": criterion_doc(),
        "runs_planned": len(plan),
        "runs_unfinished": unfinished,
        "setting": {**st, "base": str(base), "arms": {a: flatten(ARMS[a]) for a in st["arms"]}},
        "sft_start": sft_info,
        "arms": arms_out,
        "table": table,
        "observations": observations(arms_out),
        "runs": runs,
        "plot": png.name,
    }
    write_json(path, doc)
    print(table)
    print("\n".join(doc["observations"]))
    print(f"wrote {path} and {png} in {doc['wall_s']:.0f}s")
    return doc


if __name__ == "__main__":
    sys.exit(stop_cleanly(main))
