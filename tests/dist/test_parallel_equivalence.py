"""EP=2 and TP=2 give the same log-probs, loss, gradients and routing as one process (dist tier).

One process saves the tiny policy; two-process runs load it (resharding 1 -> EP=2 and
1 -> TP=2) and must reproduce the single-process log-probs, entropy, loss, every
gradient element (compared by global offset) and the log-probs after one AdamW step.
An EP=2 checkpoint saved after the step loads back into one process exactly.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
WORKER = str(Path(__file__).with_name("worker.py"))
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run(args, nproc=1, timeout=240):
    if nproc == 1:
        cmd = [sys.executable, WORKER, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            WORKER,
            *args,
        ]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    run(["--save-init", str(d / "ckpt"), "--out", str(d / "out")])
    return d, torch.load(d / "out" / "rank0.pt", weights_only=False)


def check_grads(ref_grads, rank_results):
    seen = set()
    for res in rank_results:
        for key, (offset, g) in res["grads"].items():
            rg = ref_grads[key][1]
            idx = tuple(slice(o, o + n) for o, n in zip(offset, g.shape))
            torch.testing.assert_close(g, rg[idx], atol=1e-5, rtol=1e-4, msg=key)
            seen.add(key)
    assert seen == set(ref_grads), set(ref_grads) ^ seen


@pytest.mark.parametrize(
    "layout",
    [
        ("--ep", "2", "--dp", "2"),
        ("--tp", "2"),
        ("--tp", "2", "--logprob-impl", "torch", "--recompute"),  # vocab-chunked path + recompute
    ],
)
def test_layout_matches_single_process(reference, tmp_path, layout):
    d, ref = reference
    save_after = tmp_path / "after"
    run(
        [*layout, "--load", str(d / "ckpt"), "--out", str(tmp_path / "out"), "--save-after", str(save_after)],
        nproc=2,
    )
    results = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for res in results:
        torch.testing.assert_close(res["logp"], ref["logp"], atol=1e-5, rtol=0)
        torch.testing.assert_close(res["entropy"], ref["entropy"], atol=1e-5, rtol=0)
        torch.testing.assert_close(res["grad_norm"], ref["grad_norm"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["after"], ref["after"], atol=1e-4, rtol=0)
    if "--dp" not in layout:  # TP ranks see the whole batch
        torch.testing.assert_close(results[0]["loss"], ref["loss"], atol=1e-6, rtol=1e-6)
    else:  # data-parallel ranks each hold a share with global denominators
        torch.testing.assert_close(results[0]["loss"] + results[1]["loss"], ref["loss"], atol=1e-6, rtol=1e-6)
    check_grads(ref["grads"], results)
    # the embedded engine: both forwards reproduce the single process's greedy rollouts
    for res in results if "--ep" in layout else ():
        for decoder in ("lean", "megatron"):
            got, want = res["gen"][decoder], ref["gen"]["lean"]
            assert torch.equal(got["tokens"], want["tokens"]), decoder
            assert torch.equal(got["routes"], want["routes"]), decoder
            torch.testing.assert_close(got["logp"], want["logp"], atol=1e-5, rtol=0)
    # routing: recorded routes, replay after a router perturbation, and the flip rate of the
    # perturbed router's natural choice equal the single-process values
    for res in results:
        assert torch.equal(res["recorded"], ref["recorded"])
        assert torch.equal(res["natural_after_perturb"], ref["natural_after_perturb"])
        torch.testing.assert_close(res["replayed_logp"], ref["replayed_logp"], atol=1e-5, rtol=0)
        assert res["flips"] == pytest.approx(ref["flips"], abs=1e-9)
    assert ref["flips"]["flip/rate"] > 0.05  # the perturbation does move the natural routes
    # back to one process: the two-process checkpoint reproduces the post-step log-probs
    run(["--load", str(save_after), "--out", str(tmp_path / "back")])
    back = torch.load(tmp_path / "back" / "rank0.pt", weights_only=False)
    torch.testing.assert_close(back["logp"], results[0]["after"], atol=1e-5, rtol=0)
