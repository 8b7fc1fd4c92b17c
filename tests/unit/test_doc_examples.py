"""Every example in README.md and docs/*.md runs as written (issue 49, item 5).

The examples are the fenced blocks whose language is ``bash`` / ``sh`` / ``shell`` or ``python``
(``yaml`` and ``json`` blocks are files the others use, or excerpts; a block without a language is
a picture, a layout or output). The blocks of one Markdown file run in order, as a reader would, in
one scratch folder (``runs/`` lands there) that sees the checkout (``recipes/``, ``launch/``,
``benchmarks/``, ``.venv``...) through links, with the checkout's ``moe-rl`` and ``python`` first
on the PATH:

- a ``bash`` block runs as one ``bash -euo pipefail`` script; a server it starts in the
  background (``&``) is stopped when the block ends;
- a ``python`` (or ``yaml`` / ``json``) block whose first line is a comment naming a file
  (``# make_data.py: ...``) is written to that file, for the blocks after it; a python block runs
  (``python FILE``) when it has no name or holds an ``if __name__ == "__main__":`` guard;
- a comment line just before a block's fence says otherwise: ``<!-- example: skip: REASON -->``
  (not run here: a GPU, a cluster, the network, hours; the reason is required) or
  ``<!-- example: file NAME -->`` (write the block to NAME, whatever its first line);
- a bash block that installs (``make venv``, ``pip install``, ``python -m venv``) or runs the
  suite (``make test``, ``make demo``) must be marked ``skip``: the scratch folder links the
  checkout's own venv, which an install there would change.

:func:`test_every_example_is_run_or_says_why_not` checks the classification (fast tier);
:func:`test_the_examples_run` runs them, one Markdown file per case (``integration``: child processes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RUN = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
FILES = ("python", "yaml", "yml", "json")
MARKER = re.compile(r"^<!--\s*example:\s*(skip|file)\b\s*:?\s*(.*?)\s*-->$")
NAMED = re.compile(r"^#\s*([\w./-]+\.(?:py|ya?ml|json))\b")
LINKED = (
    "recipes",
    "launch",
    "benchmarks",
    "docs",
    "moe_rl",
    "kernels",
    "tests",
    "Makefile",
    "pyproject.toml",
)
BLOCK_TIMEOUT_S = 1200
INSTALLS = re.compile(
    r"(^|[;&|(]\s*|\s)(make\s+(venv|test\S*|demo)\b|pip3?\s+install\b|python3?\s+-m\s+(venv|pip)\b)", re.M
)
"""What an example may not run here unmarked: an install (into the checkout's own venv, which the
scratch folder links) or the test suite itself; such a block needs ``example: skip``."""


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    "Line of the opening fence (1-based)."
    lang: str
    text: str
    marker: tuple[str, str] | None
    "(skip | file, its argument) from the comment line before the fence."

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def file(self) -> str | None:
        """The file this block is written to, or None."""
        if self.marker and self.marker[0] == "file":
            return self.marker[1]
        first = self.text.splitlines()[0] if self.text.strip() else ""
        m = NAMED.match(first) if self.lang in FILES else None
        return m.group(1) if m else None

    @property
    def runs(self) -> bool:
        if self.marker or self.lang not in RUN:
            return False
        if self.lang == "python" and self.file is not None:
            return 'if __name__ == "__main__":' in self.text
        return True


def blocks(doc: Path) -> list[Block]:
    """The fenced blocks of ``doc``, with the marker on the line before each fence."""
    out, lines = [], doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})\s*([\w+-]*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        before = lines[i - 1].strip() if i else ""
        m = MARKER.match(before)
        marker = (m.group(1), m.group(2)) if m else None
        out.append(Block(doc, i + 1, fence.group(2).lower(), "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return out


def test_every_example_is_run_or_says_why_not():
    """Each bash / python block runs, is a file a later block uses, or is skipped with a reason; a
    marker names a file or a reason."""
    problems = []
    for doc in DOCS:
        for b in blocks(doc):
            if b.marker and not b.marker[1]:
                problems.append(
                    f"{b.where}: example: {b.marker[0]} needs a {'reason' if b.marker[0] == 'skip' else 'file name'}"
                )
            if b.lang in RUN and not (b.runs or b.file or (b.marker and b.marker[0] == "skip")):
                problems.append(f"{b.where}: a {b.lang} block that neither runs nor names its file")
            if b.runs and b.lang == "bash" and INSTALLS.search(b.text):
                what = INSTALLS.search(b.text).group(2)
                problems.append(
                    f"{b.where}: runs `{what}`: mark it <!-- example: skip: REASON --> (not run here)"
                )
    assert not problems, "\n".join(problems)


def sandbox(tmp: Path) -> dict[str, str]:
    """A scratch folder seeing the checkout through links; the environment the examples run in."""
    for name in (*LINKED, ".venv"):
        if (ROOT / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env.pop("PYTHONWARNINGS", None)  # warnings as a user sees them
    return env


def run_block(b: Block, tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    if b.lang == "python":
        script = tmp / (b.file or f"example_{b.line}.py")
        script.write_text(b.text)
        cmd = [sys.executable, script.name]
    else:
        script = tmp / f"example_{b.line}.sh"
        # a server started in the background stops with the block (its process group)
        script.write_text("trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + b.text)
        cmd = ["bash", "-euo", "pipefail", script.name]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


@pytest.mark.integration
@pytest.mark.parametrize("doc", [d for d in DOCS if any(b.runs for b in blocks(d))], ids=lambda d: d.name)
def test_the_examples_run(doc, tmp_path):
    env = sandbox(tmp_path)
    for b in blocks(doc):
        if b.file and not b.runs:
            (tmp_path / b.file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / b.file).write_text(b.text)
        if not b.runs:
            continue
        res = run_block(b, tmp_path, env)
        assert res.returncode == 0, (
            f"{b.where} ({b.lang}) exited {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
        )
