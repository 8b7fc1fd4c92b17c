"""SFT starts: the weights every arm of a comparison begins from, one mechanism for the demo and the
benchmarks.

A start is found or made by the *SFT signature* of a recipe (:func:`sft_signature`: everything the
SFT stage reads: model, task knobs, SFT steps, batch, LR, seed, optimizer), in this order:

1. a finished SFT run of that signature (``recipe.yaml`` + ``checkpoints/``) among :data:`REUSABLE_SFT`;
2. the finished start in its own folder (``sft.json`` beside ``checkpoints/``): by default
   ``<cache>/<sft_key>/``, for the demo its recipe's ``train.out_dir``;
3. a start shipped in the repository as HF safetensors (:data:`SHIPPED_STARTS`, checked by sha256);
4. else it is trained once into that folder (:func:`warm_start`), resuming an interrupted one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.errors import UserError
from moe_rl.lab.arms import ROOT
from moe_rl.lab.results import write_json
from moe_rl.lab.runner import cpu_seconds, run_recipe
from moe_rl.trainer.metrics import newest_run, read_metrics
from moe_rl.trainer.run_lock import held_by
from moe_rl.trainer.state import Checkpointer

if TYPE_CHECKING:
    from moe_rl.config import Recipe

log = logging.getLogger(__name__)

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
"""The smoke presets' policy and task on top of recipes/demo/base.yaml (the studies' and tests'): a\nseconds-long SFT start."""

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
uninterrupted one and a resumed one give the same weights: tests/integration/test_lab_runner.py)."""
SFT_TRAIN_KEYS = ("seed", "sft_steps", "sft_batch_size", "sft_lr")
"The train fields the SFT stage reads (the rest of train is RL only)."
INFO_FILE = "sft.json"
"Written beside a start's ``checkpoints/`` when its SFT finished (what it took, its final loss)."


LATER_DEFAULTS: dict[tuple[str, ...], object] = {
    ("task", "jsonl", "format"): "auto",
    ("task", "jsonl", "reward_signature"): "auto",
    ("task", "jsonl", "reward_batched"): False,
}
"""Recipe fields added after SFT keys were first recorded (the shipped starts, recipes/demo/*.json,
and cached ones): left out of :func:`sft_signature` while at these defaults, so those starts keep
their keys; any other value is part of it. A field added to a section the signature holds joins
this table with its default (tests/unit/test_bench_phase.py and test_noise_design.py pin the
shipped starts' keys)."""


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
    sig = copy.deepcopy({"model": d["model"], "task": task, "optim": optim, "train": train})
    for (*outer, last), default in LATER_DEFAULTS.items():
        node = sig
        for k in outer:
            node = node.get(k, {})
        if last in node and node[last] == default:
            del node[last]
    return sig


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


def _finished_start(recipe, root: Path) -> tuple[Path, dict] | None:
    """The finished SFT start of ``recipe``'s signature (a finished run of :data:`REUSABLE_SFT`,
    ``root``'s checkpoints with :data:`INFO_FILE`, or a shipped HF start) and its info, else None."""
    from moe_rl.megatron.checkpoint import latest_checkpoint

    key = sft_key(recipe)
    reuse = _reusable(sft_signature(recipe))
    if reuse is not None:
        return reuse, {"checkpoint": str(reuse), "reused": True, "key": key}
    ckpt, info_file = root / "checkpoints", root / INFO_FILE
    if info_file.exists() and latest_checkpoint(ckpt) is not None:
        return ckpt, {**json.loads(info_file.read_text()), "reused": True}
    shipped = shipped_start(key)
    if shipped is not None:
        return shipped, {"checkpoint": str(shipped), "reused": True, "key": key, "shipped": True}
    return None


def cached_start(
    base: str | Path, overrides: list[str] = (), *, cache: Path = CACHE
) -> tuple[Path, dict] | None:
    """The finished SFT start of ``base`` + ``overrides`` and its info, if one exists (a finished
    run of :data:`REUSABLE_SFT` of the same signature, the cache's, or a shipped one), else None;
    trains nothing."""
    recipe = _sft_recipe(base, overrides)
    return _finished_start(recipe, cache / sft_key(recipe))


def warm_start(
    base: str | Path,
    overrides: list[str] = (),
    *,
    cache: Path = CACHE,
    launch: str | None = None,
    root: Path | None = None,
    log_file: Path | None = None,
) -> tuple[Path, dict]:
    """The SFT start of ``base`` + ``overrides`` (trained now if none is found) and its info.

    It is trained into ``root`` (default ``<cache>/<sft_key>``), ``launch``-ed as
    :func:`moe_rl.lab.runner.run_recipe` runs a recipe (a launched one's output into ``log_file``
    when given). The SFT saves every
    :data:`SFT_CHECKPOINT_EVERY` steps; one stopped or killed before its end (checkpoints but no
    :data:`INFO_FILE`) is resumed from its newest intact checkpoint. Nothing in ``root`` is deleted:
    a start over (no intact checkpoint) trains beside what is there (``--fresh``) and reads its
    own rows of ``metrics.jsonl``."""
    from moe_rl.megatron.checkpoint import latest_checkpoint

    recipe = _sft_recipe(base, overrides)
    root = Path(root) if root is not None else cache / sft_key(recipe)
    wait_while_trained_elsewhere(root)  # another sweep sharing the cache may be training it now
    hit = _finished_start(recipe, root)
    if hit is not None:
        log.info("reusing the SFT start %s", hit[0])
        return hit
    ckpt = root / "checkpoints"
    resume = latest_checkpoint(ckpt) is not None  # without sft.json: stopped or killed before its end
    fresh = not resume and bool(Checkpointer(ckpt, None, keep=1).any_written())  # none intact: beside them
    if resume:
        log.info("resuming the interrupted SFT start %s", ckpt)
    t0, c0 = time.perf_counter(), cpu_seconds()
    sft = ["train.stages=[sft]", f"train.out_dir={root}", "checkpoint.dir=null", "checkpoint.load=null"]
    ov = [*overrides, *sft, f"checkpoint.every={SFT_CHECKPOINT_EVERY}"]
    run_recipe(base, ov, launch, resume=resume, fresh=fresh, log_file=log_file)
    rows = [r for r in newest_run(read_metrics(root / "metrics.jsonl")) if r.get("stage") == "sft"]
    info = {
        "checkpoint": str(ckpt),
        "key": sft_key(recipe),
        "wall_s": time.perf_counter() - t0,
        "cpu_s": cpu_seconds() - c0,
        "steps": len(rows),
        "final_loss": sum(r["loss"] for r in rows[-10:]) / max(1, len(rows[-10:])),
        "signature": sft_signature(recipe),
    }
    write_json(root / INFO_FILE, info)
    return ckpt, {**info, "reused": False}


def wait_while_trained_elsewhere(root: Path, poll_s: float = 10.0) -> None:
    """Wait while another live process holds ``root``'s run lock (it is training this start): the
    caller then reuses the finished start, or resumes the interrupted one, instead of clearing a
    folder another process is writing into."""
    logged = False
    while (holder := held_by(root)) is not None:
        if not logged:
            log.info("the SFT start %s is being trained by pid %s: waiting for it", root, holder.get("pid"))
            logged = True
        time.sleep(poll_s)
