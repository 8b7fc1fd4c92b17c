"""Design (e)'s driver: make the states, score them resumably under the pre-registered gate and SE
rule, and report.

    python -m studies.one_update --calibrate      # the engine noise's calibration on the countdown start
    python -m studies.one_update --write-plan     # the pre-registration (committed before any scoring)
    python -m studies.one_update                  # states, then scoring (resumable: a rerun skips what is done)
    python -m studies.one_update --report         # analyse what is scored
    python -m studies.one_update --smoke          # the whole driver at a tiny size (seconds)
    ... --device cuda --dtype bfloat16            # the trainer in bf16 on a GPU (states and scoring)

Layout under ``--root`` (default runs/one_update): ``states/<set>-s<seed>/`` (the state runs),
``scores/<config>/<state>.json`` (one record per scored state, written when it finishes),
``decisions.json`` (the gate's and the SE rule's readings, taken once). Report:
studies/one_update/results/one_update-<machine>-<preset>-<commit>.json + .png (``headline``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from pathlib import Path

import yaml

from moe_rl.lab.results import write_json
from studies.one_update import analysis, states
from studies.one_update.harness import score_state

log = logging.getLogger("studies.one_update")
HERE = Path(__file__).resolve().parent
PLAN_YAML = HERE / "plan.yaml"
PLAN_FILE = HERE / "preregistration.json"
RESULTS = HERE / "results"
ROOT = HERE.parents[1] / "runs" / "one_update"
FIRST = 10
"The gate and the SE rule read the first this many MoE states of the order."


def load_plan(path: Path = PLAN_YAML) -> dict:
    return yaml.safe_load(Path(path).read_text())


def plan_doc(plan: dict) -> dict:
    """The pre-registration: the plan and the analysis code's rules, before any state is scored."""
    from studies.one_update import harness

    return {
        "study": "one_update",
        "design": plan["design"],
        "headline": {
            "states": {
                k: len(v["seeds"]) * plan["states"]["rl_steps"] // v["every"]
                for k, v in plan["states"]["sets"].items()
            },
            "seeds": {k: v["seeds"] for k, v in plan["states"]["sets"].items()},
            "arms": plan["scoring"]["arms"],
            "minibatches": plan["scoring"]["minibatches"],
        },  # fmt: skip
        "plan": plan,
        "analysis": {
            "harness": harness.__doc__,
            "score_from": harness.score_from.__doc__,
            "measure_arm": harness.measure_arm.__doc__,
            "order": score_order.__doc__,
            "gate": analysis.gate_reading.__doc__,
            "se_rule": analysis.se_reading.__doc__,
            "success": analysis.success.__doc__,
            "paired": analysis.paired_exact.__doc__,
            "sign_flip": analysis.sign_flip_bounds.__doc__,
            "interaction": analysis.permutation_p.__doc__,
            "run_level": analysis.run_level.__doc__,
        },
    }


# -- what is scored, in which order ---------------------------------------------------------------
def score_order(plan: dict, root: Path) -> list[states.State]:
    """The MoE states whose step is a multiple of 2 x every first, then the others, each half in a
    fixed shuffle (``random.Random(order_seed)``); the dense states after them, in step order."""
    moe, dense = [], []
    for run in states.state_runs(plan, root):
        (moe if run.set == "moe" else dense).extend(states.states_of(run))
    first = [s for s in moe if s.step % (2 * s.run.every) == 0]
    second = [s for s in moe if s.step % (2 * s.run.every) != 0]
    rng = random.Random(plan["order_seed"])
    rng.shuffle(first)
    rng.shuffle(second)
    return first + second + dense


def scoring_config(plan: dict, decisions: dict, set_name: str) -> dict:
    """What a state of ``set_name`` is scored with, after the decisions taken so far."""
    sc = plan["scoring"]
    cfg = {
        "arms": list(sc["arms"][set_name]),
        "minibatches": list(sc["minibatches"]),
        "v_per_prompt": sc["v_per_prompt"],
        "heldout": sc.get("heldout"),
        "w_clip": sc["w_clip"],
        "engine_sigma": sc.get("engine_sigma"),
    }
    if len(decisions.get("gate", [])) > 1 or (decisions.get("gate") and decisions["gate"][0].get("changed")):
        cfg["minibatches"] = list(plan["gate"]["change_minibatches"])
    if decisions.get("se", {}).get("double"):
        cfg.update(plan["se_rule"]["doubled"])
    return cfg


def config_id(cfg: dict) -> str:
    return hashlib.blake2b(json.dumps(cfg, sort_keys=True).encode(), digest_size=5).hexdigest()


# -- scoring --------------------------------------------------------------------------------------
class Scorer:
    """Scores states resumably: one scoring run open per state run, one record file per state."""

    def __init__(self, root: Path, overrides: list[str]):
        self.root, self.overrides, self.open = root, overrides, {}

    def record_path(self, state: states.State, cfg: dict) -> Path:
        return self.root / "scores" / config_id(cfg) / f"{state.name}.json"

    def score(self, state: states.State, cfg: dict) -> dict:
        """The state's record under ``cfg``: read back if scored before, else scored now and saved."""
        path = self.record_path(state, cfg)
        if path.exists():
            return json.loads(path.read_text())
        run = self.open.get(state.run.name)
        if run is None:
            out = self.root / "scoring" / state.run.name
            run = self.open[state.run.name] = states.open_scoring_run(state.run, out, self.overrides)
        t0, c0 = time.perf_counter(), time.process_time()
        states.load_state(run, state)
        rec = score_state(run, state.step, cfg, seed=state.run.seed)
        rec["state"] = {"set": state.run.set, "seed": state.run.seed, "step": state.step, "name": state.name}
        rec["config"], rec["cost"] = (
            cfg,
            {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0},
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, rec)
        log.info("%s scored in %.0f s (%s)", state.name, rec["cost"]["wall_s"], config_id(cfg))
        return rec

    def close(self) -> None:
        for run in self.open.values():
            run.close()
        self.open = {}


def read_decisions(root: Path) -> dict:
    path = root / "decisions.json"
    return json.loads(path.read_text()) if path.exists() else {}


def decide(plan: dict, order: list[states.State], scorer: Scorer, root: Path) -> dict:
    """The gate (changed once if it fails) and the SE rule on the first :data:`FIRST` MoE states,
    each read once and kept in ``decisions.json``; ``stopped`` when the gate failed twice."""
    dec = read_decisions(root)
    first = [s for s in order if s.run.set == "moe"][:FIRST]
    while "gate_passed" not in dec:
        cfg = scoring_config(plan, dec, "moe")
        recs = [scorer.score(s, cfg) for s in first]
        reading = analysis.gate_reading(recs, cfg["minibatches"][-1], plan["gate"])
        dec.setdefault("gate", []).append(reading)
        if reading["passed"]:
            dec["gate_passed"] = True
        elif len(dec["gate"]) == 1:
            reading["changed"] = f"minibatches -> {plan['gate']['change_minibatches']}"
        else:
            dec["gate_passed"], dec["stopped"] = False, "the gate failed at both cells"
        write_json(root / "decisions.json", dec)
        log.info("gate: %s", reading)
    if dec.get("stopped") or "se" in dec:
        return dec
    cfg = scoring_config(plan, dec, "moe")
    recs = [scorer.score(s, cfg) for s in first]
    dec["se"] = analysis.se_reading(recs, cfg["minibatches"][-1], plan["se_rule"])
    write_json(root / "decisions.json", dec)
    log.info("SE rule: %s", dec["se"])
    return dec


def scored_states(plan: dict, order: list[states.State], dec: dict) -> list[states.State]:
    """The states the final configuration scores: all, or with V doubled the MoE states of the first
    half of the order (steps at multiples of 2 x every) and every dense state."""
    if not dec.get("se", {}).get("double"):
        return order
    return [s for s in order if s.run.set != "moe" or s.step % (2 * s.run.every) == 0]


def sweep(plan: dict, root: Path, overrides: list[str] = ()) -> dict:
    """States (made once), the decisions, then every state scored; the decisions."""
    states.generate(plan, root, Path(plan["cache"]) if plan.get("cache") else states.CACHE)
    order = score_order(plan, root)
    scorer = Scorer(root, list(overrides))
    try:
        dec = decide(plan, order, scorer, root)
        if dec.get("stopped"):
            log.warning("stopped: %s", dec["stopped"])
            return dec
        for s in scored_states(plan, order, dec):
            scorer.score(s, scoring_config(plan, dec, s.run.set))
    finally:
        scorer.close()
    return dec


def finished_records(plan: dict, root: Path) -> tuple[list[dict], dict]:
    """The records the final configuration holds (what :func:`sweep` finished) and the decisions."""
    dec = read_decisions(root)
    order = score_order(plan, root)
    scorer = Scorer(root, [])
    out = []
    for s in scored_states(plan, order, dec):
        path = scorer.record_path(s, scoring_config(plan, dec, s.run.set))
        if path.exists():
            out.append(json.loads(path.read_text()))
    return out, dec


# -- the command line -----------------------------------------------------------------------------
SMOKE_CELLS = {
    "cell_base": {
        "model": {"hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "num_query_groups": 2,
                  "head_dim": 16, "moe_ffn_hidden_size": 64, "num_experts": 4, "max_seq_len": 64},
        "task": {"arithmetic": {"min_operands": 2, "max_operands": 2}, "format_reward": 0.1},
        "optim": {"lr": 1.0e-3},
        "train": {"sft_steps": 20, "sft_batch_size": 16, "sft_lr": 3.0e-3, "prompts_per_step": 2, "group_size": 4,
                  "minibatches": 2, "shuffle_minibatches": True, "max_new_tokens": 8, "eval_every": 0,
                  "eval_prompts": 4, "log_every": 100, "flip_probe_sequences": 2},
    },
    "dial_30": {"train": {"router_lr_mult": 30.0}},
    "dense": {"model": {"num_experts": 2, "moe_router_topk": 2}},
    "cells": {"moe-dial30": ["dial_30"], "dense-dial30": ["dense", "dial_30"]},
}  # fmt: skip
"The smoke's cells: design (b)'s two cells on the smoke presets' tiny policy and arithmetic (a seconds-long SFT)."


def smoke_plan(plan: dict) -> dict:
    """The plan at a tiny size: every arm, both sets, the gate and the SE rule, 3 states."""
    p = json.loads(json.dumps(plan))
    p["cell_plan_inline"] = SMOKE_CELLS
    p["states"].update(rl_steps=4, sets={"moe": {"cell": "moe-dial30", "seeds": [0], "every": 2},
                                         "dense": {"cell": "dense-dial30", "seeds": [1], "every": 4}})  # fmt: skip
    p["scoring"].update(minibatches=[2, 4], v_per_prompt=2, heldout=[2, 2])
    p["gate"].update(change_minibatches=[2, 8])
    p["se_rule"].update(doubled={"v_per_prompt": 4, "heldout": [2, 4]})
    return p


def device_overrides(device: str, dtype: str) -> list[str]:
    """The trainer's device and dtype as recipe overrides (``--device`` / ``--dtype``)."""
    import torch

    from moe_rl.errors import UserError

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here; run it on a GPU or give --device cpu")
    if dtype == "bfloat16" and device != "cuda":
        raise UserError("--dtype bfloat16 needs --device cuda (the trainer runs bf16 on CUDA only)")
    return [f"model.dtype={dtype}", f"parallel.backend={'nccl' if device == 'cuda' else 'gloo'}"]


def result_file(kind: str, preset: str) -> Path:
    from moe_rl.lab.results import commit, machine

    return RESULTS / f"{kind}-{machine()}-{preset}-{commit()}.json"


CALIBRATION_SIGMAS = (0.0, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15)


def calibrate(root: Path) -> Path:
    """The engine noise's calibration on the countdown start (two noisy forwards per sigma, 16
    prompts x 8: :func:`moe_rl.lab.calibrate.calibrate`), written under results/."""
    from moe_rl.config import load_recipe
    from moe_rl.lab import calibration as cal
    from moe_rl.lab.arms import ROOT as CHECKOUT

    recipe = load_recipe(
        CHECKOUT / "recipes" / "demo" / "dial_demo.yaml",
        [f"train.out_dir={root / 'calibrate'}", "train.flip_probe_sequences=0"],
    )
    table = cal.calibrate(recipe, CALIBRATION_SIGMAS, 16)
    print(cal.format_rows(table["rows"]))
    out = result_file("one_update", "calibrate-dial-start")
    doc = {
        "headline": {"reaches_r3": table["reaches_r3"], "rows": table["rows"]},
        "recipe": "recipes/demo/dial_demo.yaml",
        **table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, doc)
    cal.plot(table["rows"], out.with_suffix(".png"))
    return out


def command(args) -> int:
    import torch

    from moe_rl.lab.runner import ensure_parallel
    from studies.one_update import report

    torch.set_num_threads(args.threads)
    plan = load_plan()
    if args.write_plan:
        write_json(PLAN_FILE, plan_doc(plan), newline=True)
        print(PLAN_FILE)
        return 0
    root = args.root or ROOT
    overrides = device_overrides(args.device, args.dtype)
    ensure_parallel()
    if args.calibrate:
        print(calibrate(root))
        return 0
    preset = "countdown-dial30"
    if args.smoke:
        plan, preset = smoke_plan(plan), "smoke"
        plan["cache"] = str(root / "cache")
    plan["state_overrides"] = [*plan.get("state_overrides", []), *overrides]
    if args.states:
        print(json.dumps(states.generate(plan, root, Path(plan.get("cache") or states.CACHE)), indent=1))
        return 0
    if not args.report:
        sweep(plan, root, overrides)
    records, dec = finished_records(plan, root)
    out = args.out or (root / "one_update-smoke.json" if args.smoke else result_file("one_update", preset))
    meta = {
        "study": "one_update",
        "design": "e",
        "preset": preset,
        "plan": str(PLAN_FILE.name),
        "device": args.device,
        "dtype": args.dtype,
    }
    doc = report.write(records, dec, out, meta)
    print(json.dumps(doc["headline"], indent=1, default=str)[:4000])
    print(out)
    return 0
