"""Outputs and checkpoints: nothing the user had is lost, only good weights are saved.

One tiny finished SFT run (module fixture) is copied into each case's folder; every case asserts
the exit code, the one ``moe-rl:`` line for a refusal, and that nothing was lost.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from moe_rl.megatron.checkpoint import checkpoint_dirs, verify_checkpoint
from moe_rl.trainer.metrics import read_every_attempt, read_metrics
from tests.badinput.conftest import RUN_MODEL, assert_kept, run_cli, snapshot

TRAIN = {"stages": ["sft"], "sft_steps": 4, "sft_batch_size": 4, "log_every": 1}


def recipe(folder: Path, name: str = "r.yaml", *, checkpoint=None, **train) -> Path:
    """A tiny SFT recipe writing into ``folder/run``; ``train`` overrides ``TRAIN``."""
    data = {
        "model": RUN_MODEL,
        "optim": {"lr": 1e-3},
        "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 2, "digits": 1}},
        "train": {**TRAIN, **train, "out_dir": str(folder / "run")},
        "checkpoint": {"every": 2, "keep": 3, **(checkpoint or {})},
    }
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory, parallel_info) -> Path:
    """A finished 4-step SFT run: checkpoints 0001-sft-step-000002 and 0002-sft-step-000004 (the end),
    trained by ``moe-rl train`` in this process (the fast tier starts no child process)."""
    folder = tmp_path_factory.mktemp("finished")
    res = run_cli("train", recipe(folder), cwd=folder, in_process=True)
    assert res.code == 0, res.err[-3000:]
    return folder


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    """This case's copy of the finished run (``tmp_path/run``, recipe ``tmp_path/r.yaml``)."""
    from moe_rl.config import load_recipe, to_dict

    shutil.copytree(finished / "run", tmp_path / "run")
    resolved = to_dict(load_recipe(recipe(tmp_path)))  # as if it had been trained here
    (tmp_path / "run/recipe.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    return tmp_path


def ckpts(folder: Path) -> list[str]:
    return [p.name for p in checkpoint_dirs(folder / "run" / "checkpoints")]


def sft_steps(folder: Path) -> list[int]:
    return [r["step"] for r in read_metrics(folder / "run" / "metrics.jsonl", "sft")]


# -- export: never overwrite what it does not own ---------------------------------------------------
@pytest.mark.bad_input("output")
def test_export_refuses_a_non_empty_folder(cli, run_copy):
    out = run_copy / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    before = snapshot(run_copy)
    cli("export", run_copy / "r.yaml", out, "--checkpoint", run_copy / "run/checkpoints").one_line(
        r"path error: .*mine is a non-empty directory.*--overwrite"
    )
    assert_kept(before, run_copy)


@pytest.mark.bad_input("output")
def test_export_refuses_an_existing_file(cli, run_copy):
    out = run_copy / "model.bin"
    out.write_bytes(b"precious")
    before = snapshot(run_copy)
    cli("export", run_copy / "r.yaml", out).one_line(r"model\.bin is an existing file.*--overwrite")
    assert_kept(before, run_copy)
    assert not [p for p in run_copy.iterdir() if p.name.startswith(".model.bin")]


@pytest.mark.bad_input("output")
def test_export_refuses_another_run_directory(cli, run_copy, finished):
    before = snapshot(run_copy)
    res = cli("export", run_copy / "r.yaml", run_copy / "run", "--checkpoint", finished / "run/checkpoints")
    res.one_line(r"run or checkpoint directory \(has checkpoints, metrics\.jsonl, recipe\.yaml")
    assert_kept(before, run_copy)


@pytest.mark.bad_input("output")
@pytest.mark.parametrize(
    "where", ["run", "run/checkpoints", "run/checkpoints/0002-sft-step-000004", "inside"]
)
def test_export_never_replaces_the_checkpoint_it_reads_even_with_overwrite(cli, run_copy, where):
    out = run_copy / "run/checkpoints/hf" if where == "inside" else run_copy / where
    before = snapshot(run_copy)
    res = cli("export", run_copy / "r.yaml", out, "--checkpoint", run_copy / "run/checkpoints", "--overwrite")
    res.one_line(r"would overwrite or sit inside the checkpoint it exports")
    assert_kept(before, run_copy)
    assert not (run_copy / "run/checkpoints/hf").exists()


@pytest.mark.bad_input("output")
@pytest.mark.parametrize("field", ["model.hf_path", "checkpoint.load"])
def test_export_never_replaces_an_input_the_recipe_names_even_with_overwrite(cli, run_copy, field):
    """The recipe's own inputs are inputs too: with ``model.hf_path`` at the target, an fp32 source
    used to become a bf16 copy of itself, exit 0."""
    res = cli("export", run_copy / "r.yaml", run_copy / "hf", "--checkpoint", run_copy / "run/checkpoints")
    assert res.code == 0, res.err[-2000:]
    source = {"model.hf_path": run_copy / "hf", "checkpoint.load": run_copy / "run/checkpoints"}[field]
    out = source if field == "model.hf_path" else source / "hf"
    before = snapshot(run_copy)
    res = cli("export", run_copy / "r.yaml", out, f"{field}={source}", "--dtype", "bfloat16", "--overwrite")
    res.one_line(rf"would overwrite or sit inside the checkpoint it exports \({field} ")
    assert_kept(before, run_copy)


@pytest.mark.bad_input("output")
def test_export_reads_the_recipes_checkpoint_load(cli, run_copy):
    """Without --checkpoint the recipe's ``checkpoint.load`` is exported (it used to export the
    random initial weights and say "exported to")."""
    from safetensors.torch import load_file

    def tensors(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    ckpt = run_copy / "run/checkpoints"
    assert cli("export", run_copy / "r.yaml", run_copy / "a", "--checkpoint", ckpt).code == 0
    # a recipe whose own run has no checkpoints yet (a new out_dir): its start is exported
    res = cli(
        "export",
        run_copy / "r.yaml",
        run_copy / "b",
        f"checkpoint.load={ckpt}",
        f"train.out_dir={run_copy}/new",
    )
    assert res.code == 0, res.err[-2000:]
    a, b = tensors(run_copy / "a"), tensors(run_copy / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.bad_input("output")
def test_export_without_checkpoint_takes_the_runs_newest(cli, run_copy, capsys):
    """Without --checkpoint the recipe's run's newest checkpoint is exported: weights equal to that
    checkpoint's (given by name), not the older one's. It used to be refused (or, before that, the
    random initial weights exported)."""
    ckpts = run_copy / "run/checkpoints"
    newest, older = ckpts / "0002-sft-step-000004", ckpts / "0001-sft-step-000002"
    for name, ckpt in (("newest", newest), ("older", older)):
        res = cli("export", run_copy / "r.yaml", run_copy / name, "--checkpoint", ckpt, "--dtype", "float32")
        assert res.code == 0, res.err[-2000:]
    res = cli("export", run_copy / "r.yaml", run_copy / "hf", "--dtype", "float32")
    assert res.code == 0, res.err[-2000:]
    assert f"from {newest} (the run's newest checkpoint)" in res.out
    got, want, old = _tensors(run_copy / "hf"), _tensors(run_copy / "newest"), _tensors(run_copy / "older")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], old[k]) for k in old)  # SFT changed the weights in between


@pytest.mark.bad_input("checkpoint")
def test_export_without_checkpoint_refuses_when_the_run_has_none(cli, tmp_path):
    """No run yet, no checkpoint.load, no model.hf_path: one line saying where it looked."""
    path = recipe(tmp_path)
    before = snapshot(tmp_path)
    res = cli("export", path, tmp_path / "hf")
    res.one_line(
        r"nothing to export but the randomly initialised policy: .*run/checkpoints holds no checkpoint of "
        r"this recipe's run .*give --checkpoint .*--random-init"
    )
    assert_kept(before, tmp_path)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "run").exists()
    assert cli("export", path, tmp_path / "hf", "--random-init").code == 0


@pytest.mark.bad_input("checkpoint")
def test_export_of_a_run_with_no_intact_checkpoint_is_refused(cli, run_copy):
    """Not passed over for the recipe's start (or random weights): its checkpoints are damaged."""
    for ckpt in checkpoint_dirs(run_copy / "run/checkpoints"):
        (ckpt / "rng-0.pt").write_bytes(b"\0" * 10)
    before = snapshot(run_copy)
    cli("export", run_copy / "r.yaml", run_copy / "hf", "--random-init").one_line(
        r"checkpoint error: the run's checkpoints in .*run/checkpoints are none of them intact "
        r"\(skipped: 0002-sft-step-000004: rng-0\.pt is truncated.*give --checkpoint DIR"
    )
    assert_kept(before, run_copy)
    assert not (run_copy / "hf").exists()


@pytest.mark.bad_input("output")
def test_export_overwrite_replaces_a_file_without_leftovers(cli, run_copy):
    out = run_copy / "model.bin"
    out.write_bytes(b"old export")
    before = snapshot(run_copy / "run")
    res = cli("export", run_copy / "r.yaml", out, "--checkpoint", run_copy / "run/checkpoints", "--overwrite")
    assert res.code == 0, res.err[-2000:]
    assert (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in run_copy.iterdir()) == ["model.bin", "r.yaml", "run"]  # nothing hidden
    assert_kept(before, run_copy / "run")


@pytest.mark.bad_input("output")
def test_export_of_a_missing_checkpoint_path_is_one_line(cli, run_copy):
    before = snapshot(run_copy)
    res = cli("export", run_copy / "r.yaml", run_copy / "hf", "--checkpoint", run_copy / "nope")
    res.one_line(r"--checkpoint .*nope does not exist")
    assert_kept(before, run_copy)
    assert not (run_copy / "hf").exists()


@pytest.mark.bad_input("checkpoint")
def test_export_refuses_non_finite_weights(cli, run_copy, monkeypatch):
    """A checkpoint whose weights are NaN (written before saves were checked) is not exported."""
    import moe_rl.megatron.checkpoint as ck
    from moe_rl.megatron.parallel import destroy_parallel

    owns_dist = not torch.distributed.is_initialized()
    policy = _load(run_copy)
    with torch.no_grad():
        next(policy.model.parameters()).fill_(float("nan"))
    monkeypatch.setattr(ck, "weights_finite", lambda model, group=None: True)
    ck.save_checkpoint(run_copy / "nan", 1, policy.model)
    if owns_dist:
        destroy_parallel()
    monkeypatch.undo()
    before = snapshot(run_copy)
    res = cli("export", run_copy / "r.yaml", run_copy / "hf", "--checkpoint", run_copy / "nan")
    res.one_line(r"checkpoint error: .*nan: the policy has non-finite weights: not exported")
    assert_kept(before, run_copy)
    assert not (run_copy / "hf").exists()


def _load(folder: Path):
    from moe_rl.config import load_recipe
    from moe_rl.megatron.checkpoint import load_checkpoint
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    r = load_recipe(folder / "r.yaml")
    policy = build_policy(r.model, r.parallel, init_parallel(r.parallel, seed=1))
    load_checkpoint(folder / "run/checkpoints", policy.model, load_rng=False)
    return policy


# -- train: another run's folder, --resume, --fresh ------------------------------------------------
@pytest.mark.bad_input("output")
def test_train_into_a_finished_run_without_resume_is_refused(cli, run_copy):
    before = snapshot(run_copy)
    cli("train", run_copy / "r.yaml").one_line(
        r"path error: .*checkpoints holds another run's checkpoints.*--resume.*train\.out_dir.*--fresh"
    )
    assert_kept(before, run_copy)


@pytest.mark.bad_input("checkpoint")
def test_resume_with_nothing_to_resume_says_so(cli, tmp_path):
    path = recipe(tmp_path)
    cli("train", path, "--resume").one_line(r"nothing to resume in .*checkpoints.*drop --resume")
    assert not (tmp_path / "run").exists()


@pytest.mark.bad_input("cli")
def test_resume_and_fresh_together_are_refused(cli, run_copy):
    before = snapshot(run_copy)
    cli("train", run_copy / "r.yaml", "--resume", "--fresh").one_line(r"--resume .* --fresh .*give one")
    assert_kept(before, run_copy)


@pytest.mark.bad_input("output")
def test_fresh_keeps_the_old_checkpoints_and_prunes_only_its_own(cli, run_copy):
    old = snapshot(run_copy / "run/checkpoints")
    old_rows = (run_copy / "run/metrics.jsonl").read_bytes()
    path = recipe(run_copy, "fresh.yaml", checkpoint={"every": 1, "keep": 1})
    res = cli("train", path, "--fresh")
    assert res.code == 0, res.err[-2000:]
    assert_kept({k: v for k, v in old.items() if k != "latest"}, run_copy / "run/checkpoints")
    # the old run's two and the fresh run's newest (numbered after them); latest names it
    assert ckpts(run_copy) == ["0001-sft-step-000002", "0002-sft-step-000004", "0006-sft-step-000004"]
    assert (run_copy / "run/checkpoints/latest").read_text() == "0006-sft-step-000004"
    assert (run_copy / "run/metrics.jsonl").read_bytes().startswith(old_rows)
    assert sft_steps(run_copy) == [0, 1, 2, 3] * 2


# -- checkpoints: fall back to the newest intact one ------------------------------------------------
def _break_newest(folder: Path, how: str) -> str:
    """Damage the newest checkpoint (0002-sft-step-000004) as ``how`` says; the name of the damaged entry."""
    root = folder / "run/checkpoints"
    if how == "dangling":
        shutil.rmtree(root / "0002-sft-step-000004")
        return "latest -> 0002-sft-step-000004"
    victim = max(
        (p for p in (root / "0002-sft-step-000004").rglob("*") if p.is_file() and p.name != "meta.json"),
        key=lambda p: p.stat().st_size,
    )
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] if how == "truncated" else bytes(len(data)))
    return "0002-sft-step-000004"


@pytest.mark.bad_input("checkpoint")
@pytest.mark.parametrize("how", ["dangling", "truncated", "corrupt"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(cli, run_copy, caplog, how):
    skipped = _break_newest(run_copy, how)
    kept = snapshot(run_copy / "run/checkpoints/0001-sft-step-000002")
    with caplog.at_level(logging.WARNING):
        res = cli("train", run_copy / "r.yaml", "--resume")
    assert res.code == 0, res.err[-2000:]
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert warned and skipped in warned[0], warned
    if how != "dangling":
        assert "truncated or corrupt" in warned[0]
    assert_kept(kept, run_copy / "run/checkpoints/0001-sft-step-000002")
    # resumed at SFT step 2, not from scratch: steps 2 and 3 ran again, each row once
    assert sft_steps(run_copy) == [0, 1, 2, 3]
    newest = checkpoint_dirs(run_copy / "run/checkpoints")[-1]
    assert verify_checkpoint(newest) is None


@pytest.mark.bad_input("checkpoint")
def test_resume_with_every_checkpoint_corrupt_is_one_line(cli, run_copy):
    for ckpt in checkpoint_dirs(run_copy / "run/checkpoints"):
        (ckpt / "rng-0.pt").write_bytes(b"\0" * 10)
    before = snapshot(run_copy)
    cli("train", run_copy / "r.yaml", "--resume").one_line(
        r"nothing to resume: no complete checkpoint .*0002-sft-step-000004: rng-0\.pt is truncated or corrupt"
    )
    assert_kept(before, run_copy)


@pytest.mark.bad_input("checkpoint")
def test_export_of_a_corrupt_checkpoint_is_one_line(cli, run_copy):
    _break_newest(run_copy, "corrupt")
    before = snapshot(run_copy)
    res = cli(
        "export",
        run_copy / "r.yaml",
        run_copy / "hf",
        "--checkpoint",
        run_copy / "run/checkpoints/0002-sft-step-000004",
    )
    res.one_line(r"checkpoint error: no complete checkpoint .*sha256 mismatch")
    assert_kept(before, run_copy)
    assert not (run_copy / "hf").exists()


@pytest.mark.bad_input("checkpoint")
def test_meta_records_checksums_and_finiteness(finished):
    """... and the run's id, the one its metrics rows carry (retention spares other owners')."""
    (run_id,) = {r["run"] for r in read_metrics(finished / "run/metrics.jsonl")}
    for ckpt in checkpoint_dirs(finished / "run/checkpoints"):
        meta = json.loads((ckpt / "meta.json").read_text())
        assert meta["finite"] is True and "rng-0.pt" in meta["sha256"]
        assert meta["owner"] == run_id
        assert verify_checkpoint(ckpt) is None


# -- resume: metrics rows, finished runs -----------------------------------------------------------
@pytest.mark.bad_input("checkpoint")
def test_resume_cuts_metrics_rows_after_the_checkpoint(cli, run_copy):
    """As after a kill between checkpoints: rows of steps 2 and 3 exist, the newest checkpoint is
    at step 2; the resumed run writes them once. The cut rows are moved to
    ``metrics.abandoned.jsonl``, not deleted, and the resumed run's rows carry the next attempt."""
    root = run_copy / "run/checkpoints"
    shutil.rmtree(root / "0002-sft-step-000004")
    (root / "latest").write_text("0001-sft-step-000002")
    res = cli("train", run_copy / "r.yaml", "--resume")
    assert res.code == 0, res.err[-2000:]
    assert sft_steps(run_copy) == [0, 1, 2, 3]
    rows = read_metrics(run_copy / "run/metrics.jsonl", "sft")
    abandoned = read_metrics(run_copy / "run/metrics.abandoned.jsonl", "sft")
    assert [(r["step"], r["attempt"]) for r in abandoned] == [(2, 0), (3, 0)]
    assert [(r["step"], r["attempt"]) for r in rows] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert len({r["run"] for r in rows + abandoned}) == 1  # one run, two attempts


@pytest.mark.bad_input("checkpoint")
def test_resume_of_a_finished_run_says_so_and_changes_nothing(cli, run_copy, caplog):
    before = snapshot(run_copy / "run")
    with caplog.at_level(logging.INFO):
        res = cli("train", run_copy / "r.yaml", "--resume")
    assert res.code == 0, res.err[-2000:]
    said = [r.getMessage() for r in caplog.records if "already finished" in r.getMessage()]
    assert len(said) == 1 and "sft 4 steps" in said[0], said
    assert_kept({k: v for k, v in before.items() if not k.startswith("tb/")}, run_copy / "run")
    assert sft_steps(run_copy) == [0, 1, 2, 3]


@pytest.mark.bad_input("checkpoint")
def test_resume_of_a_finished_run_with_more_steps_continues(cli, run_copy):
    res = cli("train", run_copy / "r.yaml", "train.sft_steps=6", "--resume")
    assert res.code == 0, res.err[-2000:]
    assert sft_steps(run_copy) == [0, 1, 2, 3, 4, 5]
    meta = json.loads((checkpoint_dirs(run_copy / "run/checkpoints")[-1] / "meta.json").read_text())
    assert meta["extra"]["completed"] == {"sft": 6}
    # the checkpoint after SFT step 6, numbered after the run's two: the name says stage and step
    assert ckpts(run_copy) == ["0001-sft-step-000002", "0002-sft-step-000004", "0003-sft-step-000006"]


@pytest.mark.bad_input("checkpoint")
def test_a_run_of_the_older_step_n_names_resumes(cli, run_copy):
    """A run written before checkpoints were named by stage and step (``step-00000002`` was its SFT
    step 4) resumes from its newest; the next checkpoint is named the new way, numbered after them."""
    root = run_copy / "run/checkpoints"
    for new, old in (("0001-sft-step-000002", "step-00000001"), ("0002-sft-step-000004", "step-00000002")):
        (root / new).rename(root / old)
    (root / "latest").write_text("step-00000002")
    res = cli("train", run_copy / "r.yaml", "train.sft_steps=6", "--resume")
    assert res.code == 0, res.err[-2000:]
    assert sft_steps(run_copy) == [0, 1, 2, 3, 4, 5]  # steps 4 and 5 only were run again
    assert ckpts(run_copy) == ["step-00000001", "step-00000002", "0003-sft-step-000006"]
    assert (root / "latest").read_text() == "0003-sft-step-000006"


# -- only good weights are saved -------------------------------------------------------------------
def _poison_after(monkeypatch, at_step: int, how: str) -> None:
    """From SFT step ``at_step`` on (0-based), leave the weights NaN or zero after the step."""
    import moe_rl.trainer.sft as sft

    real = sft.sft_step
    calls = []

    def step(policy, optimizer, tokens_BT, mask_BT, info):
        calls.append(1)
        out = real(policy, optimizer, tokens_BT, mask_BT, info)
        if len(calls) == at_step + 1:
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.fill_(float("nan") if how == "nan" else 0.0)
            optimizer.reload_model_params()
        return out

    monkeypatch.setattr(sft, "sft_step", step)


@pytest.mark.bad_input("checkpoint")
def test_non_finite_sft_stops_and_never_saves_nan(cli, tmp_path, monkeypatch):
    """Weights gone NaN after SFT step 1 (as a non-finite LR does): every later step is skipped,
    the run stops after train.max_bad_steps, and only the checkpoint before it exists."""
    _poison_after(monkeypatch, 2, "nan")
    path = recipe(tmp_path, sft_steps=8, max_bad_steps=2)
    line = cli("train", path).one_line(
        r"training stopped: 2 consecutive SFT steps had non-finite .* the last good checkpoint is .*0001-sft-step-000002"
    )
    assert "nothing saved" in line
    assert ckpts(tmp_path) == ["0001-sft-step-000002"]
    assert verify_checkpoint(tmp_path / "run/checkpoints/0001-sft-step-000002") is None


@pytest.mark.bad_input("checkpoint")
def test_nan_before_any_checkpoint_is_not_called_last_good(cli, tmp_path, monkeypatch):
    _poison_after(monkeypatch, 0, "nan")
    path = recipe(tmp_path, sft_steps=8, max_bad_steps=2)
    line = cli("train", path).one_line(r"training stopped: .*no good checkpoint of this run was written")
    assert "last good checkpoint is" not in line
    assert not (tmp_path / "run/checkpoints").exists() or ckpts(tmp_path) == []


@pytest.mark.bad_input("checkpoint")
def test_dead_policy_is_detected_and_never_saved(cli, tmp_path, monkeypatch):
    """Weights zeroed after SFT step 0: the output is uniform, the gradient exactly 0."""
    _poison_after(monkeypatch, 0, "zero")
    path = recipe(tmp_path, sft_steps=8)
    cli("train", path).one_line(
        r"training stopped: the policy is dead at sft step 2 .*gradient norm exactly 0"
    )
    assert not (tmp_path / "run/checkpoints").exists() or ckpts(tmp_path) == []


@pytest.mark.bad_input("checkpoint")
def test_retention_never_deletes_the_checkpoint_just_written(tmp_path, parallel_info):
    """A save numbered below older ones (the old name sort deleted it at once and left ``latest``
    dangling) keeps the new one; another owner's checkpoints are never pruned."""
    from moe_rl.megatron.checkpoint import latest_checkpoint, save_checkpoint
    from tests.tiny import tiny_policy

    model = tiny_policy().model
    save_checkpoint(tmp_path, 7, model, keep=1, owner="other")
    save_checkpoint(tmp_path, 12, model, keep=1, owner="me")
    new = save_checkpoint(tmp_path, 3, model, keep=1, owner="me")
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["0003-checkpoint", "0007-checkpoint"]
    assert latest_checkpoint(tmp_path) == new and verify_checkpoint(new) is None


RL = {"rl_steps": 3, "prompts_per_step": 2, "group_size": 2, "minibatches": 1, "max_new_tokens": 6}


def _zero_after_first_rl_step(monkeypatch) -> None:
    import moe_rl.trainer.loop as loop

    real, calls = loop.rl_step, []

    def step(run, i, timer):
        out = real(run, i, timer)
        calls.append(i)
        if len(calls) == 1:
            with torch.no_grad():
                for p in run.policy.model.parameters():
                    p.zero_()
            run.optimizer.reload_model_params()
        return out

    monkeypatch.setattr(loop, "rl_step", step)


@pytest.mark.bad_input("checkpoint")
def test_dead_policy_in_rl_rolls_back_and_is_never_saved(cli, tmp_path, monkeypatch):
    """Weights zeroed after RL step 0: step 1 sees a uniform output (entropy ln V), the sentinel
    rolls back to the last good checkpoint at half the LR, and the run finishes."""
    _zero_after_first_rl_step(monkeypatch)
    path = recipe(tmp_path, stages=["sft", "rl"], sft_steps=2, eval_prompts=2, **RL)
    res = cli("train", path, "checkpoint.every=0")
    assert res.code == 0, res.err[-3000:]
    rows = read_every_attempt(tmp_path / "run", "rl")  # the rollback moved the abandoned rows aside
    fired = [r["step"] for r in rows if r["sentinel/fired"]]
    assert fired == [1], [(r["step"], r["entropy/mean"]) for r in rows]
    assert rows[-1]["lr"] == pytest.approx(rows[0]["lr"] * 0.5)
    for ckpt in checkpoint_dirs(tmp_path / "run/checkpoints"):
        assert verify_checkpoint(ckpt) is None


@pytest.mark.bad_input("checkpoint")
def test_dead_policy_at_an_rl_checkpoint_is_not_saved(cli, tmp_path, monkeypatch):
    _zero_after_first_rl_step(monkeypatch)
    path = recipe(tmp_path, stages=["sft", "rl"], sft_steps=2, eval_prompts=2, **RL)
    before = snapshot(tmp_path)
    line = cli("train", path, "checkpoint.every=1").one_line(
        r"training stopped: rl step 1: the policy is dead \(output uniform.*not saved; the last good checkpoint is"
    )
    assert "0002-sft-step-000002" in line  # the end of SFT, the newest that passed the checks
    assert [p.name for p in checkpoint_dirs(tmp_path / "run/checkpoints")] == [
        "0001-sft-step-000001",
        "0002-sft-step-000002",
    ]
    assert_kept(before, tmp_path)


@pytest.mark.bad_input("checkpoint")
@pytest.mark.parametrize("how", ["export", "resume", "checkpoint.load"])
def test_a_checkpoint_of_another_shape_is_one_line_naming_the_tensor(cli, run_copy, how):
    """A recipe whose model differs from the checkpoint's (here the experts' width) used to end in
    megatron-core's CheckpointingException inside torch's CheckpointException: two tracebacks."""
    other = "model.moe_ffn_hidden_size=48"
    ckpts = run_copy / "run/checkpoints"
    before = snapshot(run_copy)
    if how == "export":
        res = cli("export", run_copy / "r.yaml", run_copy / "hf", other, "--checkpoint", ckpts)
    elif how == "resume":
        res = cli("train", run_copy / "r.yaml", other, "train.sft_steps=6", "--resume", cwd=run_copy)
    else:
        res = cli(
            "train", run_copy / "r.yaml", other, f"checkpoint.load={ckpts}", f"train.out_dir={run_copy}/new"
        )
    res.one_line(
        r"checkpoint error: checkpoint .*step-\d+ does not fit this recipe's model: "
        r"decoder\.layers\.mlp\.experts\.experts\.linear_fc1\.weight is .*64, 32.* in the checkpoint and .*96, 32.* in the model"
    )
    assert_kept(before, run_copy)


@pytest.mark.bad_input("output")
def test_demo_out_holding_a_users_files_is_refused(cli, tmp_path):
    """``moe-rl demo --out DIR`` used to remove DIR/grpo, DIR/gspo, DIR/grpo_r3 (a user's folders
    of those names, with their files) and overwrite report.png, without a word."""
    out = tmp_path / "mine"
    (out / "grpo").mkdir(parents=True)
    (out / "grpo" / "notes.txt").write_text("my notes")
    (out / "report.png").write_bytes(b"my picture")
    before = snapshot(out)
    cli("demo", "--out", out, "train.rl_steps=1").one_line(
        r"path error: compare --out .*mine holds files the compare did not write \(grpo, report\.png\): give a new or empty"
    )
    assert_kept(before, out)
    assert sorted(p.name for p in out.iterdir()) == ["grpo", "report.png"]


@pytest.mark.bad_input("output")
def test_demo_arm_config_error_is_named_before_any_arm_starts(cli, tmp_path):
    """An override one arm cannot take (replayed gate weights on an arm that replays no routes) used
    to show only in that arm's log, after SFT and the arms before it had run."""
    out = tmp_path / "demo"
    cli("demo", "--out", out, "algo.replay_gate_weights=true").one_line(
        r"configuration error: compare arm GRPO: .*algo.replay_gate_weights=true"
    )
    assert not out.exists()


@pytest.mark.bad_input("checkpoint")
def test_a_checkpoint_pruned_while_it_is_read_loads_the_newest_again(run_copy, monkeypatch, caplog):
    """A load from a run's checkpoint root raced that run's retention: the newest was chosen, then
    removed (really deleted here, right after the choice), and the load ended in a traceback. It
    loads the newest intact one again; a step directory given by name is one line."""
    import shutil

    import moe_rl.megatron.checkpoint as ck

    ckpts = run_copy / "run/checkpoints"
    real = ck.find_checkpoint
    pruned = []

    def choose_then_prune(path):
        found, skipped = real(path)
        if not pruned:  # the running run prunes what this load just chose
            shutil.rmtree(found)
            pruned.append(found.name)
        return found, skipped

    monkeypatch.setattr(ck, "find_checkpoint", choose_then_prune)
    meta = _load_meta(ck, ckpts)
    assert pruned == ["0002-sft-step-000004"] and Path(meta["path"]).name == "0001-sft-step-000002"
    assert "was removed while it was read" in caplog.text
    pruned.clear()
    with pytest.raises(ck.CheckpointError, match=r"0001-sft-step-000002 was removed while it was read"):
        _load_meta(ck, ckpts / "0001-sft-step-000002")


def _load_meta(ck, path) -> dict:
    from moe_rl.config import load_recipe
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    r = load_recipe(path.parents[2 if ck.step_number(path) is not None else 1] / "r.yaml")
    policy = build_policy(r.model, r.parallel, init_parallel(r.parallel, seed=1))
    return ck.load_checkpoint(path, policy.model, load_rng=False)


@pytest.mark.bad_input("output")
def test_export_writes_the_dtype_the_policy_trained_in_and_says_which(cli, run_copy):
    """Issue 49: an fp32 policy is exported in fp32 unless --dtype asks for bf16 (it used to be bf16
    by default, said only in -h); the line says which and why."""
    import json

    ckpt = run_copy / "run/checkpoints"
    res = cli("export", run_copy / "r.yaml", run_copy / "fp32", "--checkpoint", ckpt)
    assert res.code == 0, res.err[-2000:]
    assert res.out.rstrip().endswith(
        "in float32 (model.dtype, the dtype the policy trained in; --dtype to choose)"
    )
    assert {t.dtype for t in _tensors(run_copy / "fp32").values()} == {torch.float32}
    assert json.loads((run_copy / "fp32" / "config.json").read_text())["torch_dtype"] == "float32"
    res = cli("export", run_copy / "r.yaml", run_copy / "bf16", "--checkpoint", ckpt, "--dtype", "bfloat16")
    assert res.code == 0 and res.out.rstrip().endswith("in bfloat16 (--dtype)"), res.out
    assert {t.dtype for t in _tensors(run_copy / "bf16").values()} == {torch.bfloat16}


@pytest.mark.bad_input("checkpoint")
def test_non_finite_start_weights_are_named_as_such_before_a_step(cli, tmp_path):
    """An HF start with a NaN in one tensor: the run used to take three non-finite SFT steps and
    stop blaming the learning rate ("lower optim.lr")."""
    from safetensors.torch import load_file, save_file

    r = recipe(tmp_path)
    assert cli("export", r, tmp_path / "hf", "--random-init", "--dtype", "float32").code == 0
    shard = next((tmp_path / "hf").glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(k for k in tensors if "mlp.gate" in k or "router" in k or "experts" in k)
    tensors[name][0].fill_(float("nan"))
    save_file(tensors, shard, metadata={"format": "pt"})
    line = cli("train", r, f"model.hf_path={tmp_path / 'hf'}").one_line(
        r"training stopped: the start weights hold NaN or infinite values \(.*\), from model\.hf_path=.*hf: "
        r"nothing trained"
    )
    assert "optim.lr" not in line
    assert not ckpts(tmp_path)
