"""docs/recipes.md: every recipe field, its default and meaning, written from the config classes.

The meaning is the field's one-line docstring (the string after it in ``moe_rl/config.py``,
``moe_rl/train_config.py``, ``moe_rl/tasks/config.py``, ``moe_rl/sglang_config.py``), the default is the dataclass's, and the
link is the doc that explains the field (one its docstring names, ``docs/x.md#part``; else
:data:`FIELD_DOCS`; else its section's :data:`SECTION_DOCS`). A section whose field is itself a config class (``task.jsonl``,
``rollout.sglang``) gets its own table.

    python -m tools.recipes_doc          # rewrite docs/recipes.md
    python -m tools.recipes_doc --check  # exit 1 when docs/recipes.md is not what this writes

``tests/unit/test_recipes_doc.py`` holds docs/recipes.md to it: a field added, renamed or
re-documented without rerunning this fails there.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "recipes.md"
SECTION_DOCS = {
    "model": "design.md#models",
    "parallel": "design.md#scale",
    "optim": "megatron_cpu.md#ddp-and-the-optimizer",
    "checkpoint": "safety.md#only-good-weights-are-saved",
    "algo": "algorithms.md#the-loss-call",
    "task": "design.md#your-own-data",
    "rollout": "design.md#rollout-engines",
    "sentinel": "safety.md",
    "train": "design.md#one-rl-step",
}
"Each section's doc (relative to docs/)."
FIELD_DOCS = {
    "algo.kl_coef": "algorithms.md#kl-to-a-reference",
    "algo.kl_estimator": "algorithms.md#kl-to-a-reference",
    "algo.kl_reward_coef": "algorithms.md#kl-to-a-reference",
    "algo.routing": "algorithms.md#routing-replay",
    "algo.old_logprobs": "algorithms.md#old-log-probs",
    "algo.rollout_correction": "algorithms.md#corrections",
    "algo.correction_c": "algorithms.md#corrections",
    "algo.correction_low": "algorithms.md#corrections",
    "algo.correction_high": "algorithms.md#corrections",
    "algo.clip_ratio_c": "algorithms.md#dual-clip",
    "rollout.dtype": "algorithms.md#train-inference-mismatch",
    "rollout.router_dtype": "algorithms.md#train-inference-mismatch",
    "rollout.route_noise": "algorithms.md#routing-noise",
    "train.route_noise": "algorithms.md#routing-noise",
    "train.freeze_router": "algorithms.md#router-frozen",
    "train.router_lr_mult": "algorithms.md#router-learning-rate",
    "train.loggers": "design.md#trackers",
    "train.flip_probe_sequences": "algorithms.md#expert-flip-rate",
    "train.packing": "design.md#one-rl-step",
    "checkpoint.keep": "safety.md#outputs-never-overwrite-what-they-do-not-own",
}
"Fields whose own doc is not their section's (relative to docs/); a name not a field fails the test."


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after it in ``cls``'s source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def default_of(f: dataclasses.Field) -> str:
    """The field's default as a recipe would write it (YAML), in backticks."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    return f"`{value}`"


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted name, config class) of every section under ``cls``, nested ones after their parent."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            name = f"{prefix}{f.name}"
            out += [(name, hints[f.name]), *sections(hints[f.name], f"{name}.")]
    return out


def table(name: str, cls: type) -> list[str]:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    top = name.split(".")[0]
    lines = [f"## `{name}`", "", " ".join((cls.__doc__ or "").split()), ""]
    lines += ["| field | default | meaning | see |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            meaning, default = (
                f"{docs.get(f.name, '')} Its own table: [`{name}.{f.name}`](#{name.replace('.', '')}{f.name}).",
                "-",
            )
        else:
            meaning, default = docs.get(f.name, ""), default_of(f)
        named = re.search(r"docs/(\w+\.md(?:#[\w-]+)?)", meaning)
        link = named.group(1) if named else FIELD_DOCS.get(f"{name}.{f.name}", SECTION_DOCS[top])
        meaning = meaning.replace("|", "\\|")
        lines.append(f"| `{name}.{f.name}` | {default} | {meaning} | [{link.split('#')[0]}]({link}) |")
    return [*lines, ""]


def render() -> str:
    from moe_rl.config import Recipe

    lines = [
        "# Recipe fields",
        "",
        "Every field a recipe sets, with its default and meaning; written by `python -m tools.recipes_doc`",
        "from the config classes' field docstrings (a test holds this page to them). A recipe is YAML with",
        "one section per table (`model:`, `algo:`, ...); any field is also a command-line override",
        "`section.field=value` (`moe-rl train recipes/tiny.yaml algo.routing=r2 optim.lr=3e-5`). Unknown,",
        "moved or mistyped keys and inconsistent values fail at load with one line naming the field and",
        "the fix ([safety.md](safety.md#recipes-are-checked-at-load)).",
        "",
        "Sections: " + ", ".join(f"[`{n}`](#{n.replace('.', '')})" for n, _ in sections(Recipe)) + ".",
        "",
    ]
    for name, cls in sections(Recipe):
        lines += table(name, cls)
    return "\n".join(lines).rstrip() + "\n"


def stale_links() -> list[str]:
    """:data:`FIELD_DOCS` names that are not recipe fields."""
    from moe_rl.config import Recipe

    known = {f"{n}.{f.name}" for n, cls in sections(Recipe) for f in dataclasses.fields(cls)}
    return sorted(set(FIELD_DOCS) - known)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.recipes_doc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/recipes.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python -m tools.recipes_doc", file=sys.stderr)
            return 1
        return 0
    from moe_rl.lab.results import write_text

    write_text(DOC, text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
