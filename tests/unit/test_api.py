"""The Python API (issue 49, item 3; docs/api.md): a recipe from a file or a dict, train, evaluate,
read metrics; a list of dicts or a ``datasets.Dataset`` as data and a Python function as the reward;
a plain script without an ``if __name__ == "__main__":`` guard told so in one line (it died with a
40-line ``EOFError`` traceback from the checkpoint writer's spawned child); progress lines shown and
megatron-core's warnings hidden, as on the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_rl
from moe_rl.api import reward_spec, with_data
from moe_rl.mainguard import guarded_lines
from tests.tiny import TINY_RL

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {"prompt": f"{a}+{b}=", "answer": str(a + b), "response": str(a + b)} for a in range(8) for b in range(8)
]


def exact(response, answer, record):
    return float(response.strip() == answer)


def python(tmp_path: Path, code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


TINY = {
    **TINY_RL,
    "task": {**TINY_RL["task"], "jsonl": {"response_field": "response"}},
    "train": {**TINY_RL["train"], "stages": ["sft", "rl"], "sft_steps": 2, "sft_batch_size": 4},
}
"The tiny policy, 2 SFT steps then 1 RL step; its jsonl task (with data given) learns from ``response``."


@pytest.mark.integration
def test_a_script_without_the_main_guard_is_told_in_one_line(tmp_path):
    res = python(
        tmp_path,
        f"""
        import moe_rl

        def go():
            moe_rl.train({json.dumps(TINY)}, ["train.out_dir=run"])

        go()
        """,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr and "EOFError" not in res.stderr, res.stderr
    assert res.stderr.strip() == (
        f"moe-rl: {tmp_path / 'script.py'}:7: moe_rl.train starts child processes, which run this script's "
        'top-level code again: put the call under `if __name__ == "__main__":` (Python\'s multiprocessing rule)'
    )
    assert not (tmp_path / "run").exists()


def test_the_guard_is_found_where_it_is():
    src = 'import x\n\nif __name__ == "__main__":\n    x.go()\n    x.more()\nif "__main__" == __name__: y()\n'
    assert guarded_lines(src) == [(3, 5), (6, 6)]
    assert guarded_lines("if __name__ != '__main__':\n    go()\n") == []


@pytest.mark.integration
def test_a_guarded_script_trains_with_progress_and_without_megatrons_warnings(tmp_path):
    """A plain script: data as a list of dicts, the reward a function of the script, warnings on as
    Python shows them by default; the progress lines (phase, s/step, ETA) and no warning on stderr."""
    res = python(
        tmp_path,
        f"""
        import moe_rl

        def reward(response, answer, record):
            return float(response.strip() == answer)

        rows = {json.dumps(ROWS)}

        if __name__ == "__main__":
            out = moe_rl.train({json.dumps(TINY)}, ["train.out_dir=run"], data=rows, reward=reward)
            print(sorted(out), out["rl"]["eval/accuracy"])
        """,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("['rl', 'sft'] ")
    assert "phase: sft, 2 steps" in res.stderr and "s/step | ETA" in res.stderr
    assert "Warning" not in res.stderr, res.stderr
    recipe = moe_rl.load_recipe(tmp_path / "run" / "recipe.yaml")
    assert recipe.task.name == "jsonl" and recipe.task.jsonl.path == str(
        tmp_path / "run" / "data" / "train.jsonl"
    )
    assert recipe.task.jsonl.reward_fn.startswith("moe_rl.api:reward_reward_")  # a script's function


class Dataset:
    """What ``moe_rl`` reads of a ``datasets.Dataset``: ``to_list()``."""

    def __init__(self, rows):
        self.rows = rows

    def to_list(self):
        return list(self.rows)


@pytest.mark.parametrize("kind", ["list", "dataset", "hf_dataset"])
def test_data_in_python_becomes_the_jsonl_task(tmp_path, kind):
    if kind == "hf_dataset":
        datasets = pytest.importorskip("datasets")
        data = datasets.Dataset.from_list(ROWS)
    else:
        data = ROWS if kind == "list" else Dataset(ROWS)
    base = moe_rl.recipe_from_dict({**TINY, "train": {**TINY["train"], "out_dir": str(tmp_path / "run")}})
    recipe = with_data(base, data=data, heldout=ROWS[:4], reward=exact)
    j = recipe.task.jsonl
    assert recipe.task.name == "jsonl" and j.reward_fn == f"{__name__}:exact"  # importable: by name
    rows = [json.loads(line) for line in Path(j.path).read_text().splitlines()]
    assert rows == ROWS and len(Path(j.heldout_path).read_text().splitlines()) == 4
    assert with_data(base) is base


def test_a_reward_function_is_named_or_registered():
    assert reward_spec("mod:fn") == "mod:fn" and reward_spec(exact) == f"{__name__}:exact"
    spec = reward_spec(lambda response, answer, record: 1.0)  # a lambda: this process's registry
    from moe_rl.tasks.rewards import import_reward_fn

    assert (
        spec.startswith("moe_rl.api:reward_")
        and "lambda" in spec
        and import_reward_fn(spec)("a", "b", {}) == 1.0
    )
    with pytest.raises(moe_rl.ConfigError, match="give a function"):
        reward_spec(3)


def test_train_evaluate_and_read_metrics_in_process(tmp_path, parallel_info):
    """``train`` returns each stage's last metrics; ``read_metrics`` every row; ``evaluate`` of the
    run's newest checkpoint gives the accuracy the run's own final evaluation gave (same weights,
    same held-out prompts, greedy)."""
    recipe = moe_rl.recipe_from_dict({**TINY, "train": {**TINY["train"], "out_dir": str(tmp_path / "run")}})

    def odd(response, answer, record):  # rewards that vary, so the step trains
        return float(len(response) % 2)

    out = moe_rl.train(recipe, data=ROWS, reward=odd)
    rl = moe_rl.read_metrics(recipe.train.out_dir, "rl")
    assert [r["step"] for r in rl] == [0] and out["rl"]["reward/mean"] == rl[-1]["reward/mean"]
    trained = with_data(recipe, data=ROWS, reward=odd)
    assert moe_rl.evaluate(trained) == {"eval/accuracy": out["rl"]["eval/accuracy"]}
    assert moe_rl.read_metrics(recipe.train.out_dir, "sft")[-1]["step"] == 1
