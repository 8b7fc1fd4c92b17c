"""The bad-input suite's harness: run a ``moe-rl`` command as a user would and check what they see.

Every case asserts three things: the exit code, that stderr carries exactly one ``moe-rl: ...``
line naming the problem (and no traceback), and that nothing the user had was lost
(:func:`snapshot` before, compare after). Cases carry the ``bad_input`` marker with their
category, so ``pytest tests/badinput -m bad_input --co -q`` counts them per category.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_MODEL = {
    "vocab_size": 104,
    "hidden_size": 32,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_query_groups": 1,
    "head_dim": 16,
    "moe_ffn_hidden_size": 32,
    "num_experts": 4,
    "moe_router_topk": 2,
    "max_seq_len": 48,
}
"The one-layer MoE the cases that really train use (seconds per run)."
CATEGORIES = ("recipe", "override", "data", "checkpoint", "output", "cli", "signal", "server", "reward", "os")


def pytest_collection_modifyitems(items):
    for item in items:
        m = item.get_closest_marker("bad_input")
        if m is not None and (not m.args or m.args[0] not in CATEGORIES):
            raise pytest.UsageError(f"{item.nodeid}: bad_input needs a category of {CATEGORIES}")


@dataclass
class Result:
    code: int
    out: str
    err: str

    def one_line(self, pattern: str, code: int = 2) -> str:
        """Assert the user saw exit ``code`` and one ``moe-rl:`` line on stderr matching ``pattern``
        (a regex, case-insensitive), with no traceback; return that line."""
        assert self.code == code, f"exit {self.code} != {code}\nstdout:\n{self.out}\nstderr:\n{self.err}"
        assert "Traceback" not in self.err, self.err
        lines = [ln for ln in self.err.splitlines() if ln.startswith("moe-rl:")]
        assert len(lines) == 1, f"expected one 'moe-rl:' line, got {lines}\nstderr:\n{self.err}"
        assert re.search(pattern, lines[0], re.IGNORECASE), f"{pattern!r} not in {lines[0]!r}"
        return lines[0]


def run_cli(*args: str, cwd: Path | None = None, capsys=None, timeout: float = 300) -> Result:
    """``moe-rl ARGS``: in this process with ``capsys`` (fast), else as a subprocess (real exit
    code, signals, a fresh interpreter)."""
    if capsys is not None:
        from moe_rl.cli import main

        old = Path.cwd()
        os.chdir(cwd or old)
        try:
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse errors
                code = e.code if isinstance(e.code, int) else 2
        finally:
            os.chdir(old)
        cap = capsys.readouterr()
        return Result(code, cap.out, cap.err)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Result(p.returncode, p.stdout, p.stderr)


def snapshot(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (what must not be lost)."""
    root = Path(root)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_kept(before: dict[str, str], root: Path) -> None:
    """Every file of ``before`` is still under ``root`` with the same bytes."""
    after = snapshot(root)
    lost = {k for k in before if after.get(k) != before[k]}
    assert not lost, f"lost or changed: {sorted(lost)}"


@pytest.fixture
def cli(capsys):
    """``cli(*args, cwd=None)`` runs ``moe-rl`` in-process and returns a :class:`Result`."""

    def call(*args, cwd=None):
        return run_cli(*args, cwd=cwd, capsys=capsys)

    return call
