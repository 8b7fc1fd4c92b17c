"""Bad JSONL data and bad reward functions: one line naming the file and line, or the record and the
returned value.

Data cases run ``moe-rl check`` in this process (the task's data is read by the preflight); the
reward cases train one RL step of a tiny policy (seconds), since a reward runs only on rollouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.badinput.conftest import RUN_MODEL, assert_kept, run_cli, snapshot

data_case = pytest.mark.bad_input("data")
reward_case = pytest.mark.bad_input("reward")

TINY = {
    "model": RUN_MODEL,
    "train": {
        "stages": ["rl"],
        "rl_steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "minibatches": 1,
        "max_new_tokens": 4,
        "eval_prompts": 2,
        "flip_probe_sequences": 0,
        "log_every": 100,
    },
}


def _records(n: int, start: int = 0) -> str:
    return "".join(
        json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(start, start + n)
    )


def _recipe(tmp_path: Path, *, data: str | bytes | None = None, **jsonl) -> Path:
    """A tiny jsonl recipe under ``tmp_path``: ``data.jsonl`` (train), ``held.jsonl`` (held-out)."""
    path = tmp_path / "data.jsonl"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(_records(12) if data is None else data)
    (tmp_path / "held.jsonl").write_text(_records(4, start=100))
    task = {"path": str(path), "heldout_path": str(tmp_path / "held.jsonl"), **jsonl}
    recipe = {
        **TINY,
        "task": {"name": "jsonl", "jsonl": task},
        "train": {**TINY["train"], "out_dir": str(tmp_path / "run")},
    }
    out = tmp_path / "r.yaml"
    out.write_text(json.dumps(recipe))  # JSON is YAML
    return out


@data_case
def test_non_utf8_line_named(cli, tmp_path):
    data = _records(3).encode() + b'{"prompt": "caf\xe9", "answer": "1"}\n'
    recipe = _recipe(tmp_path, data=data)
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(r"data error: .*data\.jsonl:4: not UTF-8 text .*save the file as UTF-8")
    assert_kept(before, tmp_path)


@data_case
def test_invalid_json_line_named(cli, tmp_path):
    recipe = _recipe(tmp_path, data=_records(2) + "{prompt: 1}\n")
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(r"data error: .*data\.jsonl:3: not valid JSON")
    assert_kept(before, tmp_path)


@data_case
def test_missing_field_named(cli, tmp_path):
    recipe = _recipe(tmp_path, data=_records(2) + '{"question": "x", "answer": "1"}\n')
    cli("check", recipe).one_line(r"data\.jsonl:3: missing field 'prompt' \(keys: answer, question\)")


@data_case
def test_prompt_not_a_string(cli, tmp_path):
    recipe = _recipe(tmp_path, data=_records(2) + '{"prompt": 7, "answer": "1"}\n')
    cli("check", recipe).one_line(r"data\.jsonl:3: field 'prompt' must be a string, got 7")


@data_case
def test_empty_data_file(cli, tmp_path):
    recipe = _recipe(tmp_path, data="\n\n")
    cli("check", recipe).one_line(r"task\.jsonl\.path=.*data\.jsonl.*: the file has no records")


@data_case
def test_missing_data_file(cli, tmp_path):
    recipe = _recipe(tmp_path)
    (tmp_path / "data.jsonl").unlink()
    cli("check", recipe).one_line(r"task\.jsonl\.path=.*data\.jsonl.*: file does not exist")


@data_case
def test_data_path_is_a_folder(cli, tmp_path):
    recipe = _recipe(tmp_path)
    (tmp_path / "data.jsonl").unlink()
    (tmp_path / "data.jsonl").mkdir()
    cli("check", recipe).one_line(r"task\.jsonl\.path=.*data\.jsonl.* is a folder")


@data_case
def test_no_heldout_records(cli, tmp_path):
    """Without held_out records the end-of-RL accuracy would be 0/0: refused before training."""
    recipe = _recipe(tmp_path, heldout_path=None)
    r = cli("check", recipe, "task.heldout_fraction=0.000001")
    r.one_line(r"task jsonl: 0 held-out prompts for evaluation.*NaN.*task\.jsonl\.heldout_path")


@data_case
def test_longest_jsonl_prompt_too_long(cli, tmp_path):
    long = json.dumps({"prompt": "9" * 60, "answer": "1"}) + "\n"
    recipe = _recipe(tmp_path, data=_records(5) + long)
    cli("check", recipe).one_line(
        r"task jsonl: the longest prompt \(61 tokens\) \+ train\.max_new_tokens=4 exceeds model\.max_seq_len=48"
    )


@data_case
def test_train_refuses_bad_data_before_the_run_folder(cli, tmp_path):
    recipe = _recipe(tmp_path, data=_records(2) + "not json\n")
    cli("train", recipe).one_line(r"data\.jsonl:3: not valid JSON")
    assert not (tmp_path / "run").exists()


# verl's RL layout (parquet or JSONL) and verl-style reward functions.
def _verl_rows(n: int, start: int = 0) -> list[dict]:
    return [
        {
            "data_source": "toy/add",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]


def _parquet_recipe(tmp_path: Path, rows: list[dict] | None = None, **jsonl) -> Path:
    """A tiny jsonl recipe on ``data.parquet`` (train) and ``held.parquet`` in verl's layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_verl_rows(12) if rows is None else rows), tmp_path / "data.parquet")
    pq.write_table(pa.Table.from_pylist(_verl_rows(4, start=100)), tmp_path / "held.parquet")
    task = {"path": str(tmp_path / "data.parquet"), "heldout_path": str(tmp_path / "held.parquet"), **jsonl}
    recipe = {
        **TINY,
        "task": {"name": "jsonl", "jsonl": task},
        "train": {**TINY["train"], "out_dir": str(tmp_path / "run")},
    }
    out = tmp_path / "r.yaml"
    out.write_text(json.dumps(recipe))
    return out


@data_case
def test_verl_parquet_missing_column_named(cli, tmp_path):
    rows = _verl_rows(12)
    for r in rows:
        del r["data_source"]
    recipe = _parquet_recipe(tmp_path, rows)
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(
        r"data error: .*data\.parquet: missing column 'data_source' \(columns: .*\); the verl layout .*needs "
        r"data_source, prompt and reward_model\.ground_truth: fix the data, or set task\.jsonl\.format=plain"
    )
    assert_kept(before, tmp_path)


@data_case
def test_unreadable_parquet_named(cli, tmp_path):
    recipe = _parquet_recipe(tmp_path)
    (tmp_path / "data.parquet").write_bytes(b"PAR1" + b"\0" * 64)  # a truncated file
    cli("check", recipe).one_line(
        r"data error: task\.jsonl\.path=.*data\.parquet.*: not a readable parquet file \(.*\); write it "
        r"with pyarrow\.parquet\.write_table"
    )


@data_case
def test_parquet_without_pyarrow_says_what_to_install(cli, tmp_path, monkeypatch):
    import sys

    recipe = _parquet_recipe(tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    cli("check", recipe).one_line(
        r"configuration error: task\.jsonl\.path=.*data\.parquet.* is a parquet file: reading it needs "
        r"pyarrow: pip install pyarrow \(or pip install 'moe-rl\[data\]'\)"
    )


@data_case
def test_prompt_neither_string_nor_messages(cli, tmp_path):
    bad = {**_verl_rows(1)[0], "prompt": {"role": "user", "content": "1+1="}}  # one message, not a list
    data = "".join(json.dumps(r) + "\n" for r in [*_verl_rows(2), bad])
    recipe = _recipe(tmp_path, data=data)
    cli("check", recipe).one_line(
        r"data error: .*data\.jsonl:3: field 'prompt' must be a string, got \{'role': 'user'.*\(or a "
        r"non-empty list of chat messages \[\{'role': 'user', 'content': '\.\.\.'\}\]\)"
    )


@data_case
def test_reward_fn_that_cannot_be_imported(cli, tmp_path):
    recipe = _parquet_recipe(tmp_path, reward_fn="no_such_rewards_pkg.scores:compute_score")
    cli("check", recipe).one_line(
        r"configuration error: task\.jsonl\.reward_fn='no_such_rewards_pkg\.scores:compute_score': cannot "
        r"import module 'no_such_rewards_pkg\.scores' .*put it on PYTHONPATH or write path/to/file\.py:function"
    )


@data_case
def test_batched_compute_score_without_reward_batched(cli, tmp_path):
    (tmp_path / "score.py").write_text(
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
        "    return [0.0] * len(solution_strs)\n"
    )
    recipe = _parquet_recipe(tmp_path, reward_fn=f"{tmp_path / 'score.py'}:compute_score")
    cli("check", recipe).one_line(
        r"configuration error: task\.jsonl\.reward_fn=.*score\.py:compute_score' takes lists \(data_sources, "
        r"solution_strs, ground_truths, extra_infos\): set task\.jsonl\.reward_batched=true"
    )


@reward_case
def test_verl_reward_dict_without_score_names_the_row(cli, tmp_path):
    (tmp_path / "score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'acc': 1.0}\n"
    )
    recipe = _parquet_recipe(tmp_path, reward_fn=f"{tmp_path / 'score.py'}:compute_score")
    cli("train", recipe).one_line(
        r"reward error: task\.jsonl\.reward_fn=.*score\.py:compute_score on the record at .*\.parquet row \d+ "
        r"returned \{'acc': 1\.0\} \(dict\) \(a dict needs a finite number under 'score'\)"
    )


# Rewards: the user function runs on rollouts, so these train one RL step.
REWARDS = {
    "raises": ("    raise KeyError('score')\n", r"raised KeyError: 'score'"),
    "nan": ("    return float('nan')\n", r"returned nan \(float\): it must return a finite number"),
    "string": ("    return 'yes'\n", r"returned 'yes' \(str\): it must return a finite number"),
    "none": ("    return None\n", r"returned None \(NoneType\)"),
    # it used to end the run with no message
    "exits": (
        "    import sys\n    sys.exit(3)\n",
        r"raised SystemExit: 3 .*: a reward function must return a number, not exit",
    ),
}


@reward_case
@pytest.mark.parametrize("name", sorted(REWARDS))
def test_reward_error_names_the_record(cli, tmp_path, name):
    body, pattern = REWARDS[name]
    (tmp_path / "score.py").write_text(f"def score(response, answer, record):\n{body}")
    recipe = _recipe(tmp_path, reward_fn=f"{tmp_path / 'score.py'}:score")
    before = snapshot(tmp_path)
    line = cli("train", recipe).one_line(
        r"reward error: task\.jsonl\.reward_fn=.*score\.py:score on the record at .*\.jsonl:\d+ " + pattern
    )
    assert "Traceback" not in line
    assert_kept(before, tmp_path)


@pytest.mark.integration
@data_case
def test_characters_the_tokenizer_lacks_are_warned_about_before_training(tmp_path):
    """CJK or emoji under the built-in character tokenizer became ``<unk>`` with no word (a
    subprocess: the warning is a log line)."""
    odd = (
        json.dumps({"prompt": "你好 1+1=", "answer": "2"})
        + "\n"
        + json.dumps({"prompt": "😀+1=", "answer": "1"})
    )
    res = run_cli("check", _recipe(tmp_path, data=_records(10) + odd + "\n"), timeout=120)
    assert res.code == 0, res.err[-2000:]
    warning = [ln for ln in res.err.splitlines() if "tokenizer lacks" in ln]
    assert len(warning) == 1, res.err[-2000:]
    assert "2 prompts hold 3 characters the char tokenizer lacks" in warning[0]
    assert all(repr(c) in warning[0] for c in "你好😀") and "model.tokenizer=DIR" in warning[0]
