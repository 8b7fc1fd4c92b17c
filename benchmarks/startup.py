"""Model build time of one rank of the 30B recipe, with and without ``model.hf_path`` (issue 27).

With ``model.hf_path`` the HF import fills every parameter, so the build draws no random weights
(``perform_initialization=False``); without it megatron-core initialises every weight on the CPU,
drawing each tensor-parallel weight in full on every rank. One rank of
``recipes/cluster/qwen3_30b_a3b_grpo.yaml`` (TP 2, EP 16) is built in a world of one: attention,
embedding and output layer at full size (CPU initialisation draws them whole on each rank anyway),
experts at the rank's count (128 / 16 = 8). A 48-layer model does not fit this machine, so the
build is timed at 1 and ``--layers`` layers (best CPU time of ``--repeats``) and extrapolated
linearly to the recipe's depth. Only the build is timed, not the import (which reads the files).

    python -m benchmarks.startup [--layers 7] [--repeats 3]     # about 2 minutes on 2 cores

Writes ``benchmarks/results/startup-<machine>-30b-rank-<commit>.json`` + ``.png``, with a
``headline``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.common import result_path
from moe_rl.lab.results import write_json

RECIPE = Path(__file__).resolve().parents[1] / "recipes/cluster/qwen3_30b_a3b_grpo.yaml"


def build_seconds(model_cfg, repeats: int) -> tuple[float, int]:
    """Best CPU seconds of ``repeats`` builds of ``model_cfg`` (world of one), and its parameters."""
    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.model import build_gpt

    best, params = float("inf"), 0
    for _ in range(repeats):
        gc.collect()
        torch.manual_seed(0)
        t0 = time.process_time()
        model = build_gpt(model_cfg, ParallelConfig())
        best = min(best, time.process_time() - t0)
        params = sum(p.numel() for p in model.parameters())
        del model
    return best, params


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=7, help="the deeper of the two timed builds")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    from moe_rl.config import ParallelConfig, load_recipe
    from moe_rl.megatron.parallel import init_parallel

    recipe = load_recipe(RECIPE)
    init_parallel(ParallelConfig(), seed=1)
    local_experts = recipe.model.num_experts // recipe.parallel.expert_parallel
    depth = recipe.model.num_layers
    res: dict = {"recipe": str(RECIPE.name), "local_experts": local_experts, "depth": depth, "runs": {}}
    for label, hf_path in (("random_init", None), ("hf_path", "unread-by-the-build")):
        times = {}
        for layers in (1, a.layers):
            cfg = dataclasses.replace(
                recipe.model, num_layers=layers, num_experts=local_experts, hf_path=hf_path
            )
            seconds, params = build_seconds(cfg, a.repeats)
            times[layers] = {"cpu_s": seconds, "params": params}
            print(
                f"{label}: {layers} layers, {params / 1e6:.1f}M parameters, {seconds:.2f} CPU-s", flush=True
            )
        per_layer = (times[a.layers]["cpu_s"] - times[1]["cpu_s"]) / (a.layers - 1)
        rest = times[1]["cpu_s"] - per_layer
        res["runs"][label] = {
            "timed": times,
            "per_layer_cpu_s": per_layer,
            "extrapolated_cpu_s": rest + depth * per_layer,
        }
    r = res["runs"]
    res = {
        "headline": {
            "build_cpu_s_random_init": r["random_init"]["extrapolated_cpu_s"],
            "build_cpu_s_hf_path": r["hf_path"]["extrapolated_cpu_s"],
            "per_layer_cpu_s_random_init": r["random_init"]["per_layer_cpu_s"],
            "per_layer_cpu_s_hf_path": r["hf_path"]["per_layer_cpu_s"],
        },
        **res,
    }
    path = result_path("startup", "30b-rank", a.out)
    write_json(path, res)  # atomic itself
    _plot(res, path.with_suffix(".png"))
    print(json.dumps(res["headline"], indent=1))
    return res


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = res["headline"]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = ["random init (no hf_path)", "model.hf_path set"]
    vals = [h["build_cpu_s_random_init"], h["build_cpu_s_hf_path"]]
    ax.bar(labels, vals, color=["C7", "C0"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f} s", ha="center", va="bottom")
    ax.set_ylabel(f"model build, CPU-s ({res['depth']} layers, extrapolated)")
    ax.set_title(f"one rank of {res['recipe']} ({res['local_experts']} local experts)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
