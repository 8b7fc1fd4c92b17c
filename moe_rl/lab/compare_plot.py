"""``compare.png``, the picture of ``moe-rl compare``: reward, held-out accuracy (%) and the running
share of RL steps with a token ratio outside [0.5, 2] (%) per arm, the median over seeds with a
min-max band.

Every arm stays visible: each has its own line style and marker, earlier arms are drawn wider
beneath later ones, and an arm whose curve is another's exactly says so in the legend (``= GRPO``);
the legend counts seeds in words (``1 seed``, ``3 seeds``); steps are whole numbers on the axis.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from moe_rl.lab.report import series
from moe_rl.lab.stats import outlier_steps

REWARD_SMOOTH = 5
"Steps of the trailing mean of the reward curves (the table's final reward: the last 5)."
STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 3)), "P"))
"(line style, marker) of the arms, in order."


def trailing_mean(ys: list[float], k: int) -> list[float]:
    return [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def band(curves: list[tuple[list, list]]) -> tuple[list, list, list, list]:
    """Median, min and max across curves at every step any of them has."""
    by_x: dict[int, list[float]] = {}
    for xs, ys in curves:
        for x, y in zip(xs, ys):
            if y is not None and math.isfinite(y):
                by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return (
        xs,
        [statistics.median(by_x[x]) for x in xs],
        [min(by_x[x]) for x in xs],
        [max(by_x[x]) for x in xs],
    )


def running_outlier_share(rl: list[dict]) -> tuple[list, list]:
    """Per RL step, the share of the steps so far (those that logged it) with any token ratio
    outside [0.5, 2]: the running form of the table's ``outlier_steps`` (a fraction)."""
    logged = [r for r in rl if r.get("ratio/token_frac_outside_0.5_2") is not None]
    return [r["step"] for r in logged], [outlier_steps(logged[: i + 1]) for i in range(len(logged))]


def seeds_text(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def panel_curves(seeds: dict[int, dict]) -> list[list[tuple[list, list]]]:
    """One arm's per-seed curves of the three panels: reward (trailing mean), accuracy (%), and the
    running ratio-outlier share (%)."""
    rewards, accs, outliers = [], [], []
    for data in seeds.values():
        xs, ys = series(data["rl"], "reward/mean")
        rewards.append((xs, trailing_mean(ys, REWARD_SMOOTH)))
        xs, ys = series(data["eval"], "eval/accuracy")
        accs.append((xs, [100 * y for y in ys]))
        xs, ys = running_outlier_share(data["rl"])
        outliers.append((xs, [100 * y for y in ys]))
    return [rewards, accs, outliers]


def plot(runs: dict[str, dict[int, dict]], out_png: Path) -> Path:
    """``compare.png`` of ``runs[arm][seed]`` (:func:`moe_rl.lab.runner.read_arm`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    drawn: list[dict] = [{}, {}, {}]  # panel -> arm -> its (xs, median, lo, hi)
    for i, (arm, seeds) in enumerate(runs.items()):
        color = plt.get_cmap("tab10")(i)
        style, marker = STYLES[i % len(STYLES)]
        for p, (ax, curves) in enumerate(zip(axes, panel_curves(seeds))):
            xs, med, lo, hi = band(curves)
            if not xs:
                continue
            same = next((a for a, c in drawn[p].items() if c == (xs, med, lo, hi)), None)
            drawn[p][arm] = (xs, med, lo, hi)
            label = f"{arm} ({seeds_text(len(seeds))})" + (f", = {same}" if same else "")
            ax.plot(
                xs,
                med,
                color=color,
                linestyle=style,
                linewidth=max(3.2 - 0.8 * i, 1.0),
                marker=marker if len(xs) <= 12 else None,
                markersize=max(9 - 2 * i, 4),
                label=label,
                zorder=2 + i,
            )
            if len(seeds) > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.18, linewidth=0)
    axes[0].set_title(f"reward (trailing mean of {REWARD_SMOOTH} steps)")
    axes[1].set_title("held-out greedy accuracy (%)")
    axes[2].set_title("share of RL steps so far with a token ratio outside [0.5, 2] (%)")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=9)
    axes[1].set_ylabel("%")
    axes[2].set_ylabel("% of steps")
    fig.suptitle("median over seeds; band: min to max across seeds")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
