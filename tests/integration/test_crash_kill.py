"""SIGKILL of a ``moe-rl`` command at each write it makes (issue 48; tests/crash.py): what was there
before stays readable, and the next command recovers.

The in-process twin (an exception and ENOSPC at every write, in the fast tier):
tests/unit/test_crash_writes.py. Here the faults are real kills of a child, at the write's torn
state (a file created or truncated, half of a tensor file): nothing of the process runs after it
(no ``except``, no ``finally``).

- ``moe-rl train``: a kill at each write of the checkpoint after RL step 2 (its temp directory, the
  tensor files, meta.json, the rename, ``latest``, the prune); then ``--resume`` runs to the end
  and every RL row equals an uninterrupted run's;
- ``moe-rl export --overwrite`` over an earlier export: a kill at each of its writes into the
  destination's folder leaves the destination holding the old export or the complete new one (or,
  killed between its two renames, the old one set aside beside it, whole); the next export lands
  and leaves nothing beside it. The bug it found, seen failing before the fix: a kill after the
  staging directory's owner file was removed (right before its rename) left the complete staging
  directory, a whole model's size, beside the destination for an hour, and the set-aside old
  export for good.

Each test runs in two sizes: ``states`` (the integration tier) kills once in each state the folder
passes through (:func:`state_writes`: nothing made yet, a torn tensor file, and each rename or removal
that commits a whole entry), 5 of each command's 12 writes; ``every`` (``make test-nightly``)
kills at every write, 4.3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from moe_rl.trainer.metrics import read_metrics
from tests.crash import ENV, child_command, snapshot
from tests.tiny import TINY_RL

ROOT = Path(__file__).resolve().parents[2]
RECIPE = {
    **TINY_RL,
    "algo": {"name": "grpo", "routing": "r2"},
    "train": {
        **TINY_RL["train"],
        "stages": ["sft", "rl"],
        "sft_steps": 2,
        "sft_batch_size": 4,
        "rl_steps": 3,
        "temperature": 1.5,
    },
    "checkpoint": {"every": 2, "keep": 1},
}
"""2 SFT steps (the weights move), then 3 RL steps of the tiny policy, a checkpoint after RL step 2
(keep 1: the save prunes the one before)."""
CLOCK = ("time", "tokens_per_s", "run", "attempt")


def moe_rl(*args: str, fault: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``moe-rl ARGS`` in a child, with ``fault`` (``<n>:kill``, ``count:<path>``) planted."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop(ENV, None)
    if fault:
        env[ENV] = fault
    return subprocess.run(
        child_command(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _recipe(tmp_path: Path, name: str, **checkpoint) -> Path:
    path = tmp_path / f"{name}.yaml"
    recipe = {**RECIPE, "train": {**RECIPE["train"], "out_dir": str(tmp_path / name)}}
    recipe["checkpoint"] = {**RECIPE["checkpoint"], **checkpoint}
    path.write_text(yaml.safe_dump(recipe))
    return path


def _counted(tmp_path: Path, *args: str) -> list[str]:
    out = tmp_path / "writes.json"
    res = moe_rl(*args, fault=f"count:{out}")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def _span(writes: list[str], mark: str) -> list[int]:
    """1-based numbers of the writes from the first naming ``mark`` to the last write into the same
    folder's ``checkpoints/`` right after it (``latest``, the prune)."""
    first = next(i for i, w in enumerate(writes) if mark in w)
    last = first
    while last + 1 < len(writes) and "/checkpoints/" in writes[last + 1]:
        last += 1
    return list(range(first + 1, last + 2))


TENSOR_WRITES = ("torch.save ", "safetensors.torch.save_file ")
COMMITS = ("os.rename ", "os.replace ", "shutil.rmtree ")


def state_writes(writes: list[str], numbers: list[int]) -> list[int]:
    """Of ``numbers`` (1-based, into ``writes``), one kill per state the folder passes through: the
    first write (nothing made yet), the first tensor write (a torn tensor file in the staging folder),
    and each rename, replace or removal of a whole entry (its source not inside a hidden staging
    folder: the commit, ``latest``, setting the old one aside, the prune). A kill at any other write
    leaves one of these states: a staging folder missing more or fewer of its files."""

    def source(w: str) -> Path:
        return Path(w.split(" ", 1)[1].split(" -> ")[0])

    tensor = next(n for n in numbers if writes[n - 1].startswith(TENSOR_WRITES))
    commits = [
        n
        for n in numbers
        if writes[n - 1].startswith(COMMITS) and not source(writes[n - 1]).parent.name.startswith(".")
    ]
    return sorted({numbers[0], tensor, *commits})


SIZES = ["states", pytest.param("every", marks=pytest.mark.nightly)]
"The integration tier's kills (:func:`state_writes`) and the nightly's (every write)."


def _kills(writes: list[str], numbers: list[int], size: str) -> list[int]:
    return state_writes(writes, numbers) if size == "states" else numbers


def test_the_state_writes_are_the_folder_s_transitions():
    """The writes a train's checkpoint and an export make (as counted on this tree), and the kills
    the integration tier picks of them."""
    ckpt = "/r/checkpoints/"
    train = [
        f"os.mkdir {ckpt}.tmp-0002-rl -> 511",
        f"torch.save {ckpt}.tmp-0002-rl/common.pt",
        f"open {ckpt}.tmp-0002-rl/.metadata.tmp (wb)",
        f"os.rename {ckpt}.tmp-0002-rl/.metadata.tmp -> {ckpt}.tmp-0002-rl/.metadata",
        f"torch.save {ckpt}.tmp-0002-rl/rng-0.pt",
        f"open {ckpt}.tmp-0002-rl/.meta.json.tmp-1 (w)",
        f"os.replace {ckpt}.tmp-0002-rl/.meta.json.tmp-1 -> {ckpt}.tmp-0002-rl/meta.json",
        f"os.replace {ckpt}.tmp-0002-rl -> {ckpt}0002-rl",
        f"open {ckpt}.latest.tmp-1 (w)",
        f"os.replace {ckpt}.latest.tmp-1 -> {ckpt}latest",
        f"shutil.rmtree {ckpt}0001-sft",
    ]
    assert state_writes(["open /r/metrics.jsonl (a)", *train], list(range(2, 13))) == [2, 3, 9, 11, 12]
    export = [
        "os.mkdir /e/.out.tmp-1 -> 511",
        "safetensors.torch.save_file /e/.out.tmp-1/part-1.safetensors",
        "os.rename /e/.out.tmp-1/part-1.safetensors -> /e/.out.tmp-1/model.safetensors",
        "open /e/.out.tmp-1/config.json (w)",
        "os.rename /e/out -> /e/.out.old-1",
        "os.rename /e/.out.tmp-1 -> /e/out",
        "shutil.rmtree /e/.out.old-1",
    ]
    assert state_writes(export, list(range(1, 8))) == [1, 2, 5, 6, 7]


def _rl_rows(folder: Path) -> dict[int, dict]:
    return {
        r["step"]: {k: v for k, v in r.items() if k not in CLOCK and not k.startswith("time/")}
        for r in read_metrics(folder / "metrics.jsonl", "rl")
    }


@pytest.mark.parametrize("size", SIZES)
def test_a_train_killed_at_any_write_of_a_checkpoint_resumes_to_the_uninterrupted_run(tmp_path, size):
    from moe_rl.megatron.checkpoint import find_checkpoint, verify_checkpoint

    ref = moe_rl("train", str(_recipe(tmp_path, "ref")))
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = _rl_rows(tmp_path / "ref")
    writes = _counted(tmp_path, "train", str(_recipe(tmp_path, "count")))
    span = _span(writes, "rl-step-000002")
    assert any("latest" in writes[n - 1] for n in span) and any("rmtree" in writes[n - 1] for n in span), span
    for n in _kills(writes, span, size):
        recipe, folder = _recipe(tmp_path, f"kill{n}"), tmp_path / f"kill{n}"
        killed = moe_rl("train", str(recipe), fault=f"{n}:kill")
        assert killed.returncode == -signal.SIGKILL, (n, writes[n - 1], killed.stderr[-2000:])
        # what the kill left: an intact checkpoint, the one `latest` names; readable rows
        ckpt, skipped = find_checkpoint(folder / "checkpoints")
        assert ckpt is not None and verify_checkpoint(ckpt) is None, (n, writes[n - 1], skipped)
        assert not skipped, (n, writes[n - 1], skipped)
        assert [r["step"] for r in read_metrics(folder / "metrics.jsonl", "rl")][:2] == [0, 1]
        res = moe_rl("train", str(recipe), "--resume")
        assert res.returncode == 0, (n, writes[n - 1], res.stderr[-3000:])
        assert _rl_rows(folder) == want, (n, writes[n - 1])
        assert not list((folder / "checkpoints").glob(".tmp-*")), n


@pytest.fixture
def export_run(tmp_path):
    """A trained tiny run (its recipe) and an earlier export of its first checkpoint at ``out``."""
    recipe = _recipe(tmp_path, "run", keep=10, every=1)
    res = moe_rl("train", str(recipe))
    assert res.returncode == 0, res.stderr[-3000:]
    from moe_rl.megatron.checkpoint import checkpoint_dirs

    first = checkpoint_dirs(tmp_path / "run" / "checkpoints")[0]
    res = moe_rl("export", str(recipe), str(tmp_path / "out"), "--checkpoint", str(first))
    assert res.returncode == 0, res.stderr[-3000:]
    return recipe, tmp_path / "out"


@pytest.mark.parametrize("size", SIZES)
def test_an_export_killed_at_any_write_leaves_the_old_export_or_the_new_one(tmp_path, export_run, size):
    recipe, out = export_run
    old = snapshot(out)
    args = ("export", str(recipe), str(out), "--overwrite")
    writes = _counted(tmp_path, *args)
    new = snapshot(out)
    assert new != old
    mine = [n for n, w in enumerate(writes, 1) if f"/{out.name}" in w or f"/.{out.name}." in w]
    assert any("safetensors" in writes[n - 1] for n in mine) and any(
        ".out.old-" in writes[n - 1] for n in mine
    )
    for n in _kills(writes, mine, size):
        _put(out, old)
        killed = moe_rl(*args, fault=f"{n}:kill")
        assert killed.returncode == -signal.SIGKILL, (n, writes[n - 1], killed.stderr[-2000:])
        beside = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".out."))
        if out.exists():
            assert snapshot(out) in (old, new), (n, writes[n - 1])
        else:  # killed between its renames: the old export set aside, whole
            aside = [b for b in beside if b.startswith(".out.old-")]
            assert len(aside) == 1 and snapshot(out.parent / aside[0]) == old, (n, writes[n - 1], beside)
        res = moe_rl(*args)
        assert res.returncode == 0, (n, writes[n - 1], res.stderr[-3000:])
        assert snapshot(out) == new, (n, writes[n - 1])
        assert not [p for p in out.parent.iterdir() if p.name.startswith(".out.")], (n, writes[n - 1])


def _put(out: Path, files: dict[str, bytes]) -> None:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
