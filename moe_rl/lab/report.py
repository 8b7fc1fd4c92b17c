"""Side-by-side report of RL runs: a PNG of the curves and a table on the terminal."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from moe_rl.errors import DataError, PathError
from moe_rl.lab.results import csv_text, write_text
from moe_rl.trainer.metrics import complete_lines, newest_run

ROLLOUT_FLIP = "flip/rollout_vs_trainer/rate"
CLIPPED_OWN = "clipped_own"
"""A panel key: the clipped tokens at each arm's own granularity (``clip/token_frac``, or for a
sequence-level loss ``clip/token_frac_of_clipped_seqs``)."""
PANELS: dict[str, str] = {
    "reward/mean": "reward (mean)",
    "eval/accuracy": "held-out greedy accuracy",
    "flip/step/rate": "expert flip rate per optimizer step",
    "clip/token_frac": "clipped token fraction",
    "clip/seq_frac": "clipped sequence fraction",
    "ratio/seq_log_sum_abs": "max |sequence log-ratio|",
    "mismatch/k3": "train-inference mismatch (k3 KL, pi_roll || pi_old)",
    ROLLOUT_FLIP: "rollout-vs-trainer expert flip rate",
    CLIPPED_OWN: "clipped tokens (GRPO: token ratio; GSPO: tokens of clipped seqs)",
    "entropy/mean": "token entropy",
    "experts/load_imbalance": "expert load imbalance (max / mean tokens per expert, mean of layers)",
    "experts/dead_frac": "dead experts (share of layer x expert pairs with no token)",
    "experts/router_entropy": "router entropy (nats, softmax over the experts)",
}
"""The title of every curve a report draws, by metric key: :func:`plot` draws :data:`DETAIL_PANELS`
(and :data:`EXPERT_PANELS` where logged), ``studies/collapse/collapse.py`` its runs' curves."""
DETAIL_PANELS = tuple(PANELS)[:8]
"The panels of ``report-detail.png`` (``moe-rl report``): every metric the arms compare on."
EXPERT_PANELS = ("experts/load_imbalance", "experts/dead_frac", "experts/router_entropy")
"Expert load panels (docs/algorithms.md#expert-load): drawn after :data:`DETAIL_PANELS` only when an arm logged them."


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of metric ``key`` over metrics rows (rows without it are left out);
    ``ratio/seq_log_sum_abs`` is the larger of ``|ratio/seq_log_sum_min|`` and ``|..._max|``."""
    xs, ys = [], []
    for r in rows:
        if key == "ratio/seq_log_sum_abs":
            v = max(abs(r.get("ratio/seq_log_sum_min") or 0), abs(r.get("ratio/seq_log_sum_max") or 0))
        else:
            v = r.get(key)
        if v is not None:
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def read_run_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``; a missing folder or file, or a bad line, is a user error
    naming the path (and line). A last row a crash left half-written is skipped (a killed run reads)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PathError(f"run folder {run_dir} does not exist: give a run's train.out_dir")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PathError(f"{run_dir} has no metrics.jsonl: give a run's train.out_dir (one that has trained)")

    rows = []
    for lineno, raw in enumerate(complete_lines(path.read_bytes()), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}:{lineno}: not a JSON metrics row ({type(e).__name__})") from e
        if not isinstance(row, dict) or "stage" not in row or "step" not in row:
            raise DataError(f"{path}:{lineno}: a metrics row needs 'stage' and 'step'")
        if isinstance(row["step"], bool) or not isinstance(row["step"], int):
            raise DataError(f"{path}:{lineno}: 'step' is {row['step']!r}, not a whole number")
        rows.append(row)
    return rows


def load_arm(run_dir: str | Path) -> dict:
    """The newest run's RL and evaluation rows in ``run_dir`` (an earlier run in a folder reused with
    ``--fresh`` is not mixed in); ``dropped``: ``{metric: count}`` of values that are no number
    (left out), ``stages``: the stages its rows hold."""
    rows = newest_run(read_run_metrics(run_dir))
    dropped = numbers_only(rows)
    rl = [r for r in rows if r["stage"] == "rl"]
    return {
        "rl": rl,
        "eval": eval_rows(rows),
        "dropped": dropped,
        "stages": sorted({str(r["stage"]) for r in rows}),
    }


NOT_METRICS = frozenset({"stage", "step", "run", "attempt"})
"Row keys that are no metric (the rest are numbers or null as the trainer writes them)."


def numbers_only(rows: list[dict]) -> dict[str, int]:
    """Remove from ``rows`` (in place) every metric value that is no finite-or-null number (a
    string, a list, true/false: a hand-edited or foreign file) and a ``step`` that is no whole
    number's row; ``{metric: count}`` of what was removed."""
    dropped: dict[str, int] = {}
    for r in rows:
        for k in [k for k in r if k not in NOT_METRICS]:
            v = r[k]
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                del r[k]
                dropped[k] = dropped.get(k, 0) + 1
    return dropped


def unplotted(name: str, arm: dict) -> list[str]:
    """What :func:`report` cannot draw of run ``name``, and why (one sentence each)."""
    notes = [
        f"{name}: {n} value(s) of {k} are no number: left out"
        for k, n in sorted(arm.get("dropped", {}).items())
    ]
    if not arm.get("stages"):
        notes.append(f"{name}: not plotted: its metrics.jsonl holds no rows (a run that wrote none yet)")
    elif not arm["rl"] and not arm["eval"]:
        stages = ", ".join(arm["stages"])
        notes.append(f"{name}: not plotted: no RL rows (its rows are {stages}: the curves are RL steps)")
    return notes


def eval_rows(rows: list[dict]) -> list[dict]:
    """The held-out evaluations of a run's rows, one per weights evaluated, at the number of updates
    (RL steps) behind them: ``rl_eval`` rows (step 0: the start; the final one) as logged, and the
    periodic evaluation an ``rl`` row of step s carries (taken after that step: s + 1 steps). The
    final evaluation of a run whose last step was evaluated measures those same weights: it is kept
    once, not counted twice."""
    by_updates: dict[int, dict] = {}
    for r in rows:
        if r["stage"] == "rl_eval":
            by_updates[int(r["step"])] = r
        elif r["stage"] == "rl" and r.get("eval/accuracy") is not None:
            by_updates[int(r["step"]) + 1] = {**r, "step": int(r["step"]) + 1}
    return [by_updates[k] for k in sorted(by_updates)]


def _mean(v: list[float]) -> float:
    return sum(v) / len(v) if v else float("nan")


def summarize(name: str, arm: dict) -> dict:
    rl, ev = arm["rl"], arm["eval"]
    acc = [r["eval/accuracy"] for r in ev if r.get("eval/accuracy") is not None]
    _, lr = series(rl, "ratio/seq_log_sum_abs")
    return {
        "arm": name,
        "steps": len(rl),
        "reward_first": rl[0].get("reward/mean", math.nan) if rl else math.nan,
        "reward_last": _mean([r.get("reward/mean", math.nan) for r in rl[-5:]]),
        "eval_start": acc[0] if acc else math.nan,
        "eval_end": acc[-1] if acc else math.nan,
        "flip_step": _mean([r["flip/step/rate"] for r in rl if r.get("flip/step/rate") is not None]),
        "flip_drift": _mean([r["flip/drift/rate"] for r in rl if r.get("flip/drift/rate") is not None]),
        "clip_token": _mean([r.get("clip/token_frac", math.nan) for r in rl]),
        "clip_seq": _mean([r.get("clip/seq_frac", math.nan) for r in rl]),
        "max_abs_seq_log_ratio": max(lr) if lr else math.nan,
        "mismatch_k3": _mean([r["mismatch/k3"] for r in rl if r.get("mismatch/k3") is not None]),
        "mismatch_extreme": _mean(
            [r["mismatch/extreme_frac"] for r in rl if r.get("mismatch/extreme_frac") is not None]
        ),
        "flip_rollout": _mean([r[ROLLOUT_FLIP] for r in rl if r.get(ROLLOUT_FLIP) is not None]),
        "step_s": _mean([r.get("time/step", math.nan) for r in rl]),
    }


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("arm", "arm", "{:<10}"),
    ("steps", "steps", "{:>5}"),
    ("reward_first", "rew0", "{:>8.3f}"),
    ("reward_last", "rew_end", "{:>8.3f}"),
    ("eval_start", "acc0", "{:>8.1%}"),
    ("eval_end", "acc_end", "{:>8.1%}"),
    ("flip_step", "flip/step", "{:>9.3%}"),
    ("flip_drift", "flip/drift", "{:>10.3%}"),
    ("clip_token", "clip/token", "{:>10.3%}"),
    ("clip_seq", "clip/seq", "{:>9.3%}"),
    ("max_abs_seq_log_ratio", "|seqlogr|", "{:>9.2f}"),
    ("mismatch_k3", "k3", "{:>9.2e}"),
    ("mismatch_extreme", "extreme", "{:>8.3%}"),
    ("flip_rollout", "flip/r-v-t", "{:>10.3%}"),
    ("step_s", "s/step", "{:>7.2f}"),
)
"""The report table's columns: (summary key, heading, format). Rates (accuracy, flip rates per
activated expert, clipped shares) are shown in percent, with their % sign; report.csv keeps the
fractions metrics.jsonl holds (data for programs)."""
PERCENT_PANELS = (
    "eval/accuracy",
    "flip/step/rate",
    "clip/token_frac",
    "clip/seq_frac",
    ROLLOUT_FLIP,
    CLIPPED_OWN,
    "experts/dead_frac",
)
"Panels of rates: drawn in percent, their titles saying so."


def format_table(rows: list[dict]) -> str:
    widths = [len(f.format(r[c])) if rows else 8 for (c, _, f), r in zip(COLUMNS, rows * len(COLUMNS))]
    heads = [h for _, h, _ in COLUMNS]
    head = " ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(heads, widths)))
    lines = [head, "-" * len(head)]
    lines += [" ".join(f.format(r[c]) for c, _, f in COLUMNS) for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """The table as Markdown (the terminal's columns and formats)."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(f.format(r[c]).strip() for c, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


ROUND_OFF = 1e-9
"Values no larger than this in magnitude are round-off (k3 of an fp32 engine: ~1e-13), not signal."


def _values(arms: dict[str, dict], key: str) -> list[float]:
    vals = []
    for arm in arms.values():
        vals += series(arm["eval"] if key == "eval/accuracy" else arm["rl"], key)[1]
    return [v for v in vals if v is not None and math.isfinite(v)]


def informative(values: list[float]) -> bool:
    """Whether a panel of ``values`` (every arm's) shows anything: some value beyond round-off, and
    not all equal (one point, or a metric that never moved, e.g. a flip rate of an engine that
    routes exactly as the trainer)."""
    if not values:
        return False
    top = max(abs(v) for v in values)
    return top > ROUND_OFF and max(values) - min(values) > ROUND_OFF * max(1.0, top)


def panels(arms: dict[str, dict]) -> list[str]:
    """The panels :func:`plot` draws for ``arms``: those of :data:`DETAIL_PANELS`, then of
    :data:`EXPERT_PANELS`, whose metric is :func:`informative` over every arm (absent metrics,
    e.g. an SFT-only run's, and constant or round-off ones get no panel)."""
    return [k for k in (*DETAIL_PANELS, *EXPERT_PANELS) if informative(_values(arms, k))]


def y_scale(values: list[float]) -> str:
    """``log`` for positive values spanning two decades or more, else ``linear`` (a symlog axis
    drew near-zero values as barcodes)."""
    pos = [v for v in values if v > 0]
    return "log" if pos and len(pos) == len(values) and max(pos) / min(pos) >= 100 else "linear"


def plot(arms: dict[str, dict], out_png: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    keys = panels(arms)
    rows = max(1, -(-len(keys) // 4))
    fig, axes = plt.subplots(rows, 4, figsize=(20, 4 * rows), squeeze=False)
    for ax in axes.flat[max(1, len(keys)) :]:
        ax.set_visible(False)
    if not keys:
        axes.flat[0].axis("off")
        axes.flat[0].text(0, 0.5, "no metric moved in these runs (absent, constant or round-off)")
    for ax, key in zip(axes.flat, keys):
        scale = 100.0 if key in PERCENT_PANELS else 1.0
        for name, arm in arms.items():
            rows = arm["eval"] if key == "eval/accuracy" else arm["rl"]
            xs, ys = series(rows, key)
            ax.plot(xs, [scale * y for y in ys], marker="." if len(xs) < 40 else None, label=name)
        ax.set_title(PANELS[key] + (" (%)" if key in PERCENT_PANELS else ""))
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yscale(y_scale(_values(arms, key)))
        ax.grid(alpha=0.3)
    if keys:
        axes.flat[0].legend()
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


STORY_INGREDIENTS = [
    ("ratio/seq_log_sum_abs", "max |sequence log-ratio| (what GSPO clips)"),
    ("entropy/mean", "token entropy"),
    ("grad_norm", "gradient norm"),
    ("flip/step/rate", "expert flip rate per optimizer step"),
    ("flip/drift/rate", "expert drift vs pi_old"),
]
"""Candidates for the report's third panel: what could drive a fall (clip fractions are left out:
GSPO clips ~100x more than GRPO by construction, fallen or not)."""
_PRECURSOR_STEPS = 20


def _late_mean(rows: list[dict], key: str, lo: int, hi: int) -> float:
    _, ys = series([r for r in rows if lo <= r["step"] <= hi], key)
    ys = [abs(y) for y in ys if y is not None and math.isfinite(y)]
    return _mean(ys)


def fallen_at(arms: dict[str, dict], verdicts: dict) -> dict[str, int]:
    """The RL step at which each collapsed arm's sustained drop began (its verdict's index)."""
    return {a: arms[a]["rl"][v.step]["step"] for a, v in verdicts.items() if v.collapsed}


def differing_ingredient(arms: dict[str, dict], verdicts: dict) -> tuple[str, str, str]:
    """The ingredient of :data:`STORY_INGREDIENTS` that separates the arms most, with why.

    When an arm collapsed: the one whose mean over the ``_PRECURSOR_STEPS`` steps before the first
    collapse is furthest (in ratio) between the collapsed arms and the others, over the same steps.
    When none did: the max |sequence log-ratio| (the quantity the two ratio granularities treat
    differently)."""
    fallen = fallen_at(arms, verdicts)
    if not fallen or len(fallen) == len(arms):
        why = "no arm collapsed" if not fallen else "every arm collapsed"
        return STORY_INGREDIENTS[0][0], STORY_INGREDIENTS[0][1], why
    hi = min(fallen.values())
    lo = hi - _PRECURSOR_STEPS
    best = None
    for key, title in STORY_INGREDIENTS:
        bad = _mean([_late_mean(arms[a]["rl"], key, lo, hi) for a in fallen])
        good = _mean([_late_mean(arms[a]["rl"], key, lo, hi) for a in arms if a not in fallen])
        if not (math.isfinite(bad) and math.isfinite(good)) or bad <= 0 or good <= 0:
            continue
        score = abs(math.log(bad / good))
        if best is None or score > best[0]:
            best = (score, key, title, bad / good)
    if best is None:
        return STORY_INGREDIENTS[0][0], STORY_INGREDIENTS[0][1], "no ingredient measured before the fall"
    _, key, title, ratio = best
    return key, title, f"{ratio:.2g}x in the collapsed arm(s) over steps {max(lo, 0)}-{hi} (before the fall)"


def story(arms: dict[str, dict], out_png: str | Path) -> dict:
    """The ten-second picture: reward (trailing mean, the fixed collapse rule's smoothing; a cross
    where an arm collapsed), held-out accuracy, and :func:`differing_ingredient`; the title says
    which arms collapsed. Returns the verdicts and the ingredient shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_rl.lab.collapse import CRITERION, collapse_verdict, smoothed

    k = CRITERION.smooth
    verdicts = {a: collapse_verdict([r.get("reward/mean") for r in arm["rl"]]) for a, arm in arms.items()}
    key, title, why = differing_ingredient(arms, verdicts)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for i, (name, arm) in enumerate(arms.items()):
        color = plt.get_cmap("tab10")(i)
        xs, ys = series(arm["rl"], "reward/mean")
        if len(ys) >= k:
            axes[0].plot(xs[k - 1 :], smoothed(ys, k), color=color, label=name)
        v = verdicts[name]
        if v.collapsed:
            axes[0].plot([xs[v.step]], [smoothed(ys, k)[v.step - k + 1]], "x", color=color, ms=12, mew=3)
        ex, ey = series(arm["eval"], "eval/accuracy")
        axes[1].plot(ex, ey, marker="o", color=color, label=name)
        ix, iy = series(arm["rl"], key)
        axes[2].plot(ix, iy, color=color, label=name, alpha=0.85)
    axes[0].set_title(f"reward (trailing mean of {k} steps; x = collapsed)")
    axes[1].set_title("held-out greedy accuracy")
    axes[2].set_title(f"{title}\n{why}", fontsize=10)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[1].legend()  # the accuracy panel always has every arm (a short run has no smoothed reward)
    fallen = fallen_at(arms, verdicts)
    held = [a for a in arms if a not in fallen]
    head = (
        f"collapsed: {', '.join(f'{a} (step {s})' for a, s in fallen.items())}; held: {', '.join(held) or 'none'}"
        if fallen
        else f"no arm collapsed ({', '.join(arms)})"
    )
    fig.suptitle(
        head + f"  [rule: reward below {CRITERION.drop_frac:g} x its best for {CRITERION.window} steps]"
    )
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return {
        "verdicts": {a: v.state for a, v in verdicts.items()},
        "ingredient": key,
        "why": why,
        "title": head,
    }


def check_report_out(out_png: Path) -> None:
    """``--out`` is a new or earlier report's ``.png``: not a folder, not another kind of file (a
    run's ``metrics.jsonl``), and its ``.csv`` / ``.md`` beside it are an earlier report's or new."""
    if out_png.is_dir():
        raise PathError(f"--out {out_png} is a folder: give a file name, e.g. {out_png / 'report.png'}")
    if out_png.suffix.lower() != ".png":
        raise PathError(
            f"--out {out_png}: give a .png path (the curves; the table goes beside it as .csv and .md), "
            f"e.g. {out_png.with_suffix('.png')}"
        )
    if not out_png.exists():
        theirs = [str(f) for f in (out_png.with_suffix(".csv"), out_png.with_suffix(".md")) if f.exists()]
        if theirs:
            raise PathError(
                f"--out {out_png}: {', '.join(theirs)} exist and no earlier report wrote them (there is no "
                f"{out_png.name}): the report would replace them; give another --out"
            )


def report(runs: dict[str, str | Path], out_png: str | Path) -> tuple[str, list[dict]]:
    """Plot and tabulate named run directories: ``out_png``, and beside it the table as ``.csv``
    and ``.md`` (same stem); return the table text and summary rows."""
    out_png = Path(out_png)
    check_report_out(out_png)
    arms = {name: load_arm(d) for name, d in runs.items()}
    notes = [note for name, arm in arms.items() for note in unplotted(name, arm)]
    for note in notes:
        logging.getLogger(__name__).warning("report: %s", note)
    if all(not a["rl"] and not a["eval"] for a in arms.values()):
        raise DataError(f"nothing to plot: {'; '.join(n for n in notes if 'not plotted' in n)}")
    plot(arms, out_png)
    rows = [summarize(n, a) for n, a in arms.items()]
    write_text(out_png.with_suffix(".csv"), csv_text(rows))
    write_text(out_png.with_suffix(".md"), f"# moe-rl report\n\n{markdown(rows)}")
    return format_table(rows), rows
