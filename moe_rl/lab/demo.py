"""``make demo`` / ``moe-rl demo``: the strongest contrast measured, in short, several seeds per arm.

:data:`~moe_rl.lab.arms.DEMO_ARMS` (GRPO, GRPO + R2 and the chaos null: GRPO from a start jittered
by 1e-7) x :data:`~moe_rl.lab.arms.DEMO_SEEDS` seeds on ``recipes/demo/dial_demo.yaml``: design
(b)'s moe-dial30 cell (countdown, the router's learning rate x30; studies/noise/README.md) at 40 steps, from
its SFT start shipped in ``recipes/demo/dial_start``. It is ``moe-rl compare``
(:func:`moe_rl.lab.compare.run_compare`) with these arms and seeds: runs resumable, two at a time
by default, a seed-paired table (each arm's difference to GRPO with its 95% interval: held-out
accuracy, its AUC over steps, and the share of steps with a token ratio outside [0.5, 2]) and
``compare.png`` (median over seeds with a min-max band) at the end. The chaos null's spread is the
yardstick: an arm that differs from GRPO by no more than the null does is not separated by this
demo.

``out`` is the command's own: a folder holding anything it did not write (no marker,
:func:`moe_rl.lab.compare_checks.claim_out`) is refused, so ``--out`` never replaces a user's folders.
"""

from __future__ import annotations

from pathlib import Path

from moe_rl.lab.arms import DEMO_ARMS, DEMO_SEEDS

DEFAULT_RECIPE = "recipes/demo/dial_demo.yaml"


def run_demo(
    recipe: str | Path = DEFAULT_RECIPE,
    overrides: list[str] = (),
    *,
    out: str | Path = "runs/demo",
    jobs: int | None = 2,
    seeds: int | list[int] = DEMO_SEEDS,
) -> dict:
    """:data:`DEMO_ARMS` x ``seeds`` (a count, or the seeds themselves) of ``recipe`` through
    ``moe-rl compare`` into ``out``; its result (``table``, ``rows``, ``files``, ``wall_s``, ...)."""
    from moe_rl.lab.compare import run_compare

    return run_compare(recipe, list(overrides), arms=list(DEMO_ARMS), seeds=seeds, jobs=jobs, out=out)
