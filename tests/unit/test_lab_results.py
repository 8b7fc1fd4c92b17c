"""moe_rl.lab.results.write_json: ``null`` for non-finite numbers, and the previous file kept
whole when a write fails (a real full file system: a small tmpfs, where mounting is allowed)."""

import json
import math

import pytest
import torch

from moe_rl.lab.results import json_safe, write_json
from tests.tmpfs import mount_tmpfs


def test_non_finite_numbers_are_null_and_the_file_is_strict_json(tmp_path):
    doc = {"rate": float("nan"), "fit": [1.0, float("inf"), -math.inf], "t": torch.tensor(2.5), "ok": 3}
    path = write_json(tmp_path / "r.json", doc)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"rate": None, "fit": [1.0, None, None], "t": 2.5, "ok": 3}
    assert json_safe((1.0, float("nan"))) == [1.0, None]


@pytest.fixture
def tiny_fs(tmp_path):
    unmount = mount_tmpfs(tmp_path / "small", "size=64k")
    yield tmp_path / "small"
    unmount()


def test_a_full_disk_keeps_the_previous_result_whole(tiny_fs):
    """Written in place, a full disk left an 8 KB truncated JSON where the last good result was."""
    path = write_json(tiny_fs / "result.json", {"headline": {"x": 1}})
    before = path.read_bytes()
    with pytest.raises(OSError):
        write_json(path, {"rows": ["y" * 1000] * 200})  # ~200 KB on a 64 KB file system
    assert path.read_bytes() == before
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["result.json"]  # no temp file left
