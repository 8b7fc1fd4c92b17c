"""benchmarks/results/INDEX.md: which result of each benchmark is current.

Results are named ``<bench>-<machine>-<preset>-<commit>[-dirty][-<part>].<ext>`` (``result_path``).
Files of one ``<bench>-<machine>-<preset>`` are one series; its current result is the one of the
newest commit in this branch's history (``git rev-list HEAD``), the others superseded, and a file
whose commit is not in the history (made in a worktree, on a branch that was rebased) is marked so.
Each row says which docs cite the file. Pre-registrations (no commit in the name) are listed apart.

    python -m benchmarks.index            # rewrite INDEX.md
    python -m benchmarks.index --check    # exit 1 when INDEX.md is not what it would write
    python -m benchmarks.index --prune    # delete superseded files no doc, test or code names

``tests/unit/test_results_index.py`` holds INDEX.md to what this writes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from moe_rl.files import read_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.md"
NAME = re.compile(
    r"^(?P<series>.+)-(?P<commit>[0-9a-f]{7,40})(?P<dirty>-dirty)?(?P<part>-[a-z]+)?\.(?P<ext>\w+)$"
)
CITERS = ("README.md", "docs", "tests", "benchmarks", "moe_rl", "recipes")
"Where a result may be named (the results folder itself excluded)."


def history() -> dict[str, int]:
    """Short commit (7) -> its age in HEAD's history (0: HEAD)."""
    out = subprocess.run(
        ["git", "rev-list", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {sha[:7]: i for i, sha in enumerate(out)}


def cited() -> dict[str, list[str]]:
    """Result file name -> the files (relative to the checkout) that name it."""
    names = {p.name for p in RESULTS.iterdir() if p.is_file()}
    hits: dict[str, list[str]] = defaultdict(list)
    for where in CITERS:
        base = ROOT / where
        files = (
            [base] if base.is_file() else [p for p in base.rglob("*") if p.suffix in {".md", ".py", ".yaml"}]
        )
        for f in files:
            if RESULTS in f.parents or not f.is_file():
                continue
            text = f.read_text(errors="replace")
            paragraphs = re.split(r"\n\s*\n|\n- ", text)
            for n in names:
                m = NAME.match(n)
                stem = n.rsplit(".", 1)[0]
                by_name = stem in text or bool(m and f"{m['series']}-{m['commit']}" in text)
                # "earlier runs (abce10b, db02d00)" in a paragraph naming the benchmark: cited by commit
                by_commit = bool(m) and any(
                    m["commit"][:7] in para and m["series"].split("-")[0] in para for para in paragraphs
                )
                if by_name or by_commit:
                    hits[n].append(str(f.relative_to(ROOT)))
    return hits


def classify() -> tuple[dict[str, list[dict]], list[str]]:
    """(series -> files newest first, each ``{"name", "commit", "age", "status"}``), unnamed files."""
    ages = history()
    series: dict[str, list[dict]] = defaultdict(list)
    loose = []
    for p in sorted(RESULTS.iterdir()):
        if not p.is_file() or p.name == INDEX.name or p.name.startswith("."):
            continue
        m = NAME.match(p.name)
        if not m:
            loose.append(p.name)
            continue
        commit = m["commit"][:7]
        series[m["series"]].append({"name": p.name, "commit": commit, "age": ages.get(commit)})
    for files in series.values():
        known = [f["age"] for f in files if f["age"] is not None]
        newest = min(known) if known else None
        for f in files:
            f["status"] = (
                "not in history" if f["age"] is None else "current" if f["age"] == newest else "superseded"
            )
        files.sort(key=lambda f: (f["age"] is None, f["age"] if f["age"] is not None else 0, f["name"]))
    return dict(sorted(series.items())), loose


def headline_of(name: str) -> str:
    """A short rendering of a JSON result's ``headline`` (its first few scalar figures)."""
    if not name.endswith(".json"):
        return ""
    try:
        head = read_json(RESULTS / name).get("headline")
    except (OSError, ValueError):
        return ""
    if not isinstance(head, dict):
        return ""
    parts = []
    for k, v in head.items():
        if isinstance(v, bool) or isinstance(v, (int, float, str)) and len(str(v)) <= 24:
            parts.append(f"{k}: {round(v, 4) if isinstance(v, float) else v}")
        if len(parts) == 3:
            break
    return "; ".join(parts).replace("|", "/")


def render() -> str:
    series, loose = classify()
    cites = cited()
    lines = [
        "# Benchmark results: which is current",
        "",
        "Written by `python -m benchmarks.index` (a test holds this file to it). Per series "
        "(`<bench>-<machine>-<preset>`), the result of the newest commit in the history is current; "
        "older ones are superseded and kept while a doc cites them (`--prune` deletes the rest). "
        "A result's own JSON has a `headline` with the figures its issue names.",
        "",
        "| series | current | commit | headline | cited by | older |",
        "|---|---|---|---|---|---|",
    ]
    for name, files in series.items():
        cur = [f for f in files if f["status"] == "current"]
        commit = cur[0]["commit"] if cur else "-"
        main = [f["name"] for f in cur if f["name"].endswith(".json")] or [f["name"] for f in cur]
        head = headline_of(main[0]) if main else ""
        who = sorted({c for f in cur for c in cites.get(f["name"], [])})
        older = sorted(
            {f"{f['commit']} ({f['status']})" for f in files if f["status"] != "current"},
            key=lambda s: s,
        )
        shown = ", ".join(f"`{n}`" for n in [f["name"] for f in cur]) or "-"
        lines.append(
            f"| {name} | {shown} | {commit} | {head} | {', '.join(who) or '-'} | {', '.join(older) or '-'} |"
        )
    if loose:
        lines += ["", "Pre-registrations and other files without a commit in their name:", ""]
        lines += [
            f"- `{n}`" + (f" (cited by {', '.join(sorted(cites[n]))})" if cites.get(n) else "") for n in loose
        ]
    return "\n".join(lines) + "\n"


def prunable() -> list[str]:
    """Superseded files that nothing outside the results folder names; never a lent device's
    (``nvidia-*``: measured in a lease, not remade at will)."""
    series, _ = classify()
    cites = cited()
    return [
        f["name"]
        for name, files in series.items()
        if "-nvidia-" not in f"-{name}-"
        for f in files
        if f["status"] == "superseded" and not cites.get(f["name"])
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--prune", action="store_true")
    args = ap.parse_args(argv)
    if args.prune:
        for n in prunable():
            (RESULTS / n).unlink()
            print(f"deleted {n}")
    text = render()
    if args.check:
        if not INDEX.exists() or INDEX.read_text() != text:
            print(f"{INDEX} is stale: run python -m benchmarks.index", file=sys.stderr)
            return 1
        return 0
    from moe_rl.lab.results import write_text

    write_text(INDEX, text)
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
