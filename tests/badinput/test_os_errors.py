"""Every file-system failure a user can meet is one line naming the path and the fix: a real
read-only file system (a tmpfs mounted read-only; needs root, as in CI), a name too long for the
file system, and an outside service that is down. ``moe-rl -v`` keeps the traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.badinput.conftest import ROOT, assert_kept, snapshot
from tests.badinput.test_outputs_checkpoints import recipe
from tests.tmpfs import mount_tmpfs

pytestmark = pytest.mark.bad_input("os")


@pytest.fixture
def read_only(tmp_path) -> Path:
    """A real read-only file system (tmpfs, ``mount -o ro``); skipped where mounting is not allowed."""
    unmount = mount_tmpfs(tmp_path / "ro", "ro,size=1m")
    yield tmp_path / "ro"
    unmount()


def test_train_into_a_read_only_file_system(cli, tmp_path, read_only):
    path = recipe(tmp_path)
    before = snapshot(tmp_path / "r.yaml")
    cli("train", path, f"train.out_dir={read_only}/run").one_line(
        rf"file system: EROFS on {read_only}/run.*: the file system is read-only: pick a folder on a writable one"
    )
    assert_kept(before, tmp_path / "r.yaml")


def test_export_into_a_read_only_file_system(cli, tmp_path, read_only):
    cli("export", recipe(tmp_path), read_only / "hf", "--random-init").one_line(
        rf"file system: EROFS on {read_only}/.*: the file system is read-only"
    )


def test_a_name_too_long_for_the_file_system(cli, tmp_path):
    long = tmp_path / ("x" * 300)
    cli("train", recipe(tmp_path), f"train.out_dir={long}").one_line(
        r"file system: ENAMETOOLONG on .*xxxx.*: the name is too long for the file system: use a shorter path"
    )


def test_an_sglang_server_that_is_down_is_one_line(cli, tmp_path):
    """An attached server nobody listens on: ``unavailable``, naming the address (it was a
    ``SGLangUnavailable`` traceback)."""
    from moe_rl.dist import free_port

    url = f"http://127.0.0.1:{free_port()}"
    overrides = [
        "train.stages=[rl]",
        "rollout.engine=sglang",
        f"rollout.sglang.url={url}",
        f"train.out_dir={tmp_path}/run",
        "rollout.timeout_s=5",
        "rollout.retries=0",
    ]
    cli("train", ROOT / "recipes/tiny.yaml", *overrides).one_line(
        r"unavailable: .*127\.0\.0\.1.*start it or check its log"
    )


@pytest.fixture
def full_disk(tmp_path) -> Path:
    """A real, nearly full file system: a 64 KiB tmpfs (a lock file fits, a checkpoint or an export
    does not); skipped where mounting is not allowed (not root)."""
    unmount = mount_tmpfs(tmp_path / "full", "size=64k")
    yield tmp_path / "full"
    unmount()


def test_a_checkpoint_save_onto_a_full_disk_is_one_line_naming_it(cli, tmp_path, full_disk):
    """megatron-core's writer reported it as a CheckpointException of its workers' RuntimeError
    (a traceback); the suite only monkeypatched a full disk before. Nothing half-written stays."""
    path = recipe(tmp_path)
    res = cli("train", path, f"checkpoint.dir={full_disk}/ck")
    res.one_line(
        rf"disk full: no space left on the device writing {full_disk}/ck/0001-sft-step-000002: free space"
    )
    assert not list(full_disk.rglob("*"))  # no staging folder, no checkpoint, no lock left
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"stage": "sft"') >= 2


def test_an_export_onto_a_full_disk_is_one_line_naming_it(cli, tmp_path, full_disk):
    res = cli("export", recipe(tmp_path), full_disk / "hf", "--random-init")
    res.one_line(rf"disk full: no space left on the device writing {full_disk}/hf: free space")
    assert not list(full_disk.iterdir())  # the staging folder is gone
