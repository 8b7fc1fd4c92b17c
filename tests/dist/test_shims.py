"""Each CPU shim is needed (leaving it out breaks the operation it exists for) and enough."""

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

PROBE = str(Path(__file__).with_name("shim_probe.py"))
# what a CUDA call without the shim raises: CPU torch's message, or a CUDA build's on a machine
# without a driver (PyPI's torch for Python 3.12 here, the lent GPU image's torch)
CPU_BUILD = torch.version.cuda is None
NO_CUDA = "Torch not compiled with CUDA enabled" if CPU_BUILD else "Found no NVIDIA driver on your system"
NO_STREAM = "torch.cuda.Stream requires CUDA support" if CPU_BUILD else "CUDA error: "
# megatron-core 0.19 defines moe_utils.te_general_gemm without transformer-engine (shims.py)
TE_GEMM_SHIM_NEEDED = tuple(int(x) for x in version("megatron-core").split(".")[:2]) < (0, 19)
pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shims apply only without CUDA"),
]


def probe(skip, op, nproc=1):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    launch = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    return subprocess.run([*launch, PROBE, skip, op], capture_output=True, text=True, timeout=180, env=env)


def test_all_shims_are_enough():
    res = probe("none", "checkpoint")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
    res = probe("none", "recompute")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
    res = probe("none", "optimizer")
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize(
    "shim, op, error",
    [
        ("current_device", "forward", NO_CUDA),
        ("streams", "forward", NO_STREAM),
        # only megatron's DotProductAttention builds the mask; our SDPAttention passes is_causal
        ("causal_mask", "stock_forward", NO_CUDA),
        ("rng", "recompute", NO_CUDA),
        ("synchronize", "checkpoint", NO_CUDA),
        # megatron-core's optimizer makes tensors on "cuda" and checks param.type() for torch.cuda types
        ("cuda_as_cpu", "optimizer", NO_CUDA),
        # torch's Adam keeps a per-parameter "step" the distributed optimizer's loader does not expect
        ("distopt_adam_step", "optimizer", "KeyError: 'step'"),
    ],
)
def test_each_shim_is_needed(shim, op, error):
    res = probe(shim, op)
    assert res.returncode != 0, f"{shim} was not needed for {op}"
    assert error in res.stderr, res.stderr[-3000:]


def test_te_general_gemm_shim_is_needed_before_megatron_core_0_19():
    """0.16: router gating raises NameError without the shim; 0.19 defines the name itself (the
    shim then changes nothing, and the forward runs without it)."""
    res = probe("te_general_gemm", "forward")
    if TE_GEMM_SHIM_NEEDED:
        assert res.returncode != 0, "te_general_gemm was not needed for forward"
        assert "te_general_gemm" in res.stderr, res.stderr[-3000:]
    else:
        assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_alltoall_splits_shim_is_needed_under_ep2():
    ok = probe("none", "ep2", nproc=2)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr[-3000:]
    res = probe("alltoall_splits", "ep2", nproc=2)
    assert res.returncode != 0, "alltoall_splits was not needed under EP=2"
    assert "Split sizes" in res.stderr or "split" in res.stderr.lower(), res.stderr[-3000:]
