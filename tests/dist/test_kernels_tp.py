"""TP=2 vocab-parallel fused log-probs equal the single-process result (dist tier, CPU, gloo).

This file is also the worker: ``python test_kernels_tp.py --out DIR`` computes on one process
(group None, the whole vocabulary); under torchrun with two processes each rank holds half
of the output-layer rows (151 each: not a multiple of the kernel's vocab tile) and reduces
max / sum-exp / target logit / E[z] over an explicit gloo group. Inputs come from a fixed seed
identical on every rank; targets fall in both shards. The Triton kernel runs under
TRITON_INTERPRET=1; the chunked torch reference is checked the same way. The test compares
log-probs, entropy, the all-reduced gradient of the hidden states and every rank's weight
gradient rows with the single-process run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
N, H, V = 37, 40, 302
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
CASES = {"f32-T0.7": (torch.float32, 0.7), "bf16-T1": (torch.bfloat16, 1.0)}


def worker(out: Path) -> None:
    import torch.distributed as dist

    from moe_rl import dist as moe_dist
    from moe_rl.kernels.fused_logprob import fused_logprobs
    from moe_rl.kernels.hidden_logprob_reference import hidden_logprobs_entropy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    group, rank = None, 0
    if world > 1:
        dist.init_process_group("gloo")
        rank = moe_dist.rank()
        group = moe_dist.new_group(range(world))
    shard = V // world
    rows = slice(rank * shard, (rank + 1) * shard)
    results = {}
    for case, (dtype, temp) in CASES.items():
        g = torch.Generator().manual_seed(7)
        hidden = torch.randn(N, H, generator=g).to(dtype)
        weight = (torch.randn(V, H, generator=g) * 3 / H**0.5).to(dtype)
        target = torch.randint(0, V, (N,), generator=g)
        g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
        for impl, fn in (("kernel", fused_logprobs), ("torch", hidden_logprobs_entropy)):
            h = hidden.clone().requires_grad_()
            w = weight[rows].clone().requires_grad_()
            kw = {"num_splits": 2} if impl == "kernel" else {}
            logp, ent = fn(
                h,
                w,
                target,
                temperature=temp,
                group=group,
                vocab_start=rows.start,
                with_entropy=True,
                vocab_chunk=64,
                **kw,
            )
            ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
            dh = h.grad.float()
            if group is not None:  # the caller's job under TP, as for a column-parallel layer
                dist.all_reduce(dh, group=group)
            results[case, impl] = {
                "logp": logp.detach(),
                "entropy": ent.detach(),
                "dh": dh,
                "dw": w.grad.float(),
                "rows": (rows.start, rows.stop),
            }
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{rank}.pt")
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()


def run(out: Path, nproc: int) -> None:
    me = str(Path(__file__).resolve())
    if nproc == 1:
        cmd = [sys.executable, me, "--out", str(out)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            me,
            "--out",
            str(out),
        ]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


def test_tp2_vocab_parallel_matches_single_process(tmp_path):
    pytest.importorskip("triton")
    run(tmp_path / "tp1", 1)
    run(tmp_path / "tp2", 2)
    single = torch.load(tmp_path / "tp1" / "rank0.pt")
    ranks = [torch.load(tmp_path / "tp2" / f"rank{r}.pt") for r in range(2)]
    eps32 = torch.finfo(torch.float32).eps
    for key, ref in single.items():
        dtype = CASES[key[0]][0]
        # same math, different partition of the vocab sums: errors of the unit tier's size
        value_tol = 64 * eps32 * 30  # |logits / T| < 30 here
        grad_units = 256 * eps32 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
        dw_parts = []
        for res in ranks:
            got = res[key]
            for name in ("logp", "entropy"):
                torch.testing.assert_close(got[name], ref[name], atol=value_tol, rtol=0, msg=f"{key} {name}")
            torch.testing.assert_close(
                got["dh"], ref["dh"], atol=grad_units * ref["dh"].abs().max(), rtol=0, msg=f"{key} dh"
            )
            dw_parts.append((got["rows"], got["dw"]))
        dw = torch.cat([d for _, d in sorted(dw_parts, key=lambda x: x[0])])
        assert [r for r, _ in sorted(dw_parts, key=lambda x: x[0])] == [(0, 151), (151, 302)]
        torch.testing.assert_close(
            dw, ref["dw"], atol=grad_units * ref["dw"].abs().max(), rtol=0, msg=f"{key} dw"
        )


if __name__ == "__main__":
    import argparse

    os.environ["TRITON_INTERPRET"] = "1"
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    worker(ap.parse_args().out)
