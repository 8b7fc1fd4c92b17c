"""Design (e)'s GPU arm (issue 50, item 5): GRPO against GRPO + R3 one update at a time, with the
trainer in bf16 on CUDA, where the engine's and the trainer's kernels really differ (no emulated
noise: B' comes from the embedded engine as it is, so R3 replays routes the engine chose under its
own numerics).

:func:`gpu_check` is the one call ``make gpu-check`` makes (the lead wires it into
benchmarks/gpu_check.py): from a carried SFT start (HF safetensors or a checkpoint, < 64 MiB: e.g.
the 12-layer, 64-expert top-8 policy SFT'd on CPU), a GRPO state run on the GPU saves a state every
``every`` steps; each is scored (GRPO' and GRPO + R3 at ``minibatches``, V drawn from pi_s) until
the budget is spent; the result is a JSON + PNG under ``out`` whose ``headline`` holds Delta_R3 with
its 95% interval and exact p, and the cost per state. On CPU it runs at a smoke size
(studies/one_update/test_driver.py).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

from studies.one_update import driver, report, states

log = logging.getLogger(__name__)

GPU_SEED = 510
"The GPU arm's state run's replicate seed (fresh: used nowhere else)."


def gpu_check(
    start: str | Path,
    out: str | Path,
    *,
    model: dict | None = None,
    device: str = "cuda",
    dtype: str = "bfloat16",
    states_wanted: int = 30,
    every: int = 2,
    minibatches: int = 16,
    v_per_prompt: int = 32,
    budget_s: float = 540.0,
    cell_base: dict | None = None,
) -> dict:
    """Score up to ``states_wanted`` states of a GRPO run from ``start`` (``model``: the start's
    model fields over design (b)'s cell; ``cell_base``: the whole cell instead, e.g. a smoke
    size), GRPO' against GRPO + R3 on B' from the engine as it is, within ``budget_s`` seconds
    (state run included); the result's headline (also written to ``out``)."""
    t0, out = time.perf_counter(), Path(out)
    overrides = driver.device_overrides(device, dtype)
    plan = copy.deepcopy(driver.load_plan())
    cells = copy.deepcopy(states.cell_plan(plan))
    if cell_base is not None:
        cells["cell_base"] = copy.deepcopy(cell_base)
    if model:
        cells["cell_base"]["model"] = {**cells["cell_base"].get("model", {}), **model}
    plan.update(cell_plan_inline=cells, start=str(start), state_overrides=[*overrides, "train.eval_every=0"])
    plan["states"].update(
        rl_steps=states_wanted * every,
        sets={"moe": {"cell": "moe-dial30", "seeds": [GPU_SEED], "every": every}},
    )
    root = out / "runs"
    states.generate(plan, root)
    cfg = {
        "arms": ["GRPO'", "GRPO+R3"],
        "minibatches": [minibatches],
        "v_per_prompt": v_per_prompt,
        "heldout": None,
        "w_clip": plan["scoring"]["w_clip"],
        "engine_sigma": 0.0,
    }
    scorer, records = driver.Scorer(root, overrides), []
    try:
        for s in states.states_of(states.state_runs(plan, root)[0]):
            spent = time.perf_counter() - t0
            per = sum(r["cost"]["wall_s"] for r in records) / len(records) if records else 0.0
            if records and spent + 1.5 * per > budget_s:
                log.warning("budget: %d of the states scored in %.0f s", len(records), spent)
                break
            records.append(scorer.score(s, cfg))
    finally:
        scorer.close()
    meta = {"study": "one_update", "arm": "gpu", "device": device, "dtype": dtype, "start": str(start),
            "wall_s": time.perf_counter() - t0}  # fmt: skip
    from moe_rl.lab.results import commit, machine

    path = out / f"one_update_gpu-{machine()}-{commit()}.json"
    return report.write(records, {"gpu": cfg}, path, meta)["headline"]
