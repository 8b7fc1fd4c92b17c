"""Every link and every checkout path the docs name resolves (issue 46: files moved into studies/,
tools/; a result JSON stays readable at the path a doc gives).

Read: README.md and every ``*.md`` under docs/, studies/, benchmarks/, tools/ (results folders'
INDEX.md included). Checked: each relative Markdown link ``[text](target)`` names an existing file
(``#anchor``: a heading of that file, GitHub's slug), and each path in backticks that starts with a
folder of the checkout (``studies/noise/results/x.json``, ``docs/design.md#trackers``) exists; a
path with a pattern in it (``*``, ``{a,b}``, ``<commit>``) and anything under ``runs/`` (written by
a run) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("benchmarks", "docs", "kernels", "launch", "moe_rl", "recipes", "studies", "tests", "tools")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
TICKED = re.compile(r"`([^`\s]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def docs() -> list[Path]:
    found = [ROOT / "README.md"]
    for top in ("docs", "studies", "benchmarks", "tools"):
        found += sorted((ROOT / top).rglob("*.md"))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", md.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(md: Path) -> list[str]:
    """The relative links of ``md`` that name no file (or no heading of it)."""
    bad = []
    for m in LINK.finditer(FENCE.sub("", md.read_text())):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("//"):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor})")
    return bad


def missing_paths(md: Path) -> list[str]:
    """Checkout paths in backticks in ``md`` that do not exist."""
    bad = []
    for m in TICKED.finditer(md.read_text()):
        text = m.group(1).split("#")[0].split(":")[0].rstrip(".,;)")
        if not text.startswith(tuple(t + "/" for t in TOP)) or re.search(r"[*{}<>\[\]$]|\.\.\.", text):
            continue
        if not (ROOT / text).exists():
            bad.append(text)
    return bad


@pytest.mark.parametrize("md", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_named_path_resolves(md):
    bad = broken_links(md) + missing_paths(md)
    assert not bad, f"{md.relative_to(ROOT)} names what does not exist: {bad}"


def test_a_broken_link_a_missing_anchor_and_a_moved_path_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some part: the one\n\ntext\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#some-part-the-one) [gone](gone.md) [anchor](a.md#nowhere) [web](https://x.y)\n"
        "```\n[in a fence](nowhere.md)\n```\n`docs/no_such_page.md` `studies/*/results` `runs/demo`\n"
    )
    assert broken_links(page) == ["gone.md (no such file)", "a.md#nowhere (no heading #nowhere)"]
    assert missing_paths(page) == ["docs/no_such_page.md"]
