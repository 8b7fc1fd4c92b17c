"""Seconds per training step of the tiny policy at world 1, EP=2 and TP=2 (issue 2's figures).

Tiny policy: hidden 128, 4 layers, 8 experts top-2, fp32; batch 8 x seq 128 random tokens;
a step is log-prob forward, backward of the mean NLL, gradient sync and AdamW. Median of
``--steps`` steps after ``--warmup``. Each layout runs in its own torchrun job.

    python -m benchmarks.step_time [--steps 20] [--threads 1]

Writes benchmarks/results/step_time-<machine>-tiny-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAYOUTS = {"world1": [], "ep2": ["--ep", "2", "--dp", "2"], "tp2": ["--tp", "2"]}


def worker(argv) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import torch

    from moe_rl.config import ModelConfig, OptimConfig, ParallelConfig
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import destroy_parallel, init_parallel
    from moe_rl.megatron.policy import build_policy

    par = ParallelConfig(tensor_parallel=a.tp, expert_parallel=a.ep, data_parallel=a.dp)
    info = init_parallel(par, seed=0)
    policy = build_policy(ModelConfig(), par, info)
    opt = Optimizer(policy.model, OptimConfig(lr=1e-4), info)
    tokens = torch.randint(0, 104, (8, 129), generator=torch.Generator().manual_seed(0))
    rows = 8 // info.dp_size
    mine = tokens[info.dp_rank * rows : (info.dp_rank + 1) * rows]
    times = []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        loss = -policy.logprobs(mine).logp_BT[:, 1:].sum() / (8 * 128)
        loss.backward()
        opt.step()
        torch.distributed.barrier()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    if info.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"median_s": statistics.median(times), "min_s": min(times), "steps": len(times)}, f)
    destroy_parallel()


def main(argv=None) -> dict:
    from benchmarks.common import result_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    a = ap.parse_args(argv)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(a.threads)}
    res = {
        "model": "hidden 128, 4 layers, 8 experts top-2, fp32",
        "batch": 8,
        "seq": 128,
        "threads_per_process": a.threads,
        "layouts": {},
    }
    for name, args in LAYOUTS.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            launch = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={1 if not args else 2}",
            ]
            subprocess.run(
                [
                    *launch,
                    "-m",
                    "benchmarks.step_time",
                    "--worker",
                    *args,
                    "--steps",
                    str(a.steps),
                    "--out",
                    f.name,
                ],
                check=True,
                env=env,
            )
            res["layouts"][name] = json.load(open(f.name))
        print(name, res["layouts"][name])
    code = (
        "import sys, time; t = time.perf_counter(); import moe_rl, moe_rl.config; "
        "print(time.perf_counter() - t, 'megatron' in sys.modules)"
    )
    secs, megatron = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    res["import_moe_rl_s"] = float(secs)
    res["import_moe_rl_loads_megatron"] = megatron == "True"
    path = result_path("step_time", "tiny")
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        worker(sys.argv[1:])
    else:
        main()
