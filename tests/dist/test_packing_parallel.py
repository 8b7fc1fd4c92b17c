"""Packed sequences under EP=2 and TP=2 (sequence parallelism: the pack, not the rows, is padded
to a multiple of TP) give the single process's padded log-probs, entropy, loss, every gradient,
routes, and replay of recorded routes under another packing (dist tier)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.test_parallel_equivalence import check_grads

pytestmark = pytest.mark.dist
WORKER = str(Path(__file__).with_name("packing_worker.py"))
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run(args, nproc=1, timeout=240):
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    res = subprocess.run([*launcher, WORKER, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    run(["--save-init", str(d / "ckpt"), "--out", str(d / "out")])  # world 1, padded
    return d, torch.load(d / "out" / "rank0.pt", weights_only=False)


@pytest.mark.parametrize("layout", [("--ep", "2", "--dp", "2"), ("--tp", "2")])
def test_packed_layout_matches_padded_single_process(reference, tmp_path, layout):
    d, ref = reference
    run([*layout, "--packed", "--load", str(d / "ckpt"), "--out", str(tmp_path / "out")], nproc=2)
    results = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    valid = ref["logp"][:, 1:] != 0
    for res in results:
        for k in ("logp", "entropy", "replayed"):
            torch.testing.assert_close(res[k], ref[k], atol=1e-5, rtol=0, msg=k)
        torch.testing.assert_close(res["loss"], ref["loss"], atol=1e-6, rtol=1e-6)
        for k in ("natural", "recorded"):
            assert torch.equal(res[k][valid], ref[k][valid]), k
    check_grads(ref["grads"], results)
