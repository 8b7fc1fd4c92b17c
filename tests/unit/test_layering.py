"""The package's layers as rules the code keeps (docs/design.md, "Layers"): each imports only downward.

Every module under ``moe_rl/`` (and ``kernels/``, installed as ``moe_rl.kernels``) is parsed with
``ast``; its imports, at module level and inside functions alike, are the edges. A module is one
node: ``import a.b.c`` is an edge to ``a.b.c`` alone (the parent packages it also runs are not
counted), and ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``.

Imports under ``if TYPE_CHECKING:`` count too, marked as such in the messages: a type named in an
annotation is a dependency on its layer, and two of the three circles issue 30 names had one arm
there (``losses/*.py`` imported ``AlgoConfig`` for annotations while ``config.py`` imported the
losses; ``rollout/factory.py`` annotated with the trainer's ``Run``). Skipping them, the tree before
this test passed rules d and e on both. ``ANNOTATIONS_COUNT = False`` gives the runtime-only graph.

The rules:

a. ``moe_rl.config``, ``configlib``, ``train_config``, ``losses``, ``routing`` and ``tasks`` never import the
   trainer, an engine (``rollout``, ``serve``), ``lab``, ``moe_rl.megatron`` or megatron-core;
b. megatron-core (``megatron.*``) is imported only under ``moe_rl/megatron/``;
c. ``moe_rl.trainer`` never imports ``moe_rl.lab`` or ``benchmarks``;
d. ``moe_rl.rollout`` never imports ``moe_rl.trainer``;
e. no import cycle among ``moe_rl`` modules, at run time and with the imports under
   ``if TYPE_CHECKING:`` counted too (:func:`test_no_import_cycle_through_annotations`).

Around the library (issue 46; ``benchmarks/``, ``studies/``, ``tools/`` and ``tests/`` parsed too):

f. ``moe_rl`` imports no benchmark, study or tool;
g. ``benchmarks`` import no study or tool (a tool may run a benchmark: the GPU check times the kernels);
h. nothing imports a study (``studies.<name>``) but that study itself: not the library, a benchmark,
   a tool, the tests or another study (its tests live in its folder).

A failure names the file and line of every offending import (for a cycle: of each edge in it).
``KNOWN_UNTIL_MERGE`` lists the edges that break a rule today and that a parallel branch removes;
the lead empties it as those branches merge (a listed edge that is gone fails
:func:`test_known_offenders_are_still_there`, so the list only shrinks).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"moe_rl": ROOT / "moe_rl", "moe_rl.kernels": ROOT / "kernels"}
"Import name -> source directory (pyproject.toml's package-dir)."

AROUND = {name: ROOT / name for name in ("benchmarks", "studies", "tools", "tests")}
"The tree around the library (rules f-h)."

ANNOTATIONS_COUNT = True
"Whether imports under ``if TYPE_CHECKING:`` are edges (module docstring)."

KNOWN_UNTIL_MERGE: dict[tuple[str, str], str] = {}
"""(importer, imported) edges allowed until the named branch is merged; empty it then."""


@dataclass(frozen=True)
class Edge:
    """One import statement: ``src`` imports ``dst`` at ``path:line``."""

    src: str
    dst: str
    path: str
    line: int
    annotation: bool = False
    "Under ``if TYPE_CHECKING:``."

    def __str__(self) -> str:
        where = " (under TYPE_CHECKING)" if self.annotation else ""
        return f"{self.path}:{self.line}: {self.src} imports {self.dst}{where}"


@dataclass(frozen=True)
class Rule:
    """Modules under any of ``importers`` (and not under ``exempt``) import nothing under ``forbidden``."""

    name: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    exempt: tuple[str, ...] = ()

    def broken_by(self, edge: Edge) -> bool:
        return (
            under(edge.src, self.importers)
            and not under(edge.src, self.exempt)
            and under(edge.dst, self.forbidden)
        )


RULES = [
    Rule(
        "a: config, configlib, train_config, losses, routing and tasks import no trainer, engine, lab or megatron",
        (
            "moe_rl.config",
            "moe_rl.configlib",
            "moe_rl.train_config",
            "moe_rl.losses",
            "moe_rl.routing",
            "moe_rl.tasks",
        ),
        ("moe_rl.trainer", "moe_rl.rollout", "moe_rl.serve", "moe_rl.lab", "moe_rl.megatron", "megatron"),
    ),
    Rule(
        "b: megatron-core is imported only under moe_rl/megatron/",
        ("moe_rl",),
        ("megatron",),
        exempt=("moe_rl.megatron",),
    ),
    Rule("c: the trainer never imports lab or benchmarks", ("moe_rl.trainer",), ("moe_rl.lab", "benchmarks")),
    Rule("d: rollout never imports the trainer", ("moe_rl.rollout",), ("moe_rl.trainer",)),
]


AROUND_RULES = [
    Rule("f: moe_rl imports no benchmark, study or tool", ("moe_rl",), ("benchmarks", "studies", "tools")),
    Rule("g: benchmarks import no study or tool", ("benchmarks",), ("studies", "tools")),
]


def study_of(module: str) -> str | None:
    """``studies.<name>`` of a module inside a study, else None."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "studies" and len(parts) > 1 else None


def into_a_study(edges: list[Edge]) -> list[Edge]:
    """Rule h: the imports of a study from outside it."""
    return [e for e in edges if study_of(e.dst) and study_of(e.dst) != study_of(e.src)]


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one (``moe_rl.config`` is not under ``moe_rl.conf``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` (``__init__`` is the package)
    outside hidden folders (a virtual environment or a cache there is none of the project's code)."""
    found = {}
    for name, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(p.startswith(".") for p in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((name, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    nodes: list[ast.AST], annotation: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import, whether under ``if TYPE_CHECKING:``) for every import in ``nodes``, at any depth
    (the TYPE_CHECKING ones only when :data:`ANNOTATIONS_COUNT`)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, annotation
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            if ANNOTATIONS_COUNT:
                yield from _import_nodes(node.body, True)
            yield from _import_nodes(node.orelse, annotation)
        else:
            yield from _import_nodes(list(ast.iter_child_nodes(node)), annotation)


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Edge]:
    """The edges of ``module`` (source at ``path``); ``known`` tells modules from names inside them."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    edges = []
    for node, annotation in _import_nodes([ast.parse(path.read_text(), filename=str(path))]):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        edges += [
            Edge(module, t, shown, node.lineno, annotation) for t in dict.fromkeys(targets) if t != module
        ]
    return edges


def import_graph(packages: dict[str, Path] = PACKAGES) -> list[Edge]:
    """Every import edge of every module of ``packages``."""
    known = modules(packages)
    return [edge for module, path in known.items() for edge in imports_of(module, path, known)]


def broken(rule: Rule, edges: list[Edge], allowed: dict[tuple[str, str], str]) -> list[Edge]:
    return [e for e in edges if rule.broken_by(e) and (e.src, e.dst) not in allowed]


def find_cycle(edges: list[Edge], allowed: dict[tuple[str, str], str]) -> list[Edge] | None:
    """A shortest import cycle among the scanned modules (edges to other modules are ignored), or None."""
    scanned = {e.src for e in edges}
    out: dict[str, dict[str, Edge]] = {}
    for e in edges:
        if e.dst in scanned and (e.src, e.dst) not in allowed:
            out.setdefault(e.src, {}).setdefault(e.dst, e)
    best = None
    for start in sorted(out):
        way = {start: []}  # module -> the edges from start to it, breadth first
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if best is not None and len(way[node]) + 1 >= len(best):
                break
            for dst, e in out.get(node, {}).items():
                if dst == start:
                    best = [*way[node], e]
                    queue.clear()
                    break
                if dst not in way:
                    way[dst] = [*way[node], e]
                    queue.append(dst)
    return best


def _report(edges: list[Edge]) -> str:
    return "\n".join(str(e) for e in edges)


@pytest.fixture(scope="module")
def graph() -> list[Edge]:
    return import_graph()


@pytest.fixture(scope="module")
def whole_graph() -> list[Edge]:
    return import_graph({**PACKAGES, **AROUND})


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name.split(":")[0])
def test_layer_rule(graph, rule):
    bad = broken(rule, graph, KNOWN_UNTIL_MERGE)
    assert not bad, f"rule {rule.name} is broken by:\n{_report(bad)}"


@pytest.mark.parametrize("rule", AROUND_RULES, ids=lambda r: r.name.split(":")[0])
def test_around_the_library_rule(whole_graph, rule):
    bad = broken(rule, whole_graph, {})
    assert not bad, f"rule {rule.name} is broken by:\n{_report(bad)}"


def test_nothing_imports_a_study_but_itself(whole_graph):
    assert any(study_of(e.src) for e in whole_graph), "no study parsed"
    bad = into_a_study(whole_graph)
    assert not bad, f"rule h: nothing imports a study but itself; broken by:\n{_report(bad)}"


def test_no_import_cycle(graph):
    cycle = find_cycle([e for e in graph if not e.annotation], KNOWN_UNTIL_MERGE)
    assert cycle is None, (
        "import cycle " + " -> ".join([cycle[0].src, *(e.dst for e in cycle)]) + (f":\n{_report(cycle)}")
    )


def test_no_import_cycle_through_annotations(graph):
    """Rule e with the imports under ``if TYPE_CHECKING:`` as edges too (issue 46: the trainer's
    modules named the ``Run`` that ``trainer.context`` built them into; ``lab.compare_checks`` named
    ``compare``'s ``Job``): a type named in an annotation is a dependency, and none closes a circle."""
    cycle = find_cycle(graph, KNOWN_UNTIL_MERGE)
    assert cycle is None, (
        "import cycle " + " -> ".join([cycle[0].src, *(e.dst for e in cycle)]) + (f":\n{_report(cycle)}")
    )


def test_known_offenders_are_still_there(graph):
    present = {(e.src, e.dst) for e in graph}
    gone = {edge: why for edge, why in KNOWN_UNTIL_MERGE.items() if edge not in present}
    assert not gone, f"delete these edges from KNOWN_UNTIL_MERGE, they are gone: {gone}"


# ---------------------------------------------------------------------------------------
# The checker itself, on planted trees: every rule fails, and names the file and the line.

PLANTED = [
    ("a", "moe_rl/config.py", "def f():\n    from moe_rl.trainer.run import Run\n", 2),
    ("a", "moe_rl/losses/core.py", "import megatron.core\n", 1),
    ("a", "moe_rl/tasks/base.py", "from moe_rl.rollout import factory\n", 1),
    ("b", "moe_rl/rollout/embedded.py", "x = 1\n\n\ndef g():\n    from megatron.core import mpu\n", 5),
    ("c", "moe_rl/trainer/rl.py", "from benchmarks import arms\n", 1),
    ("c", "moe_rl/trainer/loop.py", "from ..lab import runner\n", 1),
    ("d", "moe_rl/rollout/factory.py", "from moe_rl.trainer import run\n", 1),
    ("f", "moe_rl/lab/runner.py", "x = 1\n\n\ndef g():\n    from studies.one_update import harness\n", 5),
    ("f", "moe_rl/lab/runner.py", "import benchmarks.noise\n", 1),
    (
        "d",
        "moe_rl/rollout/factory.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import moe_rl.trainer\n",
        4,
    ),
]
BASE_TREE = {
    "moe_rl/__init__.py": "",
    "moe_rl/megatron/__init__.py": "import megatron.core\n",  # allowed: the adapter package
    "moe_rl/trainer/__init__.py": "",
    "moe_rl/trainer/run.py": "from moe_rl.megatron import policy\n",
    "moe_rl/lab/__init__.py": "from moe_rl.trainer import run\n",
    "moe_rl/lab/runner.py": "",
    "moe_rl/rollout/__init__.py": "",
}


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return {top: tmp_path / top for top in ("moe_rl", *AROUND) if (tmp_path / top).is_dir()}


def test_the_planted_base_tree_is_clean(tmp_path):
    edges = import_graph(_tree(tmp_path, BASE_TREE))
    assert all(not broken(r, edges, {}) for r in RULES) and find_cycle(edges, {}) is None


def test_a_planted_cycle_is_found_with_its_files_and_lines(tmp_path):
    files = {
        **BASE_TREE,
        "moe_rl/plan.py": "import json\n\n\ndef main():\n    from moe_rl.cli import ArgParser\n",
        "moe_rl/cli.py": "from moe_rl import plan\n",
    }
    edges = import_graph(_tree(tmp_path, files))
    cycle = find_cycle(edges, {})
    assert cycle is not None and {(e.src, e.dst) for e in cycle} == {
        ("moe_rl.cli", "moe_rl.plan"),
        ("moe_rl.plan", "moe_rl.cli"),
    }
    shown = _report(cycle).replace(str(tmp_path) + "/", "")
    assert "moe_rl/plan.py:5: " in shown and "moe_rl/cli.py:1: " in shown
    assert find_cycle(edges, {("moe_rl.plan", "moe_rl.cli"): "allowed"}) is None


AROUND_TREE = {
    **BASE_TREE,
    "studies/__init__.py": "",
    "studies/alpha/__init__.py": "from pathlib import Path\n",
    "studies/alpha/drive.py": "from moe_rl.lab import runner\nfrom studies.alpha import Path\n",
    "studies/alpha/test_drive.py": "from studies.alpha import drive\n",
    "studies/beta/__init__.py": "",
    "benchmarks/__init__.py": "",
    "benchmarks/speed.py": "from moe_rl.lab import runner\n",
    "tools/__init__.py": "",
    "tools/check.py": "from benchmarks import speed\n",
    "tests/__init__.py": "",
    "tests/test_lab.py": "from moe_rl.lab import runner\nfrom tools import check\n",
}
PLANTED_AROUND = [
    ("f", "moe_rl/lab/runner.py", "def f():\n    from studies.alpha import drive\n", 2),
    ("f", "moe_rl/trainer/run.py", "import tools.check\n", 1),
    ("g", "benchmarks/speed.py", "from studies.alpha.drive import x\n", 1),
    ("g", "benchmarks/speed.py", "from tools import check\n", 1),
    ("h", "tests/test_lab.py", "from studies.alpha import drive\n", 1),
    ("h", "studies/beta/__init__.py", "from studies.alpha.drive import x\n", 1),
    ("h", "tools/check.py", "\n\ndef f():\n    import studies.alpha\n", 4),
]


def test_the_planted_tree_around_the_library_is_clean(tmp_path):
    edges = import_graph(_tree(tmp_path, AROUND_TREE))
    assert not into_a_study(edges) and all(not broken(r, edges, {}) for r in AROUND_RULES)
    assert {
        ("studies.alpha.drive", "studies.alpha"),
        ("studies.alpha.test_drive", "studies.alpha.drive"),
    } <= {(e.src, e.dst) for e in edges}


def broken_by(rule_id: str, edges: list[Edge]) -> list[Edge]:
    """The edges that break rule ``rule_id`` (a-d, f-g: :data:`RULES`, :data:`AROUND_RULES`; h)."""
    if rule_id == "h":
        return into_a_study(edges)
    (rule,) = [r for r in RULES + AROUND_RULES if r.name.startswith(rule_id + ":")]
    return broken(rule, edges, {})


@pytest.mark.parametrize(
    "rule_id, rel, text, line, tree",
    [(*p, BASE_TREE) for p in PLANTED] + [(*p, AROUND_TREE) for p in PLANTED_AROUND],
    ids=[f"{p[0]}:{p[1]}" for p in PLANTED + PLANTED_AROUND],
)
def test_each_rule_fails_on_a_planted_import(tmp_path, rule_id, rel, text, line, tree):
    bad = broken_by(rule_id, import_graph(_tree(tmp_path, {**tree, rel: text})))
    assert bad and all(e.path.endswith(rel) for e in bad), _report(bad)
    assert f"{rel}:{line}: " in "\n".join(str(e).replace(str(tmp_path) + "/", "") for e in bad)


FUNCTION_IMPORTS_PER_KLOC = 10.0
"Issue 46's ceiling on imports inside function bodies, per 1,000 non-blank lines of moe_rl/ and kernels/."


def function_level_imports(packages: dict[str, Path] = PACKAGES) -> tuple[int, int]:
    """``(imports inside a function body, non-blank lines)`` over the packages' files; an import
    in a nested function counts once."""
    found, lines = set(), 0
    for directory in packages.values():
        for path in sorted(directory.rglob("*.py")):
            text = path.read_text()
            lines += sum(1 for line in text.splitlines() if line.strip())
            for fn in ast.walk(ast.parse(text)):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for stmt in fn.body:
                        found |= {
                            (str(path), n.lineno)
                            for n in ast.walk(stmt)
                            if isinstance(n, (ast.Import, ast.ImportFrom))
                        }
    return len(found), lines


def test_function_level_imports_stay_rare():
    """An import goes at the top of its module unless it is heavy (megatron-core, an optional
    library, another version's internals), late-bound on purpose, or would close a cycle."""
    n, lines = function_level_imports()
    per_kloc = 1000 * n / lines
    assert per_kloc < FUNCTION_IMPORTS_PER_KLOC, (
        f"{n} imports inside functions over {lines} non-blank lines: {per_kloc:.1f} per kLOC, over "
        f"{FUNCTION_IMPORTS_PER_KLOC}: move the cheap ones to the top of their modules"
    )
