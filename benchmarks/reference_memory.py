"""What the KL term's reference policy costs in memory, held the two ways issue 49 names (item 10):
a second policy of the same layout (``Policy.replica``, the way the embedded engine holds a rollout
copy), or a copy of the policy's weights swapped into it for the reference's forward
(``moe_rl.trainer.reference.Reference``, what the trainer does).

Each way is measured in a fresh process (so one does not reuse memory the other freed): the
resident set size (RSS, psutil) before and after the reference is made, and the bytes of the
tensors it holds; plus the seconds of one swap in and out. Two policies: the demo's (hidden 128,
4 layers, 8 experts) and a wider one (hidden 512, 8 layers, 16 experts of 512).

    python -m benchmarks.reference_memory          # about a minute on 2 cores

Writes ``benchmarks/results/reference_memory-<machine>-cpu-<commit>.json`` with a ``headline``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import result_path

SIZES = {
    "demo": {},
    "wide": {
        "hidden_size": 512,
        "num_layers": 8,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "head_dim": 64,
        "moe_ffn_hidden_size": 512,
        "num_experts": 16,
    },
}
"The policies measured: ModelConfig's defaults (the demo's), and a wider one."


def measure(size: str, how: str) -> dict:
    """In this process: build the policy ``size``, then its reference ``how`` (``swap`` | ``replica``)."""
    import gc
    import time

    import psutil
    import torch

    from moe_rl.config import ModelConfig, ParallelConfig
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy
    from moe_rl.trainer.reference import Reference

    torch.set_num_threads(1)
    info = init_parallel(ParallelConfig(), seed=0)
    policy = build_policy(ModelConfig(**SIZES[size]), ParallelConfig(), info)
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    gc.collect()
    proc = psutil.Process()
    before = proc.memory_info().rss
    if how == "swap":
        ref = Reference.snapshot(policy)
        held = ref.nbytes
        t0 = time.perf_counter()
        for _ in range(10):
            with ref.swapped_into(policy):
                pass
        swap_s = (time.perf_counter() - t0) / 10
    else:
        ref = policy.replica(torch.float32, router_fp32=False)
        held = sum(t.numel() * t.element_size() for t in (*ref.model.parameters(), *ref.model.buffers()))
        swap_s = None
    gc.collect()
    return {
        "size": size,
        "how": how,
        "policy_weight_bytes": weights,
        "rss_delta_bytes": proc.memory_info().rss - before,
        "tensor_bytes_held": held,
        "swap_in_and_out_s": swap_s,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, metavar=("SIZE", "HOW"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(*a.one)))
        return {}
    rows = []
    for size in SIZES:
        for how in ("swap", "replica"):
            cmd = [sys.executable, "-m", "benchmarks.reference_memory", "--one", size, how]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_quiet_env()).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"{size:5s} {how:8s} weights {r['policy_weight_bytes'] / 1e6:8.1f} MB  "
                f"RSS +{r['rss_delta_bytes'] / 1e6:8.1f} MB  tensors held {r['tensor_bytes_held'] / 1e6:8.1f} MB"
                + (f"  swap in+out {r['swap_in_and_out_s'] * 1e3:.2f} ms" if r["swap_in_and_out_s"] else "")
            )
    by = {(r["size"], r["how"]): r for r in rows}
    headline = {
        size: {
            "swap_rss_mb": by[size, "swap"]["rss_delta_bytes"] / 1e6,
            "replica_rss_mb": by[size, "replica"]["rss_delta_bytes"] / 1e6,
            "weights_mb": by[size, "swap"]["policy_weight_bytes"] / 1e6,
            "replica_over_swap": by[size, "replica"]["rss_delta_bytes"]
            / max(by[size, "swap"]["rss_delta_bytes"], 1),
        }
        for size in SIZES
    }
    headline["chosen"] = "swap" if all(h["replica_over_swap"] > 1 for h in headline.values()) else "replica"
    doc = {"headline": headline, "rows": rows, "command": "python -m benchmarks.reference_memory"}
    path = result_path("reference_memory", "cpu", a.out)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"chosen: {headline['chosen']}; {path}")
    return doc


def _quiet_env() -> dict:
    import os

    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


if __name__ == "__main__":
    main()
