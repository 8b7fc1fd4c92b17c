"""Train-inference mismatch per rollout precision (issue 13): how far the engine's own bf16 / fp16
copy of the weights drifts from the fp32 trainer, in log-probs and in expert routing.

From an SFT start (``moe_rl.lab.starts.warm_start``), for each model, rollout precision
(``rollout.dtype`` fp32 / bf16 / fp16), router precision (``rollout.router_dtype``: the engine's
own dtype, or fp32) and response length, the embedded engine samples a batch (temperature 1,
``ignore_eos``, so every response is exactly that long), and the trainer recomputes the same
tokens in fp32 with its own pi_old pass (``moe_rl.trainer.rl.old_policy_pass``). Per cell:

- the trainer's mismatch metrics (``moe_rl.losses.corrections.mismatch_metrics``): mean
  |log rho|, k3 of KL(pi_roll || pi_old), the share of tokens with |log rho| > ln 2, the
  largest |sum_t log rho_t| of a sequence;
- the rollout-vs-trainer flip rate per MoE layer and the token any-flip rate
  (``moe_rl.routing.flip``), the engine's routes against the trainer's natural top-k;
- the engine's generated tokens per CPU-second (one torch thread).

One cell is :func:`moe_rl.lab.mismatch.measure` (the GPU check measures CUDA kernels with it too).

Cells are cached as they finish under ``runs/bench_cache/mismatch/<preset>/`` (a rerun skips
them); the result is ``studies/mismatch/results/mismatch-<machine>-<preset>-<commit>.json`` + ``.png``
with a ``headline``.

    python -m studies.mismatch.mismatch --preset smoke|cpu
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from pathlib import Path

import torch

from moe_rl.argparsing import positive_int
from moe_rl.lab.arms import DEMO, flatten
from moe_rl.lab.mismatch import R3_PAPER, measure
from moe_rl.lab.results import commit, machine, result_path, write_json
from moe_rl.lab.starts import CACHE, SMOKE_BASE, warm_start
from studies.mismatch import RESULTS

warnings.filterwarnings("ignore")
log = logging.getLogger(__name__)

DEEP = {
    "num_layers": 12,
    "num_experts": 64,
    "moe_router_topk": 8,
    "moe_ffn_hidden_size": 32,  # 8 x 32 active expert width = the tiny policy's 2 x 128
}
"A deeper, finer-grained policy at the tiny one's active size."

PRESETS = {
    "smoke": {
        "models": {"smoke": {"model": SMOKE_BASE["model"], "sft": SMOKE_BASE}},
        "dtypes": ("fp32", "bf16"),
        "routers": ("same", "fp32"),
        "lengths": (8,),
        "prompts": 2,
        "group": 2,
    },
    "cpu": {
        "models": {
            "tiny": {"model": {"max_seq_len": 512}},
            "deep": {"model": {**DEEP, "max_seq_len": 512}},
        },
        "dtypes": ("fp32", "bf16", "fp16"),
        "routers": ("same", "fp32"),
        "lengths": (32, 128, 384),
        "prompts": 8,
        "group": 4,
    },
}


def cells(preset: dict) -> list[tuple[str, str, str, int]]:
    """(model, dtype, router, length) of every cell; fp32 with an fp32 router is fp32 itself."""
    return [
        (m, d, r, n)
        for m in preset["models"]
        for d in preset["dtypes"]
        for r in preset["routers"]
        if not (d == "fp32" and r == "fp32")
        for n in preset["lengths"]
    ]


def build_run(name: str, spec: dict, preset_name: str, cache: Path):
    """A trainer Run of ``spec``'s policy (SFT start loaded) whose own engine is not built."""
    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.trainer.run import Run

    sft_overrides = flatten({k: v for k, v in spec.get("sft", {}).items() if k != "model"})
    overrides = [*flatten({"model": spec["model"]}), *sft_overrides]
    ckpt, info = warm_start(DEMO, overrides, cache=cache)
    out = cache / "mismatch" / preset_name / name / "run"
    recipe = load_recipe(DEMO, [*overrides, "train.stages=[rl]", f"train.out_dir={out}"])
    run = Run(recipe)
    load_checkpoint(ckpt, run.policy.model, load_rng=False)
    return run, info


def run_cells(preset_name: str, cache: Path) -> dict:
    """Every cell of the preset, each saved under ``cache``/mismatch/<preset>/cells as it finishes
    (reruns skip them); SFT starts are cached under ``cache`` too."""
    preset = PRESETS[preset_name]
    cell_dir = cache / "mismatch" / preset_name / "cells"
    cell_dir.mkdir(parents=True, exist_ok=True)
    results, runs, sft = {}, {}, {}
    for model, dtype, router, length in cells(preset):
        key = f"{model}-{dtype}-{router}-{length}"
        path = cell_dir / f"{key}.json"
        if path.exists():
            results[key] = json.loads(path.read_text())
            continue
        if model not in runs:
            runs[model], sft[model] = build_run(model, preset["models"][model], preset_name, cache)
        log.info("cell %s", key)
        res = measure(runs[model], dtype, router, length, preset["prompts"], preset["group"])
        res.update(model=model, dtype=dtype, router=router, length=length)
        write_json(path, res)  # atomic itself
        results[key] = res
    return results


def headline(results: dict, preset: dict) -> dict:
    """Per model and precision at the longest length: router disagreement, any-flip, k3, extreme
    share; tokens/s per dtype (native router); and the R3 paper's figures for comparison."""
    longest = max(preset["lengths"])
    out = {"length": longest, "r3_paper": R3_PAPER}
    for r in results.values():
        if r["length"] != longest:
            continue
        cell = f"{r['model']}/{r['dtype']}" + ("" if r["router"] == "same" else "+fp32router")
        out[cell] = {
            "router_disagreement": r["flip/rate"],
            "token_any_flip": r["flip/token_any"],
            "k3": r["mismatch/k3"],
            "extreme_frac": r["mismatch/extreme_frac"],
            "abs_log_ratio": r["mismatch/abs_log_ratio"],
        }
        if r["router"] == "same":
            out[cell]["tokens_per_cpu_s"] = r["tokens_per_cpu_s"]
            layers = sum(1 for k in r if k.startswith("flip/layer_"))
            # per-layer any-flip held fixed, compounded over the R3 paper's 48 layers (an estimate)
            any_48 = 1 - (1 - r["flip/token_any"]) ** (48 / layers)
            out[cell]["vs_r3_paper"] = {
                "router_disagreement_ratio": r["flip/rate"] / R3_PAPER["router_disagreement"],
                "token_any_flip_ratio": r["flip/token_any"] / R3_PAPER["token_any_flip"],
                "token_any_flip_at_48_layers_est": any_48,
            }
    return out


def plot(results: dict, preset: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(preset["models"])
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    longest = max(preset["lengths"])
    for row, model in enumerate(models):
        ax_layer, ax_len, ax_k3 = axes[row]
        for r in results.values():
            if r["model"] != model or r["dtype"] == "fp32":
                continue
            label = f"{r['dtype']} router {'fp32' if r['router'] == 'fp32' else r['dtype']}"
            if r["length"] == longest:
                layers = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("flip/layer_"))
                ax_layer.plot(layers, [r[f"flip/layer_{i}"] for i in layers], marker="o", label=label)
        for dtype in preset["dtypes"]:
            for router in preset["routers"]:
                pts = sorted(
                    (r["length"], r["flip/rate"], r["flip/token_any"], r["mismatch/k3"])
                    for r in results.values()
                    if r["model"] == model and r["dtype"] == dtype and r["router"] == router
                )
                if not pts or dtype == "fp32":
                    continue
                label = f"{dtype} router {'fp32' if router == 'fp32' else dtype}"
                ax_len.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
                ax_k3.plot([p[0] for p in pts], [p[3] for p in pts], marker="o", label=label)
        ax_layer.set(title=f"{model}: rollout-vs-trainer flip per layer (len {longest})", xlabel="layer")
        ax_len.set(title=f"{model}: token any-flip vs length", xlabel="response tokens", xscale="log")
        ax_k3.set(
            title=f"{model}: mismatch k3 vs length", xlabel="response tokens", xscale="log", yscale="log"
        )
        for ax in (ax_layer, ax_len, ax_k3):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(
        "engine in its own precision vs the fp32 trainer, same tokens (R3 paper: ~10% router "
        "decisions, ~94% tokens differ on Qwen3-30B-A3B)"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads (1: tokens per CPU-second comparable)"
    )
    ap.add_argument("--out", default=None, help="result JSON path (default: the study's results/)")
    ap.add_argument("--cache", default=str(CACHE), help="SFT starts and finished cells (a rerun skips them)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    t0 = time.perf_counter()
    results = run_cells(args.preset, Path(args.cache))
    doc = {
        "benchmark": "mismatch",
        "preset": args.preset,
        "machine": machine(),
        "commit": commit(),
        "headline": headline(results, preset),
        "cells": results,
        "wall_s": time.perf_counter() - t0,
        "notes": "responses are forced to their length (ignore_eos); tokens/s at one torch thread",
    }
    path = result_path("mismatch", args.preset, args.out, folder=RESULTS)
    write_json(path, doc)
    plot(results, preset, path.with_suffix(".png"))
    print(json.dumps(doc["headline"], indent=1))
    return doc


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
