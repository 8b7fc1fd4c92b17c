"""The countdown answer parser: safe, exact, and strict about which numbers are used."""

from __future__ import annotations

from fractions import Fraction

import pytest

from moe_rl.tasks import Prompt, TaskConfig, build_task
from moe_rl.tasks.countdown import ExpressionError, check_expression, evaluate

NUMS = [3, 7, 25, 50]


@pytest.mark.parametrize(
    ("text", "value", "used"),
    [
        ("25+7", 32, [25, 7]),
        ("(25+7)*3", 96, [25, 7, 3]),
        ("25+7*3", 46, [25, 7, 3]),  # precedence
        ("50-25-7", 18, [50, 25, 7]),  # left associative
        ("50/25/2", 1, [50, 25, 2]),
        (" ( ( 50 ) ) ", 50, [50]),
        ("7/3*3", 7, [7, 3, 3]),  # exact fractions in between
        ("3/7", Fraction(3, 7), [3, 7]),
    ],
)
def test_evaluate(text, value, used):
    assert evaluate(text) == (value, used)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "25+",
        "+25",
        "-3+7",
        "(25+7",
        "25+7)",
        "25 7",
        "()",
        "2**3",
        "25^2",
        "3.5",
        "07+1",
        "x",
        "__import__('os')",
        "1e3",
        "(" * 200 + "1" + ")" * 200,
        "٣+1",
    ],
)
def test_malformed_expressions_raise(text):
    with pytest.raises(ExpressionError):
        evaluate(text)


def test_division_by_zero_is_rejected():
    with pytest.raises(ExpressionError, match="division by zero"):
        evaluate("7/(3-3)")
    assert check_expression("7/(3-3)", [7, 3, 3], 1).startswith("malformed")


def test_check_expression_reasons():
    assert check_expression("(50-25)*3+7", NUMS, 82) is None
    assert check_expression("7+3", NUMS, 10) is None  # a subset is fine
    assert "not a given number" in check_expression("50+8", NUMS, 58)
    assert "2 times" in check_expression("25+25", NUMS, 50)  # reuse
    assert check_expression("25+25", [25, 25, 1], 50) is None  # given twice, used twice
    assert "evaluates to" in check_expression("25+7", NUMS, 33)
    assert "every given number" in check_expression("50+25", NUMS, 75, use_all=True)
    assert check_expression("50+25+7+3", NUMS, 85, use_all=True) is None
    assert check_expression("7/3*3", [7, 3, 3], 7) is None  # exact arithmetic, no float error


def test_reward_parses_the_first_answer_robustly():
    task = build_task(TaskConfig(name="countdown", format_reward=0.1))
    p = Prompt(text="N:3,7,25,50 T:96\n", answer="(25+7)*3", metadata={"numbers": NUMS, "target": 96})
    assert task.reward(p, "25+7=32,32*3=96\nA:(25+7)*3") == 1.0
    assert task.reward(p, "A:3*(7+25)") == 1.0  # any valid expression, not only the reference
    assert task.reward(p, "A: 3*(7+25) is it.<eos>more text") == 1.0
    assert task.reward(p, "A:3*(7+25)\nA:1") == 1.0
    assert task.reward(p, "A:1\nA:3*(7+25)") == pytest.approx(0.1)  # the first answer counts
    assert task.reward(p, "3*(7+25)") == 0.0  # no answer marker
    assert task.reward(p, "A:3*(7+25") == 0.0  # malformed: no format credit
    assert task.reward(p, "A:(50-25)*3") == pytest.approx(0.1)  # well-formed, wrong value
    assert task.reward(p, "A:3*(7+25)+0") == pytest.approx(0.1)  # 0 is not a given number
    assert task.reward(p, "A:3*32") == pytest.approx(0.1)  # 32 is an intermediate, not a given number
