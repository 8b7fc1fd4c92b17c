"""INDEX.md of every results folder: which result of each series is current, where each belongs.

A result lives in the ``results/`` folder of what it measures: a study's in
``studies/<study>/results/`` (:data:`STUDIES`), everything else (the benchmarks', the GPU check's,
the planted bugs', the quickstart's timing) in ``benchmarks/results/``. Each folder gets its own
INDEX.md; a file in the wrong folder (a study's driver's result among the benchmarks', another
study's or no driver's in a study's) is reported by :func:`misplaced` and fails ``--check``.

Results are named ``<bench>-<machine>-<preset>-<commit>[-dirty][-<part>].<ext>`` (``result_path``).
Files of one ``<bench>-<machine>-<preset>`` are one series; its current result is the one of the
newest commit in this branch's history (``git rev-list HEAD``), the others superseded, and a file
whose commit is not in the history (made in a worktree, on a branch that was rebased) is marked so.
A partial report (``<stage>-partial``, a driver's report of an unfinished sweep) belongs to its
stage's series (:func:`stage_of`), where any full report outranks it: once the full one exists
every partial is superseded. A superseded file stays while a doc names it (studies/README.md:
one rule for every results folder), else ``--prune`` deletes it.
Each row says which docs cite the file. Pre-registrations (no commit in the name) are listed apart.

    python -m tools.index            # rewrite every INDEX.md
    python -m tools.index --check    # exit 1 when an INDEX.md is not what it would write, or a file is misplaced
    python -m tools.index --prune    # delete superseded files no doc, test or code names

``tests/unit/test_results_index.py`` holds every INDEX.md to what this writes.
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
STUDIES = ROOT / "studies"
INDEX_NAME = "INDEX.md"
NAME = re.compile(
    r"^(?P<series>.+)-(?P<commit>[0-9a-f]{7,40})(?P<dirty>-dirty)?(?P<part>-[a-z]+)?\.(?P<ext>\w+)$"
)
PARTIAL = "-partial"
"A driver's report of an unfinished sweep ends its preset so (``studies/noise/noise.py``)."
CITERS = ("README.md", "docs", "tests", "benchmarks", "studies", "tools", "moe_rl", "recipes", "kernels")
"Where a result may be named (the results folders themselves excluded)."


def folders() -> list[Path]:
    """Every results folder: benchmarks/results, then each study's (sorted)."""
    return [RESULTS, *sorted(p for p in STUDIES.glob("*/results") if p.is_dir())]


def result_files(folder: Path) -> list[str]:
    """The result files of ``folder`` (its INDEX.md and hidden files left out)."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and p.name != INDEX_NAME and not p.name.startswith(".")
    )


def misplaced(folder: Path) -> list[str]:
    """Files of ``folder`` that belong elsewhere: in benchmarks/results, a result named after a
    study's driver (``studies/<study>/<name>.py``); in a study's, one named after neither one of its
    drivers nor the study itself. A result's name starts with what wrote it (``<name>-``)."""
    drivers = {s.name: {p.stem for p in s.glob("*.py")} | {s.name} for s in STUDIES.iterdir() if s.is_dir()}
    if folder == RESULTS:
        owned = set().union(*drivers.values()) if drivers else set()
        return [n for n in result_files(folder) if n.split("-")[0] in owned]
    own = drivers.get(folder.parent.name, set())
    return [n for n in result_files(folder) if n.split("-")[0] not in own]


def history() -> dict[str, int]:
    """Short commit (7) -> its age in HEAD's history (0: HEAD)."""
    out = subprocess.run(
        ["git", "rev-list", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {sha[:7]: i for i, sha in enumerate(out)}


def cited() -> dict[str, list[str]]:
    """Result file name -> the files (relative to the checkout) that name it."""
    names = {n for folder in folders() for n in result_files(folder)}
    kept = folders()
    hits: dict[str, list[str]] = defaultdict(list)
    for where in CITERS:
        base = ROOT / where
        files = (
            [base] if base.is_file() else [p for p in base.rglob("*") if p.suffix in {".md", ".py", ".yaml"}]
        )
        for f in files:
            if any(k in f.parents for k in kept) or not f.is_file():
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


def stage_of(partial: str, series: set[str]) -> str:
    """The series a partial report's series (``<stage>-partial``) belongs to: ``<stage>`` when it
    exists, else the one series ``<stage>-<suffix>`` that is no partial (``screen-partial`` ->
    ``screen-deciding``), else its own (a sweep that never finished)."""
    stage = partial.removesuffix(PARTIAL)
    if stage in series:
        return stage
    full = [s for s in series if s.startswith(f"{stage}-") and not s.endswith(PARTIAL)]
    return full[0] if len(full) == 1 else partial


def classify(folder: Path = RESULTS) -> tuple[dict[str, list[dict]], list[str]]:
    """(series -> files newest first, each ``{"name", "commit", "age", "status"}``), unnamed files.
    Current: the newest commit's full report, a partial only where no full one is in the history."""
    ages = history()
    by_name: dict[str, list[dict]] = defaultdict(list)
    loose = []
    for name in result_files(folder):
        m = NAME.match(name)
        if not m:
            loose.append(name)
            continue
        commit = m["commit"][:7]
        by_name[m["series"]].append({"name": name, "commit": commit, "age": ages.get(commit)})
    series: dict[str, list[dict]] = defaultdict(list)
    for name, files in by_name.items():
        own = stage_of(name, set(by_name)) if name.endswith(PARTIAL) else name
        series[own] += [f | {"partial": name.endswith(PARTIAL)} for f in files]
    for files in series.values():
        ranks = [(f["partial"], f["age"]) for f in files if f["age"] is not None]
        best = min(ranks) if ranks else None  # a full report before any partial, then the newest
        for f in files:
            rank = (f.pop("partial"), f["age"])
            f["status"] = (
                "not in history" if f["age"] is None else "current" if rank == best else "superseded"
            )
        files.sort(key=lambda f: (f["age"] is None, f["age"] if f["age"] is not None else 0, f["name"]))
    return dict(sorted(series.items())), loose


def headline_of(path: Path) -> str:
    """A short rendering of a JSON result's ``headline`` (its first few scalar figures)."""
    if path.suffix != ".json":
        return ""
    try:
        head = read_json(path).get("headline")
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


def render(folder: Path = RESULTS, cites: dict[str, list[str]] | None = None) -> str:
    """``folder``'s INDEX.md (``cites``: :func:`cited`, computed when not given)."""
    series, loose = classify(folder)
    cites = cited() if cites is None else cites
    what = "Benchmark" if folder == RESULTS else f"The {folder.parent.name} study's"
    lines = [
        f"# {what} results: which is current",
        "",
        "Written by `python -m tools.index` (a test holds this file to it). Per series "
        "(`<bench>-<machine>-<preset>`), the result of the newest commit in the history is current; "
        "older ones and partial reports of a stage whose full report exists are superseded, and kept "
        "while a doc cites them (`--prune` deletes the rest). "
        "A result's own JSON has a `headline` with the figures its issue names.",
        "",
        "| series | current | commit | headline | cited by | older |",
        "|---|---|---|---|---|---|",
    ]
    for name, files in series.items():
        cur = [f for f in files if f["status"] == "current"]
        commit = cur[0]["commit"] if cur else "-"
        main = [f["name"] for f in cur if f["name"].endswith(".json")] or [f["name"] for f in cur]
        head = headline_of(folder / main[0]) if main else ""
        who = sorted({c for f in cur for c in cites.get(f["name"], [])})
        older = sorted(
            {
                f"{f['commit']} ({'partial, ' if f'{PARTIAL}-' in f['name'] else ''}{f['status']})"
                for f in files
                if f["status"] != "current"
            },
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


def prunable() -> list[Path]:
    """Superseded files that nothing outside the results folders names; never a lent device's
    (``nvidia-*``: measured in a lease, not remade at will)."""
    cites = cited()
    return [
        folder / f["name"]
        for folder in folders()
        for name, files in classify(folder)[0].items()
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
        for p in prunable():
            p.unlink()
            print(f"deleted {p.relative_to(ROOT)}")
    from moe_rl.lab.results import write_text

    cites, bad = cited(), 0
    for folder in folders():
        index, text = folder / INDEX_NAME, render(folder, cites)
        for name in misplaced(folder):
            print(
                f"{folder.relative_to(ROOT)}/{name} belongs in another results folder (tools/index.py)",
                file=sys.stderr,
            )
            bad = 1
        if args.check:
            if not index.exists() or index.read_text() != text:
                print(f"{index.relative_to(ROOT)} is stale: run python -m tools.index", file=sys.stderr)
                bad = 1
            continue
        write_text(index, text)
        print(f"wrote {index.relative_to(ROOT)}")
    return bad


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
