"""SIGKILL of ``moe-rl export --overwrite`` at each write it makes into the destination's folder
(issue 48; the train half and the shared kill helpers: tests/integration/test_crash_kill.py): the
destination holds the old export or the complete new one (or, killed between its two renames, the
old one set aside beside it, whole); the next export lands and leaves nothing beside it. The bug it
found, seen failing before the fix: a kill after the staging directory's owner file was removed
(right before its rename) left the complete staging directory, a whole model's size, beside the
destination for an hour, and the set-aside old export for good.

A file of its own so that the two kill loops, the integration tier's longest tests, run on two
pytest-xdist workers (``--dist loadfile`` keeps a file's tests on one).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.crash import snapshot
from tests.integration.test_crash_kill import SIZES, _counted, _kills, _recipe, moe_rl


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
