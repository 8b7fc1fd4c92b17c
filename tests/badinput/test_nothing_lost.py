"""Issue 47, items 1 and 2: no command deletes or replaces what it did not write, and a run holds
every folder it writes for its whole life.

- a re-run of ``moe-rl compare`` (or ``moe-rl demo``) into a finished comparison with a changed
  recipe is refused before anything trains, naming the arms that differ and how; ``--fresh`` trains
  them again beside the old runs, and a file the user put into a run folder is never removed;
- ``moe-rl export`` refuses a destination inside any run's checkpoint folder, with or without
  ``--overwrite``;
- ``train`` holds its ``checkpoint.dir`` as it holds ``train.out_dir``; ``--resume`` refuses a
  checkpoint folder whose newest checkpoint is another run's, naming both.

The comparison runs in this process (``--jobs 1``): one tiny SFT start and one RL step per run.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.lab.arms import DEMO
from tests.badinput.conftest import assert_kept, snapshot
from tests.tiny import COMPARE_TINY as TINY

output_case = pytest.mark.bad_input("output")
ARMS_2 = "GRPO,GSPO"


def compare(out: Path, *extra: str) -> tuple[int, str, str]:
    """``moe-rl compare`` of GRPO and GSPO x 1 seed in this process: exit code, stdout, stderr."""
    argv = ["compare", str(DEMO), "--arms", ARMS_2, "--seeds", "1", "--jobs", "1", *TINY, *extra]
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main([*argv, "--out", str(out)])
    return code, o.getvalue(), e.getvalue()


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("moe-rl:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_compare(tmp_path_factory, parallel_info) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "out"
    code, _, err = compare(out)
    assert code == 0, err
    return out


@pytest.fixture
def comparison(finished_compare, tmp_path) -> Path:
    """This case's copy of the finished comparison, with a file the user put into a run folder."""
    out = tmp_path / "out"
    shutil.copytree(finished_compare, out)
    (out / "grpo" / "s0" / "notes.txt").write_text("my notes")
    return out


@output_case
def test_a_rerun_with_a_changed_recipe_is_refused_naming_the_arms_and_the_difference(comparison):
    """It used to delete every finished arm folder (checkpoints, metrics, status and the user's
    notes.txt), retrain, overwrite compare.* and exit 0 without a word."""
    before = snapshot(comparison)
    code, out, err = compare(comparison, "train.temperature=0.9")
    assert code == 2, err
    line = one_line(err)
    for text in ("GRPO", "GSPO", "train.temperature 1.0 -> 0.9", "--fresh", "--out"):
        assert text in line, line
    assert ": started" not in out
    assert_kept(before, comparison)


@output_case
def test_fresh_trains_the_changed_arms_again_and_keeps_every_file(comparison):
    """``--fresh``: the arms run again with the new recipe beside the old runs (their checkpoints
    are kept, metrics.jsonl continues); the user's file stays."""
    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import checkpoint_dirs

    old = {
        a: [p.name for p in checkpoint_dirs(comparison / a / "s0" / "checkpoints")] for a in ("grpo", "gspo")
    }
    code, _, err = compare(comparison, "train.temperature=0.9", "--fresh")
    assert code == 0, err
    assert (comparison / "grpo" / "s0" / "notes.txt").read_text() == "my notes"
    for a in ("grpo", "gspo"):
        assert load_recipe(comparison / a / "s0" / "recipe.yaml").train.temperature == 0.9
        now = [p.name for p in checkpoint_dirs(comparison / a / "s0" / "checkpoints")]
        assert set(old[a]) <= set(now) and len(now) > len(old[a])
    doc = json.loads((comparison / "compare.json").read_text())
    assert "train.temperature=0.9" in doc["overrides"] and doc["failed"] == []


@output_case
def test_demo_into_a_comparisons_folder_is_refused_before_anything_trains(comparison):
    """``moe-rl demo --out`` of an earlier comparison's folder used to do the same to the arm folder
    both use (grpo/s0)."""
    before = snapshot(comparison)
    e = io.StringIO()
    with contextlib.redirect_stderr(e), contextlib.redirect_stdout(io.StringIO()):
        code = main(["demo", "--out", str(comparison), "--jobs", "1"])
    assert code == 2
    line = one_line(e.getvalue())
    assert "GRPO" in line and "--fresh" in line, line
    assert_kept(before, comparison)


# -- item 2: locks over every folder a run writes; --resume continues only its own run -------------
def sft_recipe(folder: Path, name: str, out: str, **train) -> Path:
    """A 2-step tiny SFT recipe writing into ``folder/out`` (``train`` overrides)."""
    from tests.badinput.test_outputs_checkpoints import recipe

    path = recipe(folder, name, sft_steps=2, **train)
    text = path.read_text().replace(str(folder / "run"), str(folder / out))
    path.write_text(text)
    return path


@pytest.mark.bad_input("checkpoint")
def test_a_second_run_into_a_live_runs_checkpoint_dir_is_refused(cli, tmp_path):
    """It used to be accepted and to write its checkpoints and ``latest`` among the live run's."""
    from moe_rl.trainer.run_lock import hold_run_dir

    shared = tmp_path / "a" / "checkpoints"
    shared.mkdir(parents=True)
    r = sft_recipe(tmp_path, "b.yaml", "b")
    with hold_run_dir(shared, rank=0):  # run a, live, holds its checkpoints
        res = cli("train", r, f"checkpoint.dir={shared}")
    res.one_line(r"checkpoint\.dir .*a/checkpoints is in use by another run: pid \d+")
    assert not (tmp_path / "b").exists() and not list(shared.iterdir())  # nothing written there


@pytest.mark.bad_input("checkpoint")
def test_a_run_holds_its_checkpoint_dir_while_it_trains(tmp_path, parallel_info):
    from moe_rl.config import load_recipe
    from moe_rl.trainer.run import run
    from moe_rl.trainer.run_lock import held_by

    seen = []
    r = load_recipe(sft_recipe(tmp_path, "a.yaml", "a"), [f"checkpoint.dir={tmp_path / 'ck'}"])
    run(r, hooks=[lambda step: seen.append(held_by(tmp_path / "ck"))])
    assert seen and all(h is not None and h["pid"] for h in seen)
    assert held_by(tmp_path / "ck") is None


@pytest.mark.bad_input("checkpoint")
def test_resume_refuses_a_checkpoint_folder_whose_newest_checkpoint_is_another_runs(cli, tmp_path):
    """Run a, then run b (its own out_dir, a's checkpoint.dir, --fresh) wrote the newest checkpoint
    there: ``--resume`` of a used to continue b's weights without a word."""
    from moe_rl.trainer.metrics import read_metrics

    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    a, b = sft_recipe(tmp_path, "a.yaml", "a"), sft_recipe(tmp_path, "b.yaml", "b")
    assert cli("train", a, ck).code == 0
    assert cli("train", b, ck, "--fresh").code == 0
    own, theirs = (read_metrics(tmp_path / r / "metrics.jsonl")[-1]["run"] for r in "ab")
    before = snapshot(tmp_path)
    line = cli("train", a, ck, "train.sft_steps=4", "--resume").one_line(r"--resume: the newest checkpoint")
    assert f"run {theirs}'s" in line and f"holds run {own}" in line
    assert_kept(before, tmp_path)


# -- item 1: export never writes into, over or around a run's checkpoint folder ---------------------
@output_case
@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "no-overwrite"])
def test_export_refuses_a_checkpoint_of_the_run_it_reads_from_another_one_of_its_checkpoints(
    cli, run_copy, overwrite
):
    """``--checkpoint`` the older checkpoint, destination the newest one (the one ``latest``
    names): ``--overwrite`` replaced it with an HF folder, exit 0."""
    root = run_copy / "run/checkpoints"
    older, newest = sorted(p for p in root.iterdir() if p.is_dir())
    before = snapshot(run_copy)
    args = ["export", run_copy / "r.yaml", newest, "--checkpoint", older] + (
        ["--overwrite"] if overwrite else []
    )
    cli(*args).one_line(r"inside a run's checkpoint folder .*with or without --overwrite")
    assert_kept(before, run_copy)


@output_case
@pytest.mark.parametrize("where", ["root", "inside-a-checkpoint", "new-in-root", "run-folder"])
def test_export_refuses_any_runs_checkpoint_folder_even_with_overwrite(cli, run_copy, finished, where):
    """Another run's folders (not the recipe's, not the one exported): recognised by their markers."""
    other = run_copy / "other"
    shutil.copytree(finished / "run", other)
    out = {
        "root": other / "checkpoints",
        "inside-a-checkpoint": other / "checkpoints" / "0001-sft-step-000002" / "hf",
        "new-in-root": other / "checkpoints" / "hf",
        "run-folder": other,
    }[where]
    before = snapshot(run_copy)
    res = cli("export", run_copy / "r.yaml", out, "--checkpoint", run_copy / "run/checkpoints", "--overwrite")
    res.one_line(
        r"(is inside a run's checkpoint folder|is a run or checkpoint directory|holds .* a run or checkpoint directory)"
    )
    assert_kept(before, run_copy)
    assert not (other / "checkpoints" / "hf").exists()


@pytest.fixture
def run_copy(tmp_path, request):
    """The bad-input suite's finished tiny SFT run, copied (tests/badinput/test_outputs_checkpoints.py)."""
    finished = request.getfixturevalue("finished")
    from tests.badinput.test_outputs_checkpoints import run_copy as make

    return make.__wrapped__(finished, tmp_path)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, parallel_info):
    """The bad-input suite's finished 4-step SFT run (tests/badinput/test_outputs_checkpoints.py)."""
    from tests.badinput.test_outputs_checkpoints import finished as make

    return make.__wrapped__(tmp_path_factory, parallel_info)
