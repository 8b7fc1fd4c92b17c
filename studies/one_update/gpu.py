"""Design (e)'s GPU arm (issue 50, item 5): GRPO against GRPO + R3 one update at a time, with the
trainer in bf16 on CUDA, where the engine's and the trainer's kernels really differ (no emulated
noise: B' comes from the embedded engine as it is, so R3 replays routes the engine chose under its
own numerics).

:func:`gpu_check` is what ``make gpu-check``'s ``one_update`` section runs, as ``python -m
studies.one_update --gpu-arm recipes/demo/dial_start --device cuda --dtype bfloat16`` in a process
of its own (tools/gpu_check.py; docs/gpu_check.md says how to call it). From a carried SFT start (HF
safetensors or a checkpoint, < 64 MiB: design (b)'s shipped start, 7 MiB), a GRPO state run on the
GPU saves a state every ``every`` steps; each is scored (GRPO' and GRPO + R3 at ``minibatches``, V
drawn from pi_s) until the budget is spent; the result is a JSON + PNG under ``out`` whose
``headline`` holds Delta_R3 with its 95% interval and exact p, and the cost per state. On CPU it
runs at a smoke size (studies/one_update/test_driver.py, and ``--smoke``: ``make gpu-check``'s dry
run).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path

from studies.one_update import driver, report, states

log = logging.getLogger(__name__)

GPU_SEED = 510
"The GPU arm's state run's replicate seed (fresh: used nowhere else)."
DRY = dict(states_wanted=1, every=1, minibatches=2, v_per_prompt=2)
"""``--smoke`` (``make gpu-check``'s dry run, on a CPU): one state of the shipped start's cell, scored
at M = 2 on 2 samples a prompt, its RL steps of :data:`DRY_TRAIN`."""
DRY_TRAIN = dict(
    prompts_per_step=2, group_size=2, minibatches=2, max_new_tokens=16, eval_every=0, flip_probe_sequences=2
)


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
    # JSONL metrics only: the arm reads its records, and a device image may lack TensorBoard
    overrides = [*driver.device_overrides(device, dtype), "train.loggers=[jsonl]"]
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


def dry_cell_base() -> dict:
    """Design (b)'s cell base (the shipped start's model and task) with :data:`DRY_TRAIN`'s batch."""
    base = copy.deepcopy(states.cell_plan(driver.load_plan())["cell_base"])
    base["train"] = {**base["train"], **DRY_TRAIN}
    return base


def command(args) -> int:
    """``python -m studies.one_update --gpu-arm START``: :func:`gpu_check` from START into ``--root``
    (default ``runs/one_update/gpu``) within ``--budget-s``, ``--gpu-states`` states; ``--smoke``: the
    :data:`DRY` sizes. The headline is printed; the JSON + PNG are in ``--root``."""
    import torch

    from moe_rl.errors import UserError
    from moe_rl.lab.runner import ensure_parallel

    start = Path(args.gpu_arm)
    if not start.exists():
        raise UserError(f"--gpu-arm {start}: no such SFT start (an HF safetensors folder or a checkpoint)")
    torch.set_num_threads(args.threads)
    ensure_parallel()
    sizes = dict(DRY, cell_base=dry_cell_base()) if args.smoke else dict(states_wanted=args.gpu_states)
    root = args.root or driver.ROOT / "gpu"
    h = gpu_check(start, root, device=args.device, dtype=args.dtype, budget_s=args.budget_s, **sizes)
    print(json.dumps(h, indent=1, default=str)[:4000])
    return 0
