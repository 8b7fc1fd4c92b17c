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
:func:`moe_rl.lab.compare.claim_out`) is refused, so ``--out`` never replaces a user's folders.
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.lab.arms import DEMO_ARMS, DEMO_SEEDS

DEFAULT_RECIPE = "recipes/demo/noise_demo.yaml"


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
