"""CPU seconds from a fresh interpreter to the policy's first training pass, with megatron-core's
import-time ``torch.compile`` deferred (moe_rl/megatron/deferred_compile.py) and as megatron-core
does it.

Every rank and every ``moe-rl`` command pays this before its first step. Each round starts two
children, alternating which goes first: one imports ``moe_rl.megatron`` before megatron-core (as
every moe-rl module does: the import hook defers the compile), the other imports megatron-core
first (its own ``torch.compile`` at import, as before the hook). Each child times (CPU seconds,
one thread) its imports (megatron-core, the trainer, the checkpoint code), then a world of one, the
tiny policy's build and one forward and backward, and says whether dynamo and inductor were loaded (after the imports and
after the pass) and whether the routers' compiled ``_apply_expert_bias`` is the deferred one
(tests/integration/test_deferred_compile.py asserts these of both orders).

    python -m benchmarks.process_start [--rounds 5]     # about a minute on 2 cores

Writes ``benchmarks/results/process_start-<machine>-tiny-<commit>.json`` + ``.png``, with a
``headline`` (medians over the rounds): ``cpu_s_<order>`` a child's whole CPU seconds (user + system,
interpreter start and exit included), ``import_cpu_s_<order>``, ``first_pass_cpu_s_<order>``, and
``stock_over_deferred_cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import result_path
from moe_rl.lab.results import write_json

ROOT = Path(__file__).resolve().parents[1]
ORDERS = {"deferred": "import moe_rl.megatron", "stock": "import megatron.core"}
"What each child imports first."
CHILD = """
import time
t0 = time.process_time()
{first}
import json, sys
import megatron.core
import moe_rl.trainer.run, moe_rl.megatron.checkpoint
from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.megatron.parallel import init_parallel
from moe_rl.megatron.policy import build_policy
import torch
from megatron.core.transformer.moe.router import TopKRouter
t1 = time.process_time()
LOADED = lambda: [m for m in ("torch._dynamo", "torch._inductor.compile_fx") if m in sys.modules]
loaded = LOADED()
info = init_parallel(ParallelConfig(), seed=1)
policy = build_policy(ModelConfig(), ParallelConfig(), info)
policy.logits(torch.randint(0, 100, (2, 33))).float().square().mean().backward()
t2 = time.process_time()
print(json.dumps({{
    "import_cpu_s": t1 - t0, "first_pass_cpu_s": t2 - t1, "loaded_at_import": loaded, "loaded_after_pass": LOADED(),
    "router_compile_deferred": hasattr(TopKRouter._apply_expert_bias, "deferred_compile"),
    "megatron_core": megatron.core.__version__,
}}))
"""


def child(order: str) -> dict:
    """One fresh interpreter's CPU seconds (its own, from its first import: the imports, then the
    world, build and pass), its whole CPU seconds (user + system, interpreter start and exit
    included) and its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(
        [sys.executable, "-c", CHILD.format(first=ORDERS[order])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if res.returncode:
        raise RuntimeError(f"{order} child failed: {res.stderr[-2000:]}")
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "cpu_s": cpu, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (each: one child per order)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {k: [] for k in ORDERS}
    for r in range(a.rounds):
        for order in list(ORDERS)[:: 1 if r % 2 == 0 else -1]:
            runs[order].append(child(order))
            print(f"round {r}: {order} {runs[order][-1]}", flush=True)

    def med(order: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[order])

    keys = ("cpu_s", "import_cpu_s", "first_pass_cpu_s", "wall_s")
    headline = {f"{key}_{order}": med(order, key) for key in keys for order in ORDERS}
    headline["saved_cpu_s_per_process"] = headline["cpu_s_stock"] - headline["cpu_s_deferred"]
    headline["stock_over_deferred_cpu"] = headline["cpu_s_stock"] / headline["cpu_s_deferred"]
    headline["loaded_at_import_deferred"] = runs["deferred"][0]["loaded_at_import"]
    headline["loaded_at_import_stock"] = runs["stock"][0]["loaded_at_import"]
    res = {"headline": headline, "rounds": a.rounds, "python": sys.version.split()[0], "runs": runs}
    res["megatron_core"] = runs["deferred"][0]["megatron_core"]  # as the children imported it
    path = result_path("process_start", "tiny", a.out)
    write_json(path, res)  # atomic itself
    _plot(res, path.with_suffix(".png"))
    print(json.dumps(headline, indent=1))
    return res


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = res["headline"]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = list(ORDERS)
    imports = [h[f"import_cpu_s_{o}"] for o in labels]
    passes = [h[f"first_pass_cpu_s_{o}"] for o in labels]
    rest = [h[f"cpu_s_{o}"] - i - p for o, i, p in zip(labels, imports, passes)]
    ax.bar(labels, rest, color="C7", label="interpreter start and exit")
    ax.bar(labels, imports, bottom=rest, color="C0", label="imports")
    ax.bar(
        labels, passes, bottom=[r + i for r, i in zip(rest, imports)], color="C1", label="build + first pass"
    )
    for i, o in enumerate(labels):
        ax.text(i, h[f"cpu_s_{o}"], f"{h[f'cpu_s_{o}']:.2f} s", ha="center", va="bottom")
    ax.set_ylabel(f"CPU seconds (median of {res['rounds']} fresh processes)")
    ax.set_title(f"fresh process to first training pass, megatron-core {res['megatron_core']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
