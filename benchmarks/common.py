"""Shared presets and helpers of the benchmarks: the tiny policy, the smoke presets' policy, result
file names by machine, preset and commit. Running, SFT starts and the arms are :mod:`moe_rl.lab`'s."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

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

SMOKE_BASE = {
    "model": {
        "hidden_size": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "head_dim": 16,
        "moe_ffn_hidden_size": 64,
        "num_experts": 4,
        "max_seq_len": 64,
    },
    "task": {"arithmetic": {"min_operands": 2, "max_operands": 2}, "format_reward": 0.1},
    "train": {
        "sft_steps": 60,
        "sft_batch_size": 16,
        "sft_lr": 3e-3,
        "prompts_per_step": 4,
        "group_size": 4,
        "minibatches": 2,
        "max_new_tokens": 12,
        "log_every": 100,
    },
}
"The smoke presets' policy and task on top of recipes/demo/base.yaml: a seconds-long SFT start."


def machine() -> str:
    """A short machine name: the GPU model when CUDA is present, else CPU count and arch."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
    except Exception:
        pass
    return f"cpu{os.cpu_count()}-{platform.machine()}"


def commit() -> str:
    """The checkout's short commit (with -dirty when files changed), or 'nocommit'."""
    try:
        root = Path(__file__).resolve().parents[1]
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "nocommit"


def result_path(bench: str, preset: str, out: str | None = None, suffix: str = ".json") -> Path:
    """benchmarks/results/<bench>-<machine>-<preset>-<commit><suffix> (or ``out``)."""
    if out:
        p = Path(out)
    else:
        p = RESULTS / f"{bench}-{machine()}-{preset}-{commit()}{suffix}"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


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


def int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (a count of jobs, seeds, steps, threads: 1; warm-up
    steps: 0)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
