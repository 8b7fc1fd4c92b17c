"""The studies a change touches: ``.ci/run`` runs their tests (a study's tests run when it changes).

A change is what differs between the working tree and its merge base with ``--base`` (default
``main``; on ``main`` itself, its parent). A study is touched when a file under
``studies/<name>/`` changed; ``studies/conftest.py`` or ``studies/__init__.py`` touch every study.
Where the base is unknown (a clone without it) every study counts as touched.

    python -m tools.changed_studies [--base main]     # prints one studies/<name> per line
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def all_studies() -> list[str]:
    return sorted(
        f"studies/{p.name}"
        for p in (ROOT / "studies").iterdir()
        if p.is_dir() and not p.name.startswith((".", "_"))
    )


def touched(paths: list[str], studies: list[str]) -> list[str]:
    """The studies of ``studies`` a change of ``paths`` (relative to the checkout) touches."""
    if any(p in ("studies/conftest.py", "studies/__init__.py") for p in paths):
        return list(studies)
    return [s for s in studies if any(p.startswith(s + "/") for p in paths)]


def changed_paths(base: str) -> list[str] | None:
    """Paths changed since the merge base with ``base`` (None: no such base here)."""

    def git(*args: str) -> str | None:
        res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return res.stdout.strip() if res.returncode == 0 else None

    head, tip = git("rev-parse", "HEAD"), git("rev-parse", "--verify", "-q", base)
    if head is None or tip is None:
        return None
    fork = git("rev-parse", "HEAD~1") if head == tip else git("merge-base", base, "HEAD")
    if fork is None:
        return None
    out = git("diff", "--name-only", fork)
    untracked = git("ls-files", "--others", "--exclude-standard", "studies")
    return None if out is None else [p for p in (out + "\n" + (untracked or "")).splitlines() if p]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.changed_studies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="main", help="the branch a change is measured from (default: main)")
    args = ap.parse_args(argv)
    paths = changed_paths(args.base)
    print("\n".join(all_studies() if paths is None else touched(paths, all_studies())))
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
