"""docs/safety.md's range tables, held against the code (issue 47, item 7).

Every recipe field (the config dataclasses) and every command-line flag (every parser of
``moe-rl``) has a row; each default obeys its row's rule; each rule's degenerate values (zero
where it means nothing, negative, empty, subnormal, out of range, the wrong type) are refused
before anything runs with one line naming the field or flag. In process: recipes are only loaded,
and each command's work is replaced by a failure (a value that got through would reach it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, Recipe, recipe_from_dict

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "safety.md"
RECIPE = ROOT / "recipes" / "tiny.yaml"
RULE = re.compile(
    r"^(switch|text|text or null|choice|choice or bool|bool|registered|png|list of choice"
    r"|int >= 1 or list of text|list of int >= 0 or null"
    r"|(int|number) (>=|>) (-?[\d.]+)( or null)?"
    r"|(int|number) in ([\[(])(-?[\d.]+), (-?[\d.]+)([\])])( or null)?)$"
)


def table(name: str) -> dict[str, tuple[str, list[str]]]:
    """``{key: (rule, every name in the key cell)}`` of the ``ranges:<name>`` table."""
    text = DOC.read_text()
    body = text.split(f"<!-- ranges:{name} -->", 1)[1].split(f"<!-- /ranges:{name} -->", 1)[0]
    rows = {}
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        assert RULE.match(cells[1]), (
            f"docs/safety.md: rule {cells[1]!r} of {cells[0]} is not one the test reads"
        )
        rows[names[0]] = (cells[1], names)
    return rows


def recipe_fields(cls=Recipe, prefix="") -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(recipe_fields(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def obeys(rule: str, value) -> bool:
    """Whether ``value`` (a default) obeys ``rule``."""
    if value is None:
        return "or null" in rule or rule in ("text or null",)
    if rule in ("switch", "bool"):
        return isinstance(value, bool)
    if rule in ("text", "text or null", "registered", "choice", "png"):
        return isinstance(value, str) and bool(value.strip()) and (rule != "png" or value.endswith(".png"))
    if rule == "choice or bool":
        return isinstance(value, (str, bool))
    if rule.startswith("list"):
        value = value.split(",") if isinstance(value, str) else value  # a flag's comma-separated list
        return isinstance(value, (list, tuple)) and len(value) > 0
    if rule == "int >= 1 or list of text":
        return isinstance(value, list) or (isinstance(value, int) and value >= 1)
    m = RULE.match(rule)
    if isinstance(value, str):  # a flag's default, as argparse holds it
        value = float(value)
    if m.group(2):
        kind, op, bound = m.group(2), m.group(3), float(m.group(4))
        ok = value > bound if op == ">" else value >= bound
    else:
        kind, lo, a, b, hi = m.group(6), m.group(7), float(m.group(8)), float(m.group(9)), m.group(10)
        ok = (value >= a if lo == "[" else value > a) and (value <= b if hi == "]" else value < b)
    return ok and (kind == "number" or float(value).is_integer())


def degenerate(rule: str, *, flag: bool = False) -> list[str]:
    """Values that break ``rule``, as a recipe override or a flag writes them."""
    if rule in ("switch", "choice or bool"):
        return [] if rule == "switch" else ["bogus"]
    fixed = {
        "bool": ["3", "x"],
        "text": ['""', '" "'],
        "text or null": ['""', '" "'],
        "choice": ["bogus"],
        "registered": ["bogus"],
        "png": ["out.jsonl", ""],
        "list of choice": ["[bogus]"] if not flag else ["bogus", "", "GRPO,GRPO"],
        "int >= 1 or list of text": ["0", '[""]'],
        "list of int >= 0 or null": ["[-1]"],
    }
    if rule in fixed:
        values = fixed[rule]
        return [v.strip('"') for v in values] if flag and rule.startswith("text") else values
    m = RULE.match(rule)
    kind = m.group(2) or m.group(6)
    out = ["x"]
    if m.group(2):
        op, bound = m.group(3), float(m.group(4))
        out += [_num(bound if op == ">" else bound - 1)]
    else:
        lo, a, b, hi = m.group(7), float(m.group(8)), float(m.group(9)), m.group(10)
        out += [_num(a if lo == "(" else a - 1), _num(b if hi == ")" else b + 1)]
    if kind == "int":
        out += ["1.5", "18446744073709551616"] + ([] if flag else ["true"])
    else:
        out += ["5e-324", "nan"] if flag else ["5e-324", ".nan", ".inf"]
    return out


def _num(v: float) -> str:
    return str(int(v)) if v.is_integer() else str(v)


# -- the recipe ----------------------------------------------------------------------------------
RECIPE_ROWS = table("recipe")
FIELDS = recipe_fields()


def same_keys(code: dict, rows: dict, name: str) -> None:
    """The code's fields or flags and the ``ranges:<name>`` table's rows are the same set."""
    missing, stale = sorted(set(code) - set(rows)), sorted(set(rows) - set(code))
    assert not missing, f"add a row to docs/safety.md's ranges:{name} table for {missing}"
    assert not stale, f"docs/safety.md's ranges:{name} table names what the code lacks: {stale}"


def test_every_recipe_field_has_a_row_and_no_row_is_stale():
    same_keys(FIELDS, RECIPE_ROWS, "recipe")


@pytest.mark.parametrize("field", sorted(RECIPE_ROWS))
def test_a_recipe_fields_default_obeys_its_rule_and_degenerate_values_are_refused(field):
    rule = RECIPE_ROWS[field][0]
    assert obeys(rule, FIELDS[field]), f"{field}'s default {FIELDS[field]!r} breaks its rule {rule!r}"
    for bad in degenerate(rule):
        with pytest.raises(ConfigError) as e:
            recipe_from_dict({}, [f"{field}={bad}"])
        assert field in str(e.value), f"{field}={bad}: the error names another field: {e.value}"


# -- the command line ----------------------------------------------------------------------------
def parsers() -> dict[str, argparse.ArgumentParser]:
    from moe_rl.cli import build_parser, compare_parser
    from moe_rl.plan import arg_parser as plan_parser
    from moe_rl.serve.http import build_arg_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    out = {"": top, **sub.choices}
    out.update(compare=compare_parser(), plan=plan_parser(), serve=build_arg_parser())
    return out


def flag_actions() -> dict[str, tuple[str, argparse.Action]]:
    """``{"moe-rl <cmd> <flag>": (cmd, action)}`` of every option of every parser."""
    out = {}
    for cmd, p in parsers().items():
        for a in p._actions:
            if a.option_strings and not isinstance(a, argparse._HelpAction):
                out[" ".join(x for x in ("moe-rl", cmd, a.option_strings[0]) if x)] = (cmd, a)
    return out


FLAG_ROWS = table("flags")
ACTIONS = flag_actions()


def test_every_flag_has_a_row_naming_its_aliases_and_no_row_is_stale():
    same_keys(ACTIONS, FLAG_ROWS, "flags")
    for key, (_, action) in ACTIONS.items():
        names = FLAG_ROWS[key][1]
        for alias in action.option_strings[1:]:
            assert alias in names, f"docs/safety.md: name {alias} beside {key}"


def _run(cmd: str, flag: str, value: str, tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    """``moe-rl`` with ``flag=value`` on a command whose work fails the test if it is reached."""
    from moe_rl.cli import main

    def reached(*a, **k):
        raise AssertionError(f"{flag}={value!r} was not refused before the work")

    work = {
        "export": "moe_rl.megatron.parallel.init_parallel",
        "demo": "moe_rl.lab.compare.run_compare",
        "compare": "moe_rl.lab.compare.run_compare",
        "report": "moe_rl.lab.report.load_arm",
        "plan": "moe_rl.plan.plan",
        "serve": "moe_rl.serve.embedded.build_engine",
        "train": "moe_rl.trainer.run.run",
    }
    if cmd in work:
        monkeypatch.setattr(work[cmd], reached)
    head = {
        "export": ["export", str(RECIPE), str(tmp_path / "hf")],
        "compare": ["compare", str(RECIPE)],
        "report": ["report", str(tmp_path)],
        "plan": ["plan", str(RECIPE)],
        "serve": ["serve"] + ([] if flag == "--port" else ["--port", "0"]),
    }.get(cmd, [cmd] if cmd else [])
    code = main([*head, f"{flag}={value}"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("key", sorted(FLAG_ROWS))
def test_a_flags_default_obeys_its_rule_and_degenerate_values_are_one_line(
    key, tmp_path, monkeypatch, capsys
):
    cmd, action = ACTIONS[key]
    rule = FLAG_ROWS[key][0]
    if action.default is not None and rule != "switch":
        default = action.default if isinstance(action.default, (bool, int, float)) else str(action.default)
        assert obeys(rule, default), f"{key}'s default {action.default!r} breaks its rule {rule!r}"
    flag = action.option_strings[0]
    for bad in degenerate(rule, flag=True):
        try:
            code, err = _run(cmd, flag, bad, tmp_path, monkeypatch, capsys)
        except SystemExit as e:  # argparse's usage error (the house line)
            code, err = e.code, capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("moe-rl:")]
        assert code == 2 and len(lines) == 1, f"{flag}={bad!r}: exit {code}, {err[-500:]}"
        assert flag in lines[0], f"{flag}={bad!r}: the line names no flag: {lines[0]}"


def test_the_rules_read_here_are_the_ones_the_tables_use():
    assert obeys("number in (0, 1)", 0.5) and not obeys("number in (0, 1)", 1.0)
    assert obeys("int in [0, 4294967295]", 0) and not obeys("int >= 1", 0)
    assert degenerate("number > 0") == ["x", "0", "5e-324", ".nan", ".inf"]
    assert math.isnan(float("nan"))
