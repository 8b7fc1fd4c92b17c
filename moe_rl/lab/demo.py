"""``make demo``: GRPO, GRPO + Routing Replay and GSPO from one start, seed and prompt order, side by
side; report (``report.png``: :func:`moe_rl.lab.report.story`; ``report-detail.png``: every metric).

The default recipe, ``recipes/demo/closest.yaml``, is a short form of the phase diagram's closest cell
(docs/phase.md, "The demo"): it starts from the SFT start shipped in ``recipes/demo/start``
(``model.hf_path``) and runs the RL arms only. A recipe whose ``train.stages`` holds ``sft`` (e.g.
``recipes/demo/base.yaml``) first gets its SFT start (:func:`moe_rl.lab.starts.warm_start`: trained
once into its ``train.out_dir``, reused by later demos). The arms are
:data:`moe_rl.lab.arms.DEMO_ARMS`, each the recipe plus the arm's overrides, so the demo and the
benchmarks compare the same algorithm settings. They run through :mod:`moe_rl.lab.runner`, one
process each, ``jobs`` at a time (default: all of them), the machine's cores shared between them;
each arm's output goes to ``<out>/<arm>.log``.

``out`` is the demo's own: a folder holding anything the demo did not write (no
:data:`MARKER`) is refused, so ``--out`` never replaces a user's folders named like an arm. A
rerun into the demo's own ``out`` skips the arms that finished with the same recipe
(:func:`moe_rl.lab.runner.resumable_run`) and runs the rest; every arm's recipe is checked before
any arm (or SFT) starts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from moe_rl.config import ConfigError, load_recipe
from moe_rl.errors import PathError, UserError
from moe_rl.lab.arms import DEMO_ARMS, arm_dir, arm_overrides, start_overrides
from moe_rl.lab.report import load_arm, report, story
from moe_rl.lab.results import write_json
from moe_rl.lab.runner import child_launch, in_pool, resumable_run
from moe_rl.lab.starts import warm_start
from moe_rl.trainer.timer import StepTimer

log = logging.getLogger(__name__)

DEFAULT_RECIPE = "recipes/demo/closest.yaml"
MARKER = ".moe-rl-demo"
"Written into a demo's ``out``: the folder is the demo's own (a rerun may write into it)."


def check_out(
    out: Path, *, command: str = "demo", marker: str = MARKER, writes: str = "a folder per arm and report.png"
) -> None:
    """Refuse an ``out`` holding anything ``command`` did not write (a user's folders or files):
    one without ``command``'s ``marker`` (:func:`claim_out`) that is not empty."""
    if out.exists() and not out.is_dir():
        raise PathError(f"{command} --out {out} is a file: give a new or empty folder")
    if out.is_dir() and not (out / marker).exists():
        theirs = sorted(p.name for p in out.iterdir())
        if theirs:
            shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
            raise PathError(
                f"{command} --out {out} holds files the {command} did not write ({shown}): give a new or "
                f"empty folder (the {command} writes {writes} there)"
            )


def claim_out(out: Path, recipe: Path, overrides: list[str], *, marker: str = MARKER) -> None:
    """Mark ``out`` (checked by :func:`check_out`) as its command's (``marker``: the demo's by default)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{marker}.tmp"
    tmp.write_text(json.dumps({"recipe": str(recipe), "overrides": overrides}))
    tmp.replace(out / marker)


def check_arms(recipe: Path, overrides: list[str]) -> None:
    """Every arm's recipe loads (a ConfigError naming the arm), before any arm or SFT starts."""
    for name in DEMO_ARMS:
        try:
            load_recipe(recipe, [*overrides, *arm_overrides(name), "train.stages=[rl]"])
        except ConfigError as e:
            raise ConfigError(f"demo arm {name}: {e}") from None


def _start(recipe: Path, overrides: list[str]) -> list[str]:
    """The overrides that start every arm from the same weights: the recipe's SFT start
    (:func:`~moe_rl.lab.starts.warm_start` into its ``train.out_dir``) when it has an SFT stage,
    else the start it names."""
    base = load_recipe(recipe, overrides)
    if "sft" in base.train.stages:
        ckpt, _ = warm_start(recipe, overrides, launch=child_launch(), root=Path(base.train.out_dir))
        return start_overrides(ckpt)
    if not (base.model.hf_path or base.checkpoint.load):
        raise UserError(
            f"{recipe}: train.stages has no sft and neither model.hf_path nor checkpoint.load names a "
            "start: the arms would begin from random weights. Add sft to train.stages or name a start"
        )
    return []


def run_demo(
    recipe: str | Path = DEFAULT_RECIPE,
    overrides: list[str] = (),
    *,
    out: str | Path = "runs/demo",
    jobs: int | None = None,
) -> str:
    """Run (or reuse) the start, then the RL arms; write report.png and report.json under ``out``."""
    recipe, out, overrides = Path(recipe), Path(out), list(overrides)
    if not recipe.is_file():
        raise UserError(f"demo recipe {recipe} is not a file: give a recipe such as {DEFAULT_RECIPE}")
    jobs = max(1, min(jobs or len(DEMO_ARMS), len(DEMO_ARMS)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    check_arms(recipe, overrides)
    check_out(out)  # before the start, which may train
    timer = StepTimer()
    with timer.record("sft"):
        start = _start(recipe, overrides)
    claim_out(out, recipe, overrides)
    runs = {name: out / arm_dir(name) for name in DEMO_ARMS}

    def one(name: str) -> None:
        logf = out / f"{arm_dir(name)}.log"
        ov = [*overrides, *arm_overrides(name), "train.stages=[rl]", *start]
        # skipped when a demo before finished it with this recipe; saves as the recipe says
        kw = {"resume": True, "checkpoint_every": None, "threads": threads, "log_file": logf}
        st = resumable_run(name, recipe, ov, runs[name], launch=child_launch(), **kw)
        if st["status"] != "done":
            raise UserError(f"{logf.stem} failed ({st['reason']}): its output is in {logf}")
        log.info("%s finished (%s)", name, logf)

    with timer.record("arms"):
        log.info("running %s, %d at a time (%d threads each)", ", ".join(DEMO_ARMS), jobs, threads)
        in_pool(one, list(DEMO_ARMS), jobs)
    with timer.record("report"):
        table, rows = report({n: str(d) for n, d in runs.items()}, out / "report-detail.png")
        told = story({name: load_arm(d) for name, d in runs.items()}, out / "report.png")
    t_sft, t_arms, wall = timer.seconds["sft"], timer.seconds["arms"], timer.total()
    doc = {
        "recipe": str(recipe),
        "overrides": overrides,
        "arms": list(DEMO_ARMS),
        "rows": rows,
        "story": told,
        "sft_s": t_sft,
        "arms_s": t_arms,
        "wall_s": wall,
        "jobs": jobs,
        "threads_per_arm": threads,
        "cpu_count": os.cpu_count(),
    }
    write_json(out / "report.json", doc)
    return (
        f"{table}\n\n{told['title']}; {told['ingredient']}: {told['why']}\n"
        f"start {t_sft:.0f}s, arms {t_arms:.0f}s, total {wall:.0f}s; picture: {out / 'report.png'} "
        f"(every metric: {out / 'report-detail.png'})"
    )
