"""The harness itself fails when it should (a traceback, two lines, the wrong code)."""

import pytest

from tests.badinput.conftest import Result, assert_kept, snapshot


def test_one_line_rejects_tracebacks_and_extra_lines():
    Result(2, "", "moe-rl: configuration error: train.lr must be finite\n").one_line("train.lr")
    with pytest.raises(AssertionError):
        Result(2, "", "Traceback (most recent call last):\nmoe-rl: x\n").one_line("x")
    with pytest.raises(AssertionError):
        Result(2, "", "moe-rl: a\nmoe-rl: b\n").one_line("a")
    with pytest.raises(AssertionError):
        Result(1, "", "moe-rl: a\n").one_line("a")


def test_assert_kept_sees_a_changed_file(tmp_path):
    (tmp_path / "a").write_text("1")
    before = snapshot(tmp_path)
    assert_kept(before, tmp_path)
    (tmp_path / "a").write_text("2")
    with pytest.raises(AssertionError):
        assert_kept(before, tmp_path)
