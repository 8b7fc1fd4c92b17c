"""``make demo`` / ``moe-rl demo``: the noise design's deciding contrast in short, several seeds per arm.

:data:`~moe_rl.lab.arms.DEMO_ARMS` (GRPO, GRPO + R3 and the chaos null: GRPO from a start jittered
by 1e-7) x :data:`~moe_rl.lab.arms.DEMO_SEEDS` seeds on ``recipes/demo/noise_demo.yaml``: the
noise design's moe-noise cell (docs/noise.md) at 40 steps, from its SFT start shipped in
``recipes/demo/noise_start``. It is ``moe-rl compare`` (:func:`moe_rl.lab.compare.run_compare`)
with these arms and seeds: runs resumable, two at a time by default, a seed-paired table (each
arm's difference to GRPO with its 95% interval) and ``compare.png`` (median over seeds with a
min-max band) at the end. The chaos null's spread is the yardstick: an arm that differs from GRPO
by no more than the null does is not separated by this demo.

``out`` is the command's own: a folder holding anything it did not write (no marker,
:func:`claim_out`) is refused, so ``--out`` never replaces a user's folders.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from moe_rl.errors import PathError
from moe_rl.lab.arms import DEMO_ARMS, DEMO_SEEDS

log = logging.getLogger(__name__)

DEFAULT_RECIPE = "recipes/demo/noise_demo.yaml"
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


def run_demo(
    recipe: str | Path = DEFAULT_RECIPE,
    overrides: list[str] = (),
    *,
    out: str | Path = "runs/demo",
    jobs: int | None = 2,
    seeds: int = DEMO_SEEDS,
) -> dict:
    """:data:`DEMO_ARMS` x ``seeds`` of ``recipe`` through ``moe-rl compare`` into ``out``; its
    result (``table``, ``rows``, ``files``, ``wall_s``, ...)."""
    from moe_rl.lab.compare import run_compare

    return run_compare(recipe, list(overrides), arms=list(DEMO_ARMS), seeds=seeds, jobs=jobs, out=out)
