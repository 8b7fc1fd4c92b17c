"""Every folder of studies/ keeps the studies' contract (studies/README.md, issue 46): a README whose
first paragraph is the verdict, a package its tests import, its results indexed, tests (or, once
decided and retired, the git tag its driver left under), and a row in studies/README.md's table.

The checks walk ``studies/*/``, so a new study is held to them the day it lands.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDIES = ROOT / "studies"


def study_dirs(root: Path = STUDIES) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))


def tags() -> set[str] | None:
    """The checkout's ``study/*`` tags (None where git cannot say: no repository)."""
    res = subprocess.run(["git", "tag", "-l", "study/*"], cwd=ROOT, capture_output=True, text=True)
    return set(res.stdout.split()) if res.returncode == 0 else None


def problems(study: Path, index_md: str, known_tags: set[str] | None) -> list[str]:
    """What ``study`` lacks of the contract (``index_md``: studies/README.md's text)."""
    out = []
    readme = study / "README.md"
    if not readme.exists():
        return ["no README.md"]
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", readme.read_text()) if p.strip()]
    if not paragraphs[0].startswith("# ") or len(paragraphs) < 2 or not paragraphs[1].startswith("**Verdict"):
        out.append("README.md: the first paragraph after the title must be the verdict ('**Verdict (...)**')")
    if not (study / "__init__.py").exists():
        out.append("no __init__.py (its tests import it as studies.<name>)")
    results = study / "results"
    if results.is_dir() and any(results.iterdir()) and not (results / "INDEX.md").exists():
        out.append("results/ without INDEX.md: run python -m tools.index")
    tag = f"study/{study.name}"
    drivers = [
        p.name for p in study.glob("*.py") if p.name != "__init__.py" and not p.name.startswith("test_")
    ]
    if not list(study.glob("test_*.py")):
        if f"`{tag}`" not in readme.read_text():
            out.append(f"no test_*.py, and its README names no tag `{tag}` its driver left under")
        elif drivers:
            out.append(f"retired under {tag} but drivers are left: {drivers}")
        elif known_tags is not None and known_tags and tag not in known_tags:
            out.append(f"its README names the tag {tag}, which this checkout does not have")
    if f"]({study.name}/README.md)" not in index_md:
        out.append(f"studies/README.md's table has no row linking {study.name}/README.md")
    return out


@pytest.mark.parametrize("study", study_dirs(), ids=lambda p: p.name)
def test_every_study_keeps_the_contract(study):
    bad = problems(study, (STUDIES / "README.md").read_text(), tags())
    assert not bad, f"studies/{study.name}: " + "; ".join(bad)


def test_a_study_that_breaks_the_contract_is_named(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    (ok / "__init__.py").write_text("")
    (ok / "README.md").write_text("# Ok\n\n**Verdict (open).** Not run yet.\n")
    (ok / "test_ok.py").write_text("")
    bare = tmp_path / "bare"
    (bare / "results").mkdir(parents=True)
    (bare / "results" / "bare-m-p-aaaaaaa.json").write_text("{}")
    (bare / "README.md").write_text("# Bare\n\nA story before its verdict.\n\n**Verdict.** Late.\n")
    (bare / "drive.py").write_text("")
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "__init__.py").write_text("")
    (gone / "README.md").write_text("# Gone\n\n**Verdict (retired).** Driver at `study/gone`.\n")
    (gone / "drive.py").write_text("")
    index = "| [ok](ok/README.md) | | |\n| [gone](gone/README.md) | | |\n"
    assert problems(ok, index, {"study/other"}) == []
    assert [p.split(":")[0].split(" (")[0] for p in problems(bare, index, set())] == [
        "README.md",
        "no __init__.py",
        "results/ without INDEX.md",
        "no test_*.py, and its README names no tag `study/bare` its driver left under",
        "studies/README.md's table has no row linking bare/README.md",
    ]
    assert problems(gone, index, {"study/gone"}) == [
        "retired under study/gone but drivers are left: ['drive.py']"
    ]
    (gone / "drive.py").unlink()
    assert problems(gone, index, {"study/other"}) == [
        "its README names the tag study/gone, which this checkout does not have"
    ]
    assert problems(gone, index, {"study/gone"}) == []
