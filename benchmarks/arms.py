"""Shared arm-running helpers of the benchmarks (volatility, collapse).

An *arm* is a base recipe plus ``section.field=value`` overrides, exactly what ``moe-rl train``
takes, so the same arm runs in this process on a laptop or through a launcher on a cluster
(``launch/torchrun.sh``, ``sbatch --wait launch/slurm.sbatch``) with the recipe file unchanged.

- :func:`flatten` (from ``moe_rl.trainer.arms``, with the arms themselves) turns a preset's
  nested settings into override strings;
- :func:`warm_start` trains the SFT start of an architecture once and caches it under
  ``runs/bench_cache/<hash>/`` (the hash covers everything SFT reads: model, task knobs, SFT
  steps, batch, LR, seed, optimizer), and reuses a finished ``runs/demo/sft`` whose recipe
  matches;
- :func:`run_arm` runs one RL arm from a start, in process or launched, and notes how it ended;
- :func:`read_arm` reads an arm's metrics back (``moe_rl.trainer.report.load_arm``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.trainer.arms import ARMS, flatten, yaml_value

if TYPE_CHECKING:
    from moe_rl.config import Recipe

__all__ = ["ARMS", "flatten", "yaml_value"]  # the arms live in the library: one definition

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
"The repository (recipes and runs are found from here, whatever the working directory)."
DEMO = ROOT / "recipes" / "demo" / "base.yaml"
"The tiny policy and arithmetic task every CPU preset starts from."
CACHE = ROOT / "runs" / "bench_cache"
"Where SFT starts are cached, one directory per SFT signature."
REUSABLE_SFT = (ROOT / "runs" / "demo" / "sft",)
"Finished SFT runs (recipe.yaml + checkpoints/) reused when their SFT signature matches."
SHIPPED_STARTS = (ROOT / "recipes" / "demo" / "start.json",)
"""SFT starts shipped in the repository as HF safetensors (fp32, so the weights are the cached
checkpoint's bit for bit): each JSON names its ``sft_key`` and its files' sha256; a recipe of that
key starts from the folder beside it (``model.hf_path``) instead of training the start again."""
SFT_CHECKPOINT_EVERY = 100
"""An SFT start saves every this many steps: a stopped or killed one resumes where it was (an
uninterrupted one and a resumed one give the same weights: tests/unit/test_bench_arms.py)."""
ARM_CHECKPOINT_EVERY = 10
"""An RL arm saves every this many steps (unless its overrides say otherwise), so that a killed
one resumes (:func:`run_arm`); saving does not change the run (tests/unit/test_bench_arms.py)."""
SFT_TRAIN_KEYS = ("seed", "sft_steps", "sft_batch_size", "sft_lr")
"The train fields the SFT stage reads (the rest of train is RL only)."

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


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (comparable on a shared machine).
    The children's share counts every child reaped in between, those of concurrent runs too: a
    run in a child process is timed by :func:`run_child` instead."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_child(cmd: list[str], env: dict | None = None) -> float:
    """``subprocess.run(cmd, check=True)``, returning the CPU seconds of that child and of the
    descendants it waited for: its own ``wait4`` resource usage, which runs going on beside it in
    other threads do not enter (as they enter :func:`cpu_seconds`)."""
    proc = subprocess.Popen(cmd, env=env)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # interrupted: do not leave the child running
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return usage.ru_utime + usage.ru_stime


# -- SFT warm starts -----------------------------------------------------------------------------
def sft_signature(recipe: Recipe) -> dict:
    """Everything the SFT stage of ``recipe`` depends on, as plain data."""
    from moe_rl.config import to_dict

    d = to_dict(recipe)
    optim = dict(d["optim"])
    if recipe.train.sft_lr is not None:  # the SFT stage runs at sft_lr: the RL LR does not matter
        optim.pop("lr")
        optim.pop("min_lr")
    task = {k: v for k, v in d["task"].items() if k not in ("seed", "format_reward")}
    train = {k: d["train"][k] for k in SFT_TRAIN_KEYS}
    return {"model": d["model"], "task": task, "optim": optim, "train": train}


def sft_key(recipe: Recipe) -> str:
    """A short hash of :func:`sft_signature` (the cache directory name)."""
    blob = json.dumps(sft_signature(recipe), sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=6).hexdigest()


def _reusable(sig: dict) -> Path | None:
    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import latest_checkpoint

    for d in REUSABLE_SFT:
        if not (d / "recipe.yaml").exists() or latest_checkpoint(d / "checkpoints") is None:
            continue
        try:
            if sft_signature(load_recipe(d / "recipe.yaml")) == sig:
                return d / "checkpoints"
        except Exception as e:  # an older recipe layout: not a match
            log.debug("cannot compare %s: %s", d, e)
    return None


def _sft_recipe(base: str | Path, overrides: list[str]):
    from moe_rl.config import load_recipe

    return load_recipe(base, [*overrides, "train.stages=[sft]"])


def shipped_start(key: str, shipped: tuple[Path, ...] = SHIPPED_STARTS) -> Path | None:
    """The HF folder of a shipped SFT start of SFT key ``key`` (:data:`SHIPPED_STARTS`), else None.
    Its files are checked against the sha256 its JSON records: a changed file is an error, never a
    silently different start."""
    from moe_rl.errors import UserError

    for info_file in shipped:
        if not info_file.exists():
            continue
        info = json.loads(info_file.read_text())
        if info.get("sft_key") != key:
            continue
        folder = info_file.with_suffix("")
        for name, digest in info["sha256"].items():
            f = folder / name
            got = hashlib.sha256(f.read_bytes()).hexdigest() if f.exists() else "missing"
            if got != digest:
                raise UserError(
                    f"shipped SFT start {folder}: {name} is {got[:12]}, {info_file.name} records "
                    f"{digest[:12]}: restore it (git checkout -- {folder}) or delete {info_file}"
                )
        return folder
    return None


def is_hf_start(start: Path) -> bool:
    """Whether an SFT start is an HF safetensors folder (loaded by ``model.hf_path``) rather than a
    checkpoint directory (loaded by ``checkpoint.load``)."""
    return (Path(start) / "config.json").is_file()


def start_overrides(start: Path) -> list[str]:
    """The overrides that begin a run from SFT start ``start`` (weights only, either kind)."""
    return [f"model.hf_path={start}" if is_hf_start(start) else f"checkpoint.load={start}"]


def _finished_start(recipe, cache: Path) -> tuple[Path, dict] | None:
    """The finished SFT start of ``recipe``'s signature (a finished ``runs/demo/sft`` of it, the
    cache's checkpoints with ``sft.json``, or a shipped HF start) and its info, else None."""
    from moe_rl.megatron.checkpoint import latest_checkpoint

    reuse = _reusable(sft_signature(recipe))
    if reuse is not None:
        return reuse, {"checkpoint": str(reuse), "reused": True, "key": sft_key(recipe)}
    root = cache / sft_key(recipe)
    ckpt, info_file = root / "checkpoints", root / "sft.json"
    if info_file.exists() and latest_checkpoint(ckpt) is not None:
        return ckpt, {**json.loads(info_file.read_text()), "reused": True}
    shipped = shipped_start(sft_key(recipe))
    if shipped is not None:
        return shipped, {"checkpoint": str(shipped), "reused": True, "key": sft_key(recipe), "shipped": True}
    return None


def cached_start(
    base: str | Path, overrides: list[str] = (), *, cache: Path = CACHE
) -> tuple[Path, dict] | None:
    """The finished SFT checkpoint of ``base`` + ``overrides`` and its info, if one exists (a
    finished ``runs/demo/sft`` of the same signature, or the cache's), else None; trains nothing."""
    return _finished_start(_sft_recipe(base, overrides), cache)


def warm_start(
    base: str | Path, overrides: list[str] = (), *, cache: Path = CACHE, launch: str | None = None
) -> tuple[Path, dict]:
    """The SFT checkpoint of ``base`` + ``overrides`` (trained now if not cached) and its info.

    The SFT saves every :data:`SFT_CHECKPOINT_EVERY` steps; one stopped or killed before its end
    (checkpoints but no ``sft.json``) is resumed from its newest intact checkpoint."""
    from moe_rl.megatron.checkpoint import latest_checkpoint
    from moe_rl.trainer.metrics import read_metrics

    recipe = _sft_recipe(base, overrides)
    hit = _finished_start(recipe, cache)
    if hit is not None:
        log.info("reusing the SFT start %s", hit[0])
        return hit
    sig = sft_signature(recipe)
    root = cache / sft_key(recipe)
    ckpt, info_file = root / "checkpoints", root / "sft.json"
    resume = latest_checkpoint(ckpt) is not None  # without sft.json: stopped or killed before its end
    if resume:
        log.info("resuming the interrupted SFT start %s", ckpt)
    else:
        shutil.rmtree(root, ignore_errors=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    run_recipe(
        base,
        [
            *overrides,
            "train.stages=[sft]",
            f"train.out_dir={root}",
            "checkpoint.dir=null",
            "checkpoint.load=null",
            f"checkpoint.every={SFT_CHECKPOINT_EVERY}",
        ],
        launch,
        resume=resume,
    )
    rows = read_metrics(root / "metrics.jsonl", "sft")
    info = {
        "checkpoint": str(ckpt),
        "key": root.name,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": cpu_seconds() - c0,
        "steps": len(rows),
        "final_loss": sum(r["loss"] for r in rows[-10:]) / max(1, len(rows[-10:])),
        "signature": sig,
    }
    info_file.write_text(json.dumps(info, indent=1))
    return ckpt, {**info, "reused": False}


# -- running arms --------------------------------------------------------------------------------
def ensure_parallel() -> None:
    """A world-of-one process group for in-process runs (kept for every run of this process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        from moe_rl.config import ParallelConfig
        from moe_rl.megatron.parallel import init_parallel

        init_parallel(ParallelConfig(), seed=0)


def run_recipe(
    base: str | Path, overrides: list[str], launch: str | None = None, *, resume: bool = False
) -> dict:
    """``moe-rl train base overrides``: in this process (``launch`` None) or as ``launch base overrides``
    (``resume``: ``--resume``, from the newest intact checkpoint of the run's directory).

    ``launch`` is a command prefix, e.g. ``".venv/bin/python -m moe_rl.cli train"`` (a fresh
    process per arm), ``launch/torchrun.sh`` (one node) or ``"sbatch --wait --nodes=3
    launch/slurm.sbatch"`` (Slurm; ``--wait`` makes the harness wait for each arm).

    Returns, launched, ``{"cpu_s": ...}`` (:func:`run_child`: the launcher's process tree on this
    machine, so under ``sbatch`` the job's own CPU is not in it); in process, the run's result.
    """
    if launch:
        cmd = [*shlex.split(launch), str(base), *overrides, *(["--resume"] if resume else [])]
        log.info("launching %s", shlex.join(cmd))
        return {"cpu_s": run_child(cmd, {**os.environ, "PYTHONWARNINGS": "ignore"})}
    from moe_rl.config import load_recipe
    from moe_rl.trainer.run import run

    recipe = load_recipe(base, overrides)
    if recipe.parallel.world_size == 1:
        ensure_parallel()
    return run(recipe, resume=resume)


def run_arm(
    base: str | Path,
    overrides: list[str],
    out_dir: str | Path,
    *,
    start: Path | None = None,
    launch: str | None = None,
) -> dict:
    """One RL arm into ``out_dir`` (from SFT checkpoint ``start`` when given): a fresh one, or
    the same run resumed when ``out_dir`` holds its checkpoint (:func:`resumable`: e.g. a run
    stopped by SIGTERM, which saves at the next step).

    Returns ``{"status": "done" | "stopped" | "failed", "reason", "wall_s", "cpu_s", "resumed"}``
    (times of this attempt only); a run the trainer stops on purpose (repeated non-finite steps, a
    sentinel set to stop) is ``stopped``.
    """
    from moe_rl.trainer.loop import TrainingStopped

    out_dir = Path(out_dir)
    ov = [f"checkpoint.every={ARM_CHECKPOINT_EVERY}", *overrides, f"train.out_dir={out_dir}"]
    if start is not None:
        ov += ["train.stages=[rl]", *start_overrides(start)]
    resume = resumable(out_dir, base, ov)
    if resume:
        log.info("resuming %s from its checkpoint", out_dir)
    else:
        shutil.rmtree(out_dir, ignore_errors=True)  # metrics.jsonl appends: start clean
    t0, c0 = time.perf_counter(), cpu_seconds()
    status, reason, child = "done", None, {}
    try:
        done = run_recipe(base, ov, launch, resume=resume)
        child = done if launch else {}
    except TrainingStopped as e:
        status, reason = "stopped", str(e)
    except subprocess.CalledProcessError as e:
        status, reason = "failed", f"exit status {e.returncode}"
    return {
        "status": status,
        "reason": reason,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": child.get("cpu_s", cpu_seconds() - c0),
        "out_dir": str(out_dir),
        "resumed": resume,
    }


def resumable(out_dir: Path, base: str | Path, overrides: list[str]) -> bool:
    """True when ``out_dir`` holds an intact checkpoint of the run ``base`` + ``overrides`` would
    make: its saved ``recipe.yaml`` resolves to the same recipe (anything else starts over)."""
    from moe_rl.config import load_recipe, to_dict
    from moe_rl.megatron.checkpoint import latest_checkpoint

    def run_of(recipe) -> dict:  # how often it saves does not change a run
        d = to_dict(recipe)
        return {**d, "checkpoint": {k: v for k, v in d["checkpoint"].items() if k not in ("every", "keep")}}

    saved = out_dir / "recipe.yaml"
    if not saved.exists() or latest_checkpoint(out_dir / "checkpoints") is None:
        return False
    try:
        return run_of(load_recipe(saved)) == run_of(load_recipe(base, overrides))
    except Exception as e:  # an unreadable or older recipe: not this run
        log.info("not resuming %s: %s", out_dir, e)
        return False


def read_arm(out_dir: str | Path) -> dict:
    """``{"rl": rows, "eval": rows}`` of a finished (or stopped) arm; empty when it wrote nothing."""
    from moe_rl.trainer.report import load_arm

    if not (Path(out_dir) / "metrics.jsonl").exists():
        return {"rl": [], "eval": []}
    return load_arm(out_dir)


def mean(xs) -> float:
    """Mean of the finite numbers in ``xs`` (nan when there are none)."""
    v = [float(x) for x in xs if x is not None and x == x and abs(float(x)) != float("inf")]
    return sum(v) / len(v) if v else float("nan")
