"""The fast tier starts no child process (conftest.py): a test in tests/unit or tests/badinput that
does fails, naming tests/integration; git, mount and umount stay allowed."""

import subprocess
import sys

import pytest

from conftest import ALLOWED_CHILDREN, child_refused, in_fast_tier


def test_this_file_is_in_the_fast_tier_and_a_child_python_fails_it():
    assert in_fast_tier(__file__)
    with pytest.raises(BaseException, match="tests/integration") as e:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert not isinstance(e.value, Exception), "a Failed outcome, which `except Exception` does not swallow"


def test_git_and_mount_are_allowed_and_the_rule_reads_every_form():
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
    assert {"git", "mount", "umount"} == ALLOWED_CHILDREN
    assert child_refused(["/usr/bin/git", "status"]) is None and child_refused("umount /x") is None
    for args in ([sys.executable, "-m", "moe_rl.cli"], "torchrun --nproc 2 x.py", [b"/bin/bash", b"x.sh"]):
        assert "tests/integration" in child_refused(args)


def test_the_other_tiers_are_not_fast():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert in_fast_tier(root / "tests/badinput/test_cli.py")
    for other in (
        "tests/integration/test_signals.py",
        "tests/dist/test_slurm.py",
        "studies/noise/test_design.py",
    ):
        assert not in_fast_tier(root / other)


def test_a_study_runs_when_its_folder_changes():
    from tools.changed_studies import touched

    studies = ["studies/collapse", "studies/noise"]
    assert touched(["studies/noise/design.py", "moe_rl/lab/stats.py"], studies) == ["studies/noise"]
    assert touched(["studies/noise_extra.txt", "README.md"], studies) == []
    assert touched(["studies/conftest.py"], studies) == studies
