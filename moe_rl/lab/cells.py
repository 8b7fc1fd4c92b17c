"""A study plan's cells and arms as recipe overrides on recipes/demo/base.yaml.

A plan (YAML data) names ``cell_base`` (overrides every cell shares), ``cells`` (each a list of
parts: ``noise``, ``dense``, ... each a section of overrides) and, optionally, ``extra_arms`` (an arm
of :data:`moe_rl.lab.arms.ARMS` with more overrides). Two studies read such plans: the noise designs
(which wrote them) and design (e), whose states are design (b)'s runs.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from moe_rl.lab.arms import ARMS, FIRST_SEED, flatten


def load_plan(path: Path | str) -> dict:
    """The plan at ``path``."""
    return yaml.safe_load(Path(path).read_text())


def arm_sections(plan: dict, arm: str) -> list[dict]:
    """The recipe sections of ``arm``: one of :data:`ARMS`, or a plan ``extra_arms`` entry over its
    ``of`` arm."""
    extra = plan.get("extra_arms", {})
    if arm in extra:
        return [*arm_sections(plan, extra[arm]["of"]), extra[arm]["overrides"]]
    if arm not in ARMS:
        raise KeyError(f"unknown arm {arm!r}: use one of {', '.join([*ARMS, *extra])}")
    return [ARMS[arm]]


def cell_overrides(plan: dict, cell: str) -> list[str]:
    """base.yaml overrides of ``cell``: ``cell_base`` then its parts (``noise``, ``dense``)."""
    if cell not in plan["cells"]:
        raise KeyError(f"unknown cell {cell!r}: use one of {', '.join(plan['cells'])}")
    return flatten(plan["cell_base"]) + [ov for part in plan["cells"][cell] for ov in flatten(plan[part])]


def start_overrides_of(plan: dict, cell: str) -> list[str]:
    """The overrides that fix a cell's SFT start: ``cell_base`` and its model part (``dense``); the
    noise is RL-only (its SFT signature is the MoE cells')."""
    parts = [p for p in plan["cells"][cell] if "model" in plan[p]]
    return flatten(plan["cell_base"]) + [ov for p in parts for ov in flatten(plan[p])]


def run_overrides(plan: dict, cell: str, arm: str, seed: int, steps: int | None = None) -> list[str]:
    """One run's overrides: the cell's, the arm's, the seed's (``train.seed`` FIRST_SEED + seed,
    ``task.seed`` seed) and, when given, ``train.rl_steps``."""
    ov = cell_overrides(plan, cell)
    for sections in arm_sections(plan, arm):
        ov += flatten(sections)
    ov += [f"train.seed={FIRST_SEED + seed}", f"task.seed={seed}"]
    return ov + ([f"train.rl_steps={steps}"] if steps else [])
