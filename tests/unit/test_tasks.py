"""Synthetic tasks (arithmetic, countdown): determinism, rewards, held-out split, config errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from moe_rl.config import ConfigError, build_dataclass
from moe_rl.tasks import TASKS, ArithmeticConfig, CountdownConfig, TaskConfig, build_task
from moe_rl.tasks.arithmetic import solve_steps
from moe_rl.tasks.base import is_heldout
from moe_rl.tasks.countdown import evaluate
from moe_rl.tasks.tokenizer import CharTokenizer

SYNTHETIC = ["arithmetic", "countdown"]


def _task(name: str, **kw):
    return build_task(TaskConfig(name=name, **kw))


def _corrupt(task_name: str, response: str) -> str:
    """Replace the final answer with a wrong one of the same shape."""
    head, _, ans = response.rpartition("A:")
    if task_name == "arithmetic":
        return f"{head}A:{int(ans) + 1}"
    return f"{head}A:({ans})+1"  # uses 1 (rarely given) and overshoots the target either way


@pytest.mark.parametrize("name", SYNTHETIC)
def test_sample_is_deterministic_and_stateless(name):
    task = _task(name)
    state = random.getstate()
    a = task.sample(5, 16, 7)
    random.seed(999)  # global random state must not matter
    b = _task(name).sample(5, 16, 7)
    random.setstate(state)
    assert a == b and len(a) == 16
    assert task.sample(5, 8, 7) == a[:8]  # item i does not depend on the batch size
    assert task.sample(6, 16, 7) != a and task.sample(5, 16, 8) != a
    assert len({p.text for p in a}) > 8


@pytest.mark.integration
def test_sample_is_identical_across_processes():
    code = (
        "import json; from moe_rl.tasks import TaskConfig, build_task\n"
        "print(json.dumps({n: [p.text for p in build_task(TaskConfig(name=n)).sample(3, 8, 11)]"
        " for n in ('arithmetic', 'countdown')}))"
    )
    outs = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        outs.append(json.loads(subprocess.check_output([sys.executable, "-c", code], env=env)))
    here = {n: [p.text for p in _task(n).sample(3, 8, 11)] for n in SYNTHETIC}
    assert outs[0] == outs[1] == here


@pytest.mark.parametrize("name", SYNTHETIC)
def test_demonstrations_score_one_and_corruptions_zero(name):
    task = _task(name)
    demos = task.demonstrations(300, seed=3)
    assert demos == task.demonstrations(300, seed=3) and demos != task.demonstrations(300, seed=4)
    pairs = task.demonstration_prompts(300, seed=3)
    assert [(p.text, r) for p, r in pairs] == demos
    tok = CharTokenizer()
    for p, response in pairs:
        assert task.reward(p, response) == 1.0, (p.text, response)
        assert task.reward(p, response + "<eos> trailing text A:0") == 1.0
        assert task.reward(p, _corrupt(name, response)) == 0.0, response
        assert task.reward(p, response.rpartition("A:")[0]) == 0.0  # no final answer
        assert task.reward(p, "") == 0.0
        assert tok.unk_id not in tok.encode(p.text + response)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_format_reward(name):
    task = _task(name, format_reward=0.1)
    p = task.sample(0, 1, 0)[0]
    good = task.reference_response(p)
    assert task.reward(p, good) == 1.0
    assert task.reward(p, _corrupt(name, good)) == pytest.approx(0.1)
    assert task.reward(p, "no answer here") == 0.0


@pytest.mark.parametrize("name", SYNTHETIC)
def test_heldout_is_disjoint_from_training(name):
    task = _task(name)
    held = task.heldout(300)
    assert held[:50] == task.heldout(50) and len({p.text for p in held}) == 300
    assert all(is_heldout(p.text, 0.05) for p in held)
    train = {p.text for step in range(40) for p in task.sample(step, 64, 0)}
    train |= {t for t, _ in task.demonstrations(500, seed=0)}
    assert not any(is_heldout(t, 0.05) for t in train)
    assert not train & {p.text for p in held}


def test_heldout_of_a_tiny_space_fails_clearly():
    task = build_task(
        TaskConfig(name="arithmetic", arithmetic=ArithmeticConfig(digits=1, max_operands=2, operators="+"))
    )
    with pytest.raises(ConfigError, match="distinct held-out prompts"):
        task.heldout(1000)


def test_arithmetic_matches_a_reference_evaluator_and_scales_with_steps():
    task = _task("arithmetic", arithmetic=ArithmeticConfig(operators="+-*", digits=2, max_operands=6))
    for p in task.sample(0, 200, 1):
        assert evaluate(p.text[2:-1])[0] == int(p.answer)  # the safe countdown parser as reference
    assert solve_steps([2, 3, 4], ["+", "*"]) == [(3, "*", 4, 12), (2, "+", 12, 14)]
    short = _task("arithmetic", arithmetic=ArithmeticConfig(min_operands=2, max_operands=2))
    long = _task("arithmetic", arithmetic=ArithmeticConfig(min_operands=16, max_operands=16))
    ls = [len(r) for _, r in short.demonstrations(50, 0)]
    ll = [len(r) for _, r in long.demonstrations(50, 0)]
    assert max(ls) < 25 and min(ll) > 100
    bare = _task("arithmetic", arithmetic=ArithmeticConfig(scratchpad=False))
    p = bare.sample(0, 1, 0)[0]
    assert bare.reference_response(p) == f"A:{p.answer}"


def test_countdown_targets_use_all_numbers_when_asked():
    task = _task("countdown", countdown=CountdownConfig(num_numbers=5, use_all_numbers=True))
    for p in task.sample(0, 50, 0):
        _, used = evaluate(p.answer)
        assert sorted(used) == sorted(p.metadata["numbers"])
        assert 1 <= p.metadata["target"] <= 200
    p = task.sample(0, 1, 0)[0]
    first = ",".join(map(str, p.metadata["numbers"][:2]))
    assert task.reward(p, f"A:{first.replace(',', '+')}") == 0.0  # not all numbers used


@pytest.mark.parametrize(
    ("section", "kwargs", "field"),
    [
        ("task", {"name": "sudoku"}, "task.name"),
        ("task", {"heldout_fraction": 0.0}, "task.heldout_fraction"),
        ("task", {"format_reward": 1.0}, "task.format_reward"),
        ("task", {"name": "jsonl"}, "task.jsonl.path"),
        ("arithmetic", {"min_operands": 1}, "task.arithmetic.min_operands"),
        ("arithmetic", {"min_operands": 5, "max_operands": 3}, "task.arithmetic.max_operands"),
        ("arithmetic", {"digits": 0}, "task.arithmetic.digits"),
        ("arithmetic", {"operators": "+/"}, "task.arithmetic.operators"),
        ("countdown", {"num_numbers": 1}, "task.countdown.num_numbers"),
        ("countdown", {"max_number": 1}, "task.countdown.max_number"),
        ("countdown", {"max_target": 0}, "task.countdown.max_target"),
        ("countdown", {"operators": "-/"}, "task.countdown.operators"),
        ("countdown", {"max_failed_attempts": -1}, "task.countdown.max_failed_attempts"),
        ("jsonl", {"reward_fn": "no_colon"}, "task.jsonl.reward_fn"),
        ("jsonl", {"prompt_template": "Q:"}, "task.jsonl.prompt_template"),
    ],
)
def test_bad_configs_name_the_field(section, kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        data = kwargs if section == "task" else {section: kwargs}
        build_dataclass(TaskConfig, data, "task")


def test_registry_and_yaml_shaped_config():
    assert sorted(TASKS) == ["arithmetic", "countdown", "jsonl"]
    with pytest.raises(ConfigError, match="arithmetic, countdown, jsonl"):
        TaskConfig(name="nope")
    cfg = build_dataclass(TaskConfig, {"name": "countdown", "countdown": {"num_numbers": 3}}, "task")
    assert cfg.countdown.num_numbers == 3 and type(build_task(cfg)).__name__ == "CountdownTask"
    with pytest.raises(ConfigError, match="task.countdown.bogus"):
        build_dataclass(TaskConfig, {"countdown": {"bogus": 1}}, "task")


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        (
            "arithmetic",
            {"arithmetic": ArithmeticConfig(min_operands=2, max_operands=5, digits=3, operators="+*")},
        ),
        ("countdown", {"countdown": CountdownConfig(num_numbers=5, max_number=99, max_target=500)}),
    ],
)
def test_longest_prompts_bound_every_prompt(name, kw):
    """The preflight's prompt bound is reached (equal length exists) and never exceeded."""
    task = _task(name, **kw)
    bound = max(map(len, task.longest_prompts()))
    lengths = [len(p.text) for p in task.sample(0, 500, 1) + task.heldout(20)]
    assert max(lengths) <= bound
    assert bound - max(lengths) <= 3  # tight: the longest drawn prompt is within a few characters
