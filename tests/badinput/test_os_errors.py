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
