"""Issue 47, item 5: ``moe-rl check`` validates the data: every column it reads, by type and
nullness, with the count of unusable rows; all rows unusable is a refusal naming the field.

A verl parquet whose ``reward_model.ground_truth`` was null in every row passed ``check``: every
answer was None (JSON ``null``), every reward 0.
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.badinput.conftest import assert_kept, snapshot
from tests.badinput.test_data_rewards import _parquet_recipe, _recipe, _records, _verl_rows

data_case = pytest.mark.bad_input("data")


@data_case
def test_a_ground_truth_null_in_every_row_is_refused_naming_the_field(cli, tmp_path):
    rows = _verl_rows(12)
    for r in rows:
        r["reward_model"]["ground_truth"] = None
    recipe = _parquet_recipe(tmp_path, rows)
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(
        r"data error: .*data\.parquet: field 'reward_model\.ground_truth' is null or empty in all 12 rows "
        r"\(row 0, row 1, row 2, \.\.\.\)"
    )
    assert_kept(before, tmp_path)


@data_case
@pytest.mark.parametrize(
    ("field", "value"),
    [("answer", None), ("answer", ""), ("answer", "   ")],
    ids=["null", "empty", "blank"],
)
def test_an_answer_missing_in_every_plain_row_is_refused(cli, tmp_path, field, value):
    rows = [{"prompt": f"{i}+1=", field: value} for i in range(10)]
    recipe = _recipe(tmp_path, data="".join(json.dumps(r) + "\n" for r in rows))
    cli("check", recipe).one_line(r"field 'answer' is null or empty in all 10 rows \(.*data\.jsonl:1, ")


@data_case
def test_some_unusable_rows_are_counted_named_and_left_out(tmp_path, caplog):
    """3 of 15 rows without an answer: ``check`` says how many and which, and the task has the 12
    others (none trains on a None answer)."""
    from moe_rl.config import load_recipe
    from moe_rl.tasks import build_task, load_tokenizer

    data = _records(12) + "".join(json.dumps({"prompt": f"q{i}", "answer": None}) + "\n" for i in range(3))
    recipe = load_recipe(_recipe(tmp_path, data=data))
    with caplog.at_level(logging.WARNING):
        task = build_task(recipe.task, load_tokenizer("char"))
    assert "3 of 15 rows have no 'answer' (null or empty" in caplog.text
    assert "data.jsonl:13" in caplog.text and "left out" in caplog.text
    assert all(p.answer not in ("null", "") for p in task._train + task._heldout)


@data_case
@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("data_source", 7, r"field 'data_source' must be a string, got 7 in 12 of 12 rows"),
        (
            "extra_info",
            "x",
            r"field 'extra_info' must be an object \(a dict\) or absent, got 'x' in 12 of 12 rows",
        ),
    ],
)
def test_a_verl_column_of_the_wrong_type_is_refused_with_its_count(cli, tmp_path, column, value, message):
    rows = _verl_rows(12)
    for r in rows:
        r[column] = value
    cli("check", _parquet_recipe(tmp_path, rows)).one_line(message)
