"""Shared presets and helpers of the benchmarks: the tiny policy, result file names in
benchmarks/results/ (by machine, preset and commit: :mod:`moe_rl.lab.results`), the host's GEMM
rate. Running, SFT starts and the arms are :mod:`moe_rl.lab`'s."""

from __future__ import annotations

from pathlib import Path

from moe_rl.argparsing import non_negative_int as non_negative_int  # the benchmarks' count flags
from moe_rl.argparsing import positive_int as positive_int
from moe_rl.lab import results
from moe_rl.lab.results import commit as commit  # results are named by these
from moe_rl.lab.results import machine as machine

RESULTS = Path(__file__).resolve().parent / "results"


def _tiny_model() -> dict:
    """The sizes of the default policy: ``ModelConfig``'s architecture fields that are integers."""
    from moe_rl.config import ModelConfig
    from moe_rl.megatron.hf_mapping import ARCH_FIELDS

    default = ModelConfig()
    sizes = {k: getattr(default, k) for k in ARCH_FIELDS if type(getattr(default, k)) is int}
    return {**sizes, "max_seq_len": 512}


TINY_MODEL = _tiny_model()
"""The tiny CPU policy the issues measure: ``ModelConfig``'s defaults, the demo's policy (hidden
128, 4 layers, 8 experts top-2, char vocab 104), with room for 512 positions."""


def result_path(bench: str, preset: str, out: str | None = None, suffix: str = ".json") -> Path:
    """benchmarks/results/<bench>-<machine>-<preset>-<commit><suffix> (or ``out``)."""
    return results.result_path(bench, preset, out, suffix, folder=RESULTS)


def round_order(sides, r: int) -> list:
    """The sides of paired round ``r`` (from 0) in the order they run: as given in even rounds,
    reversed in odd ones, so that a drift of the machine over the rounds falls on every side alike."""
    return list(sides) if r % 2 == 0 else list(sides)[::-1]


def matmul_rate(dev, n: int, dtype, reps: int = 10) -> float:
    """flop/s of an n^3 ``torch.mm`` (CUDA events on CUDA, the wall clock on CPU), mean of ``reps``."""
    import time

    import torch

    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        seconds = time.perf_counter() - t0
    return 2 * n**3 * reps / seconds


def gemm_rate(device, dtype, shapes=((1024, 1024, 1024),), reps: int = 5) -> dict:
    """The best measured dense GEMM rate (flop/s) of this process over ``shapes`` (n, k, m)."""
    import time

    import torch

    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    best = {"flops_per_s": 0.0, "dtype": str(dtype).replace("torch.", "")}
    for n, k, m in shapes:
        a = torch.randn(n, k, device=dev, dtype=dtype)
        b = torch.randn(k, m, device=dev, dtype=dtype)
        for _ in range(2):
            torch.mm(a, b)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        rate = 2 * n * k * m * reps / (time.perf_counter() - t0)
        if rate > best["flops_per_s"]:
            best.update(flops_per_s=rate, shape=[n, k, m])
    return best
