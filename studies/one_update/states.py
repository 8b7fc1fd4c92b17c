"""Design (e)'s states: GRPO runs of design (b)'s cells on fresh seeds, weights and Adam state saved
every few steps by the trainer's own checkpoints, and a scoring run opened on each.

A state run is design (b)'s run of its cell (``moe_rl.lab.cells.run_overrides`` of
recipes/demo/dial.plan.yaml: the same recipe, start and seeds scheme) with ``checkpoint.every`` set to
the plan's ``every`` and every checkpoint kept; :func:`moe_rl.lab.runner.resumable_run` runs it
(a finished one is skipped, a stopped one resumed). Its checkpoint of RL step k (``...-rl-step-
0000k``) is state k: the policy and Adam moments before step k's update, whose batch B that run's
seeds fix (:func:`moe_rl.trainer.rl.collect` at step k).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from moe_rl.lab import cells
from moe_rl.lab.arms import DEMO, ROOT
from moe_rl.lab.runner import STATUS_FILE, read_status, resumable_run
from moe_rl.lab.starts import CACHE, sft_key, shipped_start, warm_start

log = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"^\d+-rl-step-(\d+)$")
"A state run's checkpoint directory name: ``<seq>-rl-step-<steps done>``."


@dataclass(frozen=True)
class StateRun:
    """One GRPO run whose checkpoints are states."""

    set: str
    "``moe`` or ``dense`` (the plan's ``states.sets``)."
    cell: str
    "Its cell of design (b)'s plan."
    seed: int
    "Its replicate seed (``train.seed`` = FIRST_SEED + seed, ``task.seed`` = seed)."
    every: int
    "Steps between saved states."
    out: Path
    "Its run directory."

    @property
    def name(self) -> str:
        return f"{self.set}-s{self.seed}"


@dataclass(frozen=True)
class State:
    """State ``step`` of a state run: its checkpoint."""

    run: StateRun
    step: int
    checkpoint: Path

    @property
    def name(self) -> str:
        return f"{self.run.name}-step{self.step:03d}"


CELL_PLANS = {"b": ROOT / "studies" / "noise" / "dial.plan.yaml"}
"""The plans whose cells the states run, by the design letter the plan names (design (b)'s plan is a
record of the noise study: read as data, not imported)."""


def cell_plan(plan: dict) -> dict:
    """Design (b)'s plan (or the smoke's stand-in, ``plan["cell_plan_inline"]``)."""
    return plan.get("cell_plan_inline") or cells.load_plan(CELL_PLANS[plan["states"]["cell_plan"]])


def state_runs(plan: dict, root: Path) -> list[StateRun]:
    """Every state run of the plan, MoE first."""
    sets = plan["states"]["sets"]
    return [
        StateRun(name, s["cell"], seed, int(s["every"]), root / "states" / f"{name}-s{seed}")
        for name, s in sets.items()
        for seed in s["seeds"]
    ]


def run_overrides(plan: dict, run: StateRun) -> list[str]:
    """The run's overrides on recipes/demo/base.yaml: design (b)'s run of its cell and seed, for
    ``states.rl_steps`` steps, every checkpoint kept (plus the plan's ``state_overrides``)."""
    design_b = cell_plan(plan)
    ov = cells.run_overrides(design_b, run.cell, plan["states"]["arm"], run.seed, plan["states"]["rl_steps"])
    keep = plan["states"]["rl_steps"] // run.every + 5
    return [*ov, f"checkpoint.keep={keep}", *plan.get("state_overrides", [])]


SHIPPED = (ROOT / "recipes" / "demo" / "dial_start.json",)
"""Design (b)'s MoE start, shipped (recipes/demo/dial_start: HF safetensors, its SFT key and sha256 in
the JSON): a cell of that SFT key starts from it instead of training it again."""


def start_of(plan: dict, run: StateRun, cache: Path = CACHE) -> Path:
    """The run's SFT start: design (b)'s for its cell, the shipped one where its SFT key matches
    (the MoE's), else trained once by the same SFT recipe and cached, as design (b) trained it (the
    dense one); ``plan["start"]`` when given (the GPU check's carried start)."""
    from moe_rl.config import load_recipe

    if plan.get("start"):
        return Path(plan["start"])
    ov = cells.start_overrides_of(cell_plan(plan), run.cell)
    shipped = shipped_start(sft_key(load_recipe(DEMO, [*ov, "train.stages=[sft]"])), SHIPPED)
    return shipped if shipped is not None else warm_start(DEMO, ov, cache=cache)[0]


def generate(plan: dict, root: Path, cache: Path = CACHE) -> list[dict]:
    """Every state run not finished yet, one at a time, in this process; their statuses."""
    out = []
    for run in state_runs(plan, root):
        done = run.out / STATUS_FILE
        start = None if done.exists() else start_of(plan, run, cache)
        st = resumable_run(
            f"state run {run.name}",
            DEMO,
            run_overrides(plan, run),
            run.out,
            start=start,
            checkpoint_every=run.every,
        )
        if st["status"] != "done":
            raise RuntimeError(f"state run {run.name} ended {st['status']}: {st.get('reason')}")
        out.append({"run": run.name, **st})
    return out


def states_of(run: StateRun) -> list[State]:
    """The run's saved states at steps every, 2 every, ... (its finished checkpoints, by step)."""
    st = read_status(run.out / STATUS_FILE) if (run.out / STATUS_FILE).exists() else None
    if st is None or st.get("status") != "done":
        raise RuntimeError(f"state run {run.name} has not finished: run the sweep to make its states")
    found = {}
    for d in sorted((run.out / "checkpoints").iterdir()):
        m = CHECKPOINT.match(d.name)
        if m and int(m.group(1)) > 0 and int(m.group(1)) % run.every == 0:
            found[int(m.group(1))] = d
    return [State(run, step, found[step]) for step in sorted(found)]


def open_scoring_run(run: StateRun, out: Path, overrides: list[str] = ()):
    """A trainer :class:`Run` on ``run``'s own recipe (its ``recipe.yaml``), writing into ``out``,
    with its engine and an RL optimizer, ready to load a state (:func:`load_state`)."""
    from moe_rl.config import load_recipe
    from moe_rl.trainer.context import Run

    recipe = load_recipe(
        run.out / "recipe.yaml",
        [
            f"train.out_dir={out}",
            "train.stages=[rl]",
            "model.hf_path=null",
            "checkpoint.load=null",
            "checkpoint.dir=null",
            *overrides,
        ],
    )
    scoring = Run(recipe, write_recipe=False)
    scoring.ensure_engine()
    scoring.make_optimizer("rl")
    return scoring


def load_state(scoring, state: State) -> None:
    """``state``'s weights and Adam state into the scoring run (the engine then serves them)."""
    from moe_rl.megatron.checkpoint import load_checkpoint

    meta = load_checkpoint(state.checkpoint, scoring.policy.model, scoring.optimizer, load_rng=False)
    if meta["extra"].get("stage") != "rl":
        raise RuntimeError(f"{state.checkpoint} is not an RL checkpoint: not a state")
    scoring.push_weights()
