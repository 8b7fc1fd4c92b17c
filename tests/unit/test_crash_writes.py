"""A fault at every write that promises atomicity or "nothing lost" (issue 48; tests/crash.py).

Each case counts the writes one call makes, then, for every write n and every fault (an exception
at it; ENOSPC: the write starts and the disk is full), restores the state from before the call,
runs the call with write n failing, and asserts that what was there before is still readable,
byte for byte (or, where the fault came after the commit, that the new state is complete), that
nothing half-written is left for a reader, and that the next call recovers. The same faults as a
SIGKILL of a ``moe-rl`` child: tests/integration/test_crash_kill.py.
"""

from __future__ import annotations

import json
import shutil
from itertools import product
from pathlib import Path

import pytest
import torch

from tests.crash import InjectedFault, count_writes, fault_at, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

FAULTS = ("raise", "enospc")
FAILED = (InjectedFault, OSError)


def _each_fault(writes: list[str]):
    assert writes, "the call wrote nothing"
    return product(range(1, len(writes) + 1), FAULTS)


class _Fails:
    """``with _fails(n, kind, writes):`` write n of the block fails with ``kind`` and the block raises."""

    def __init__(self, n: int, kind: str, writes: list[str]):
        self.n, self.kind, self.writes = n, kind, writes

    def __enter__(self):
        self.faults = fault_at(self.n, self.kind)
        self.faults.__enter__()

    def __exit__(self, typ, exc, tb):
        self.faults.__exit__(typ, exc, tb)
        where = f"write {self.n} ({self.kind}) of {self.writes}"
        assert typ is not None and issubclass(typ, FAILED), f"no fault raised at {where}"
        return True


_fails = _Fails


def _restore(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


def test_a_result_file_is_the_old_one_or_the_new_one_after_a_fault_at_any_write(tmp_path):
    """``moe_rl.lab.results.write_json`` (every result JSON, compare's and report's tables, the
    INDEX files): after a fault at any of its writes the old file is there byte for byte, no temp
    file is left beside it, and the next write lands. Planted bug killed: the result written in
    place (``Path.write_text``), which a full disk leaves empty."""
    from moe_rl.lab.results import write_json

    path = tmp_path / "result.json"
    write_json(path, {"headline": {"old": 1}})
    old = path.read_bytes()
    writes = count_writes(lambda: write_json(path, {"headline": {"new": 2}}))
    for n, kind in _each_fault(writes):
        path.write_bytes(old)
        with _fails(n, kind, writes):
            write_json(path, {"headline": {"new": 2}})
        assert path.read_bytes() == old, (n, kind, writes[n - 1])
        assert [p.name for p in tmp_path.iterdir()] == [path.name], (n, kind)
        write_json(path, {"headline": {"new": 2}})
        assert json.loads(path.read_text()) == {"headline": {"new": 2}}


def _perturb(policy, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    return [p.detach().clone() for p in policy.model.parameters()]


def _weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.parameters()]


def test_a_checkpoint_save_leaves_the_previous_checkpoint_and_latest_after_a_fault_at_any_write(
    tmp_path, tiny_policy
):
    """``save_checkpoint`` of a third checkpoint (keep 2: it prunes the first) with a fault at each
    of its writes (dist_checkpointing's files, the RNG, meta.json, the rename, ``latest``, the
    prune): ``latest`` names the previous checkpoint or the new one, and that one is complete (its
    files byte for byte what they were, or the new one's checksums intact); loading the root loads
    those weights; the next save recovers (no ``.tmp-*`` left, ``latest`` the new one).
    Planted bugs killed: ``latest`` written in place; meta.json written before the data files are
    complete (a crash then leaves a checkpoint that verifies but is not whole)."""
    from moe_rl.megatron.checkpoint import (
        checkpoint_dirs,
        load_checkpoint,
        save_checkpoint,
        verify_checkpoint,
    )

    root, pristine = tmp_path / "ck", tmp_path / "pristine"
    saved = {}
    for step in (1, 2):
        saved[step] = _perturb(tiny_policy, step)
        save_checkpoint(root, step, tiny_policy.model, keep=2)
    shutil.copytree(root, pristine)
    before = snapshot(root)
    saved[3] = _perturb(tiny_policy, 3)
    writes = count_writes(lambda: save_checkpoint(root, 3, tiny_policy.model, keep=2))
    for n, kind in _each_fault(writes):
        _restore(pristine, root)
        with torch.no_grad():
            for p, w in zip(tiny_policy.model.parameters(), saved[3]):
                p.copy_(w)
        with _fails(n, kind, writes):
            save_checkpoint(root, 3, tiny_policy.model, keep=2)
        named = (root / "latest").read_text()
        after = snapshot(root)
        if named == "0002-checkpoint":  # the fault came before the commit: the old state, byte for byte
            assert {k: after.get(k) for k in before} == before, (n, kind, writes[n - 1])
        else:
            assert named == "0003-checkpoint", named
            assert all(after.get(k) == v for k, v in before.items() if k.startswith("0002-")), (n, kind)
            assert verify_checkpoint(root / named) is None
        load_checkpoint(root, tiny_policy.model, load_rng=False)
        want = saved[2] if named == "0002-checkpoint" else saved[3]
        assert all(torch.equal(p, w) for p, w in zip(_weights(tiny_policy), want)), (n, kind, writes[n - 1])
        # the next save recovers
        with torch.no_grad():
            for p, w in zip(tiny_policy.model.parameters(), saved[3]):
                p.copy_(w)
        new = save_checkpoint(root, 4, tiny_policy.model, keep=2)
        assert (root / "latest").read_text() == new.name and not list(root.glob(".tmp-*"))
        assert [p.name for p in checkpoint_dirs(root)][-1] == new.name and verify_checkpoint(new) is None


def test_an_hf_export_is_the_old_one_or_the_new_one_after_a_fault_at_any_write(tmp_path, tiny_policy):
    """``export_hf`` over an earlier export (shards, index, config, generation config, tokenizer,
    the staging directory's renames): after a fault at any write the destination holds the old
    export byte for byte or the complete new one, nothing is left beside it, and the next export
    lands. Planted bug killed: the staging directory renamed over the destination before its
    last file is written."""
    from moe_rl.megatron.hf import export_hf
    from moe_rl.tasks.tokenizer import CharTokenizer

    out, tok = tmp_path / "export", CharTokenizer()
    export_hf(tiny_policy, out, tokenizer=tok)
    old = snapshot(out)
    _perturb(tiny_policy, 7)
    writes = count_writes(lambda: export_hf(tiny_policy, out, tokenizer=tok))
    new = snapshot(out)
    assert new != old
    for n, kind in _each_fault(writes):
        _restore_export(out, old)
        with _fails(n, kind, writes):
            export_hf(tiny_policy, out, tokenizer=tok)
        now = snapshot(out)
        assert now in (old, new), (n, kind, writes[n - 1])
        beside = [p.name for p in tmp_path.iterdir() if p.name != "export"]
        # the old export set aside, when its removal after the new one landed failed
        assert not beside or (now == new and all(b.startswith(".export.old-") for b in beside)), (n, kind)
        export_hf(tiny_policy, out, tokenizer=tok)
        assert snapshot(out) == new
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], (n, kind, writes[n - 1])


def _restore_export(out: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(out, ignore_errors=True)
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)


def test_a_finished_arms_status_file_is_whole_or_absent_after_a_fault_at_any_write(tmp_path, monkeypatch):
    """``moe-rl compare`` skips an arm whose run folder holds ``status.json`` and reruns one without:
    after a fault at any write of it the file is absent or whole (never a torn one, which reads as
    another run and starts the arm over), and the next invocation recovers it. Planted bug killed:
    the status written in place."""
    from moe_rl.lab import runner

    out, calls = tmp_path / "arm", []
    out.mkdir()

    def fake_run_arm(base, overrides, out_dir, **kw):
        calls.append(out_dir)
        return {"status": "done", "reason": None, "wall_s": 1.0, "cpu_s": 1.0, "out_dir": str(out_dir)}

    monkeypatch.setattr(runner, "run_arm", fake_run_arm)
    monkeypatch.setattr(runner, "same_run", lambda *a, **kw: True)
    status = out / runner.STATUS_FILE
    writes = count_writes(lambda: runner.resumable_run("arm", "recipe.yaml", [], out))
    for n, kind in _each_fault(writes):
        status.unlink(missing_ok=True)
        with _fails(n, kind, writes):
            runner.resumable_run("arm", "recipe.yaml", [], out)
        assert not status.exists() or json.loads(status.read_text())["status"] == "done", (n, kind)
        assert sorted(p.name for p in out.iterdir()) in ([], [status.name]), (n, kind, writes[n - 1])
        calls.clear()
        assert runner.resumable_run("arm", "recipe.yaml", [], out)["status"] == "done"
        assert json.loads(status.read_text())["status"] == "done"


def test_a_runs_recipe_survives_a_fault_while_a_resume_rewrites_it(tmp_path, tiny_run):
    """Every ``moe-rl train`` (a resume too) writes the run's ``recipe.yaml``; ``moe-rl compare``
    resumes an arm only when that file resolves to the arm's recipe, and starts it over (its
    folder removed) otherwise. After a fault at any write of it the file still resolves to the run's
    recipe, and no temp file is left. Planted bug killed (and the bug it was, seen failing before
    the fix): ``recipe.yaml`` written in place, which a full disk leaves empty: the next compare
    then removed the arm's checkpoints."""
    from moe_rl.config import load_recipe, to_dict

    run = tiny_run()
    path = run.out / "recipe.yaml"
    old = path.read_bytes()
    writes = count_writes(run.write_recipe)
    entries = sorted(p.name for p in run.out.iterdir())
    for n, kind in _each_fault(writes):
        with _fails(n, kind, writes):
            run.write_recipe()
        assert path.read_bytes() == old, (n, kind, writes[n - 1])
        assert to_dict(load_recipe(path)) == to_dict(run.recipe)
        assert sorted(p.name for p in run.out.iterdir()) == entries, (n, kind)
        run.write_recipe()
        assert path.read_bytes() == old


def test_a_row_torn_by_a_full_disk_is_cut_on_resume_and_every_attempt_stays_readable(tmp_path):
    """``metrics.jsonl`` appends a row per step; a resume cuts it back to the checkpoint's offset and
    moves the rows after it to ``metrics.abandoned.jsonl``. A full disk mid-row leaves half a row
    at the end: the readers skip it (``moe-rl report`` of the killed run), the resume removes it
    before its first row; every attempt's rows (``read_every_attempt``) read after the resume and a
    rollback; the rows before the checkpoint stay byte for byte. Planted bugs killed (and the bug
    they were, seen failing before the fix: the readers raised on the torn row, and a second cut
    glued its first row to it): the readers choke on the torn row; it is left in place."""
    from moe_rl.lab.report import read_run_metrics
    from moe_rl.trainer.metrics import MetricsSink, read_every_attempt, read_metrics

    def log_rows(folder: Path, steps) -> MetricsSink:
        sink = MetricsSink(folder, loggers=())
        for step in steps:
            sink.log(step, "rl", {"reward/mean": 0.1 * step})
        return sink

    (tmp_path / "probe").mkdir()
    writes = count_writes(lambda: log_rows(tmp_path / "probe", [0]).close())
    first_row = next(i for i, w in enumerate(writes, 1) if w.startswith("append"))
    with fault_at(first_row + 4, "enospc") as faults:  # the fifth row's append
        sink = log_rows(tmp_path, [0, 1])
        offset, kept = sink.offset(), (tmp_path / "metrics.jsonl").read_bytes()
        with pytest.raises(OSError):
            for step in (2, 3, 4):
                sink.log(step, "rl", {"reward/mean": 0.1 * step})
    assert faults.fired and faults.fired.startswith("append"), faults.writes
    sink.close()
    shutil.rmtree(tmp_path / "probe")
    assert not (tmp_path / "metrics.jsonl").read_bytes().endswith(b"\n")  # half a row
    # what a reader of the killed run sees: the rows, the torn one skipped
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert [r["step"] for r in read_run_metrics(tmp_path)] == [0, 1, 2, 3]
    # the resume: the rows after the checkpoint move aside, the torn one goes
    sink = MetricsSink(tmp_path, loggers=())
    assert sink.truncate(offset) == 2
    for step in (2, 3):
        sink.log(step, "rl", {"reward/mean": 0.1 * step + 0.05})
    # and a sentinel rollback to the same checkpoint: those rows move aside after the first ones
    assert sink.truncate(offset) == 2
    sink.log(2, "rl", {"reward/mean": 0.2})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(kept)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    every = [(r["step"], round(r["reward/mean"], 3)) for r in read_every_attempt(tmp_path)]
    assert every == [(2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (0, 0.0), (1, 0.1), (2, 0.2)], every
