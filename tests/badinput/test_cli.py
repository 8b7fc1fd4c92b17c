"""Every ``moe-rl`` command answers a user mistake with one line and exit code 2.

``report``, ``plan``, ``serve``, ``bench``, ``demo``, ``export`` and argparse usage errors; a
full disk; ``-v`` for the traceback; and a bug (not a user error) keeps its traceback.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.badinput.conftest import assert_kept, run_cli, snapshot

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny.yaml"
cli_case = pytest.mark.bad_input("cli")


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A finished-looking run folder: a few metrics rows and a checkpoint file that must survive."""
    d = tmp_path / "run"
    (d / "checkpoints" / "step_2").mkdir(parents=True)
    (d / "checkpoints" / "step_2" / "model.pt").write_bytes(b"\x00weights")
    rows = [{"stage": "rl", "step": s, "reward/mean": 0.1 * s} for s in range(3)]
    rows.append({"stage": "rl_eval", "step": 3, "eval/accuracy": 0.5})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@cli_case
def test_report_missing_run_folder(cli, tmp_path):
    cli("report", tmp_path / "gone", "--out", tmp_path / "r.png").one_line(
        r"path error: run folder .*gone does not exist"
    )
    assert not (tmp_path / "r.png").exists()


@cli_case
def test_report_folder_without_metrics(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    cli("report", f"a={tmp_path / 'empty'}", "--out", tmp_path / "r.png").one_line(
        r"path error: .*empty has no metrics\.jsonl"
    )


@cli_case
def test_report_corrupt_metrics_line(cli, tmp_path, run_dir):
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"stage": "rl", "st\n')
    before = snapshot(run_dir)
    cli("report", run_dir, "--out", tmp_path / "r.png").one_line(
        r"data error: .*metrics\.jsonl:5: not a JSON metrics row"
    )
    assert_kept(before, run_dir)


@cli_case
def test_report_out_is_a_folder(cli, tmp_path, run_dir):
    before = snapshot(tmp_path)
    cli("report", run_dir, "--out", run_dir).one_line(r"--out .*run is a folder: give a file name")
    assert_kept(before, tmp_path)


@cli_case
def test_report_bad_run_argument(cli, tmp_path):
    cli("report", "name=").one_line(r"run 'name=': write NAME=DIR or DIR")


@cli_case
def test_full_disk_is_one_line(cli, tmp_path, run_dir, monkeypatch):
    """The plot written onto a full device (Linux's /dev/full answers ENOSPC; matplotlib's own
    savefig does not report it, so the write here is a plain one)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    import moe_rl.lab.report

    def plot(arms, out_png):
        with open("/dev/full", "wb") as f:
            f.write(b"\x89PNG" * 4096)

    monkeypatch.setattr(moe_rl.lab.report, "plot", plot)
    before = snapshot(run_dir)
    cli("report", run_dir, "--out", tmp_path / "r.png").one_line(
        r"disk full: no space left on the device: free"
    )
    assert_kept(before, run_dir)


@cli_case
def test_full_disk_under_torch_save(cli, tmp_path, monkeypatch):
    """torch.save onto a full device says only "unexpected pos A vs B": still one disk-full line."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    import torch

    import moe_rl.cli

    monkeypatch.setattr(moe_rl.cli, "cmd_check", lambda args: torch.save(torch.zeros(10_000), "/dev/full"))
    cli("check", RECIPE).one_line(r"disk full: writing a torch file \(a checkpoint\) failed \(unexpected pos")


@cli_case
def test_full_disk_names_the_file(cli, tmp_path, monkeypatch):
    """An ENOSPC that carries its file name (as open() and mkdir() raise it) names it."""
    import moe_rl.cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(moe_rl.cli, "cmd_check", full)
    cli("check", RECIPE).one_line(r"disk full: no space left on the device writing .*run/metrics\.jsonl")


@cli_case
def test_plan_yaml_syntax_error(cli, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: {hidden_size: 64\n")
    before = snapshot(tmp_path)
    cli("plan", recipe).one_line(r"configuration error: .*bad\.yaml:\d+:\d+: YAML syntax error")
    assert_kept(before, tmp_path)


@cli_case
def test_plan_missing_recipe(cli, tmp_path):
    cli("plan", tmp_path / "nope.yaml").one_line(r"recipe .*nope\.yaml does not exist")


@cli_case
def test_plan_bad_flag_value(cli):
    cli("plan", RECIPE, "--num-gpus", "many").one_line(r"usage error: moe-rl plan: argument --num-gpus")


@cli_case
def test_serve_missing_model_path(cli, tmp_path):
    cli("serve", "--model-path", tmp_path / "nothing").one_line(
        r"--model-path .*nothing: expected an HF checkpoint directory \(config\.json\) or a moe-rl recipe"
    )


@cli_case
def test_serve_recipe_with_yaml_error(cli, tmp_path):
    recipe = tmp_path / "serve.yaml"
    recipe.write_text("model:\n  hidden_size: 64\n   num_layers: 2\n")
    before = snapshot(tmp_path)
    cli("serve", "--model-path", recipe).one_line(r"serve\.yaml:\d+:\d+: YAML syntax error")
    assert_kept(before, tmp_path)


@cli_case
@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_bad_port(cli, tmp_path, port):
    cli("serve", "--model-path", RECIPE, f"--port={port}").one_line(
        rf"--port {port}: give a port number in 0\.\.65535"
    )


@cli_case
def test_bench_unknown_name(cli):
    cli("bench", "no_such_bench").one_line(r"no benchmark 'no_such_bench'; available: .*throughput")


@cli_case
def test_demo_missing_recipe(cli, tmp_path):
    cli("demo", "--recipe", tmp_path / "gone.yaml").one_line(r"recipe .*gone\.yaml is not a file")


@cli_case
def test_demo_bad_jobs(cli):
    cli("demo", "--jobs", "0").one_line(r"--jobs '0': give a whole number >= 1")


def test_demo_without_a_start_is_refused(tmp_path):
    from moe_rl.errors import UserError
    from moe_rl.lab.demo import run_demo

    (tmp_path / "r.yaml").write_text(f"include: {ROOT / 'recipes/demo/base.yaml'}\ntrain: {{stages: [rl]}}\n")
    with pytest.raises(UserError, match="neither model.hf_path nor checkpoint.load names a start"):
        run_demo(tmp_path / "r.yaml", out=tmp_path / "demo")
    assert not (tmp_path / "demo").exists()


@cli_case
def test_export_missing_recipe(cli, tmp_path):
    cli("export", tmp_path / "nope.yaml", tmp_path / "hf").one_line(r"recipe .*nope\.yaml does not exist")
    assert not (tmp_path / "hf").exists()


@cli_case
def test_train_without_a_recipe(cli):
    cli("train").one_line(r"usage error: moe-rl train: the following arguments are required: recipe")


@cli_case
def test_unknown_command(cli):
    cli("trian", RECIPE).one_line(r"usage error: moe-rl: argument cmd: invalid choice: 'trian'")


@pytest.mark.integration
@cli_case
def test_subprocess_exit_code_and_line(tmp_path):
    """The installed entry point as a user runs it: real exit code 2, one line, no traceback."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: {RECIPE}\noptim:\n  lr: .inf\n")
    before = snapshot(tmp_path)
    run_cli("check", recipe, timeout=120).one_line(r"optim\.lr=inf is not a finite number")
    assert_kept(before, tmp_path)


@pytest.mark.parametrize("error", [KeyError("internal"), RuntimeError("internal: shapes differ")])
def test_a_bug_keeps_its_traceback(monkeypatch, error):
    """Not a user error: main lets it through (the interpreter prints the traceback)."""
    import moe_rl.cli

    def bug(args):
        raise error

    monkeypatch.setattr(moe_rl.cli, "cmd_check", bug)
    with pytest.raises(type(error), match="internal"):
        moe_rl.cli.main(["check", str(RECIPE)])


def test_other_os_errors_are_not_disk_full(cli, monkeypatch):
    """A permission error is not called a full disk. (It used to keep its traceback; issue 32 asks
    for one line for every OSError class: tests/badinput/test_os_errors.py has the real ones.)"""
    import moe_rl.cli

    def denied(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/root/x")

    monkeypatch.setattr(moe_rl.cli, "cmd_check", denied)
    line = cli("check", RECIPE).one_line(r"file system: EACCES on /root/x: permission denied: pick a folder")
    assert "disk full" not in line


@cli_case
@pytest.mark.parametrize(
    "code, said",
    [
        (errno.EEXIST, r"file system: EEXIST on /srv/x: it already exists: remove it or pick another path"),
        (errno.EBUSY, r"file system: EBUSY on /srv/x: the device or file is busy .*retry once it is free"),
        (errno.EIO, r"file system: EIO on /srv/x: input/output error: the disk or the network file system"),
    ],
    ids=["file-exists", "device-busy", "io-error"],
)
def test_file_exists_device_busy_and_io_errors_are_one_line(cli, monkeypatch, code, said):
    """The other ``OSError`` classes docs/safety.md names (read-only, name too long: test_os_errors.py;
    permission: above), as Python raises them (``OSError(EEXIST, ...)`` is a ``FileExistsError``):
    one line naming the errno, the path and the fix."""
    import os

    import moe_rl.cli

    def fails(args):
        raise OSError(code, os.strerror(code), "/srv/x")

    monkeypatch.setattr(moe_rl.cli, "cmd_check", fails)
    cli("check", RECIPE).one_line(said)
