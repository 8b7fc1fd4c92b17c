"""The jsonl task end to end: a temp data file, a reward function in a temp module, and its errors."""

from __future__ import annotations

import json

import pytest

from moe_rl.config import ConfigError
from moe_rl.tasks import JsonlConfig, TaskConfig, build_task
from moe_rl.tasks.base import is_heldout

REWARD_MODULE = '''
def score(response, answer, record):
    """1.0 when the answer is the first word of the response; 0.5 when it appears at all."""
    words = response.split()
    if words and words[0] == answer:
        return 1.0
    return 0.5 if answer in response else 0.0

NOT_CALLABLE = 3
'''


def _write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")  # a blank line is skipped
    return str(path)


@pytest.fixture
def data(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [
        {"q": f"capital of country {i}?", "a": f"city{i}", "resp": f"city{i} it is"} for i in range(200)
    ]
    return tmp_path, _write(tmp_path / "train.jsonl", records)


def _cfg(path, **jsonl_kw) -> TaskConfig:
    kw = {"prompt_field": "q", "answer_field": "a", "reward_fn": "my_rewards_mod:score", **jsonl_kw}
    return TaskConfig(name="jsonl", heldout_fraction=0.1, jsonl=JsonlConfig(path=path, **kw))


def test_end_to_end(data):
    _, path = data
    task = build_task(_cfg(path, response_field="resp", prompt_template="Q: {prompt}\nA: "))
    batch = task.sample(0, 8, 5)
    assert batch == build_task(_cfg(path, response_field="resp", prompt_template="Q: {prompt}\nA: ")).sample(
        0, 8, 5
    )
    assert batch != task.sample(1, 8, 5) and batch != task.sample(0, 8, 6)
    assert batch[0].text.startswith("Q: capital of country ") and batch[0].text.endswith("\nA: ")
    p = batch[0]
    assert task.reward(p, f"{p.answer} it is") == 1.0
    assert task.reward(p, f"maybe {p.answer}") == 0.5
    assert task.reward(p, "no idea") == 0.0
    # One epoch of a fixed batch size visits every training record exactly once.
    n, bs = task.num_train, 10
    seen = [q.text for step in range(-(-n // bs)) for q in task.sample(step, bs, 5)][:n]
    assert len(set(seen)) == n
    demos = task.demonstrations(300, seed=1)  # more than the records: cycles through epochs
    assert len(demos) == 300 and demos == task.demonstrations(300, seed=1)
    by_text = {q.text: q for step in range(-(-n // bs)) for q in task.sample(step, bs, 5)}
    for prompt_text, response in demos:
        assert task.reward(by_text[prompt_text], response) == 1.0
    held = task.heldout(1000)
    assert 5 <= len(held) <= 40 and all(is_heldout(h.text, 0.1) for h in held)
    assert not {h.text for h in held} & (set(seen) | {t for t, _ in demos})
    assert task.heldout(3) == held[:3]


def test_heldout_file_and_file_path_reward(data, tmp_path):
    _, path = data
    held_path = _write(
        tmp_path / "held.jsonl", [{"q": "capital of country 3?", "a": "city3"}, {"q": "new?", "a": 1}]
    )
    reward_file = tmp_path / "rw.py"
    reward_file.write_text("def exact(response, answer, record):\n    return float(response == answer)\n")
    task = build_task(_cfg(path, heldout_path=held_path, reward_fn=f"{reward_file}:exact"))
    held = task.heldout(10)
    assert [h.text for h in held] == ["capital of country 3?", "new?"] and held[1].answer == "1"
    assert task.num_train == 199  # the held-out prompt is removed from training
    train = {q.text for s in range(20) for q in task.sample(s, 10, 0)}
    assert len(train) == 199 and "capital of country 3?" not in train
    assert task.reward(held[1], "1") == 1.0 and task.reward(held[1], "1 ") == 0.0


def test_builtin_reward_functions(data):
    _, path = data
    task = build_task(_cfg(path, reward_fn="moe_rl.tasks.jsonl:exact_match"))
    p = task.sample(0, 1, 0)[0]
    assert task.reward(p, f"  {p.answer}\n") == 1.0 and task.reward(p, f"{p.answer}!") == 0.0
    task = build_task(_cfg(path, reward_fn="moe_rl.tasks.jsonl:answer_marker_match"))
    assert task.reward(p, f"think\nA: {p.answer}\nmore") == 1.0 and task.reward(p, p.answer) == 0.0


def test_errors_name_the_problem(data, tmp_path):
    _, path = data
    with pytest.raises(ConfigError, match=r"task\.jsonl\.path.*does not exist"):
        build_task(_cfg(str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a", "a": "b"}\n{"q": "c"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: missing field 'a'"):
        build_task(_cfg(str(bad)))
    bad.write_text('{"q": "a", "a": "b"}\n\n{"q": "c", oops}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:3: not valid JSON"):
        build_task(_cfg(str(bad)))
    bad.write_text('{"q": ["a"], "a": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: field 'q' must be a string"):
        build_task(_cfg(str(bad)))
    bad.write_text("\n")
    with pytest.raises(ConfigError, match="no records"):
        build_task(_cfg(str(bad)))
    bad.write_text('{"q": "a", "a": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: missing field 'resp'"):
        build_task(_cfg(str(bad), response_field="resp"))
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod_xyz'"):
        build_task(_cfg(path, reward_fn="no_such_mod_xyz:score"))
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        build_task(_cfg(path, reward_fn="my_rewards_mod:nope"))
    with pytest.raises(ConfigError, match="not callable"):
        build_task(_cfg(path, reward_fn="my_rewards_mod:NOT_CALLABLE"))
    with pytest.raises(ConfigError, match="does not exist"):
        build_task(_cfg(path, reward_fn=f"{tmp_path / 'nofile.py'}:f"))
    with pytest.raises(ConfigError, match="response_field"):
        build_task(_cfg(path)).demonstrations(1, 0)


def test_non_utf8_line_is_named(data, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"q": "a", "a": "b"}\n{"q": "caf\xe9", "a": "b"}\n')
    with pytest.raises(ConfigError, match=r"latin1\.jsonl:2: not UTF-8 text") as e:
        build_task(_cfg(str(bad)))
    assert e.value.kind == "data error"


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ("raise ValueError('bad answer')", r"raised ValueError: bad answer"),
        ("return float('inf')", r"returned inf \(float\): it must return a finite number"),
        ("return '1.0'", r"returned '1.0' \(str\)"),
    ],
)
def test_reward_errors_name_the_record_and_value(data, tmp_path, body, pattern):
    from moe_rl.tasks.jsonl import RewardError

    _, path = data
    (tmp_path / "bad_reward.py").write_text(f"def score(response, answer, record):\n    {body}\n")
    task = build_task(_cfg(path, reward_fn=f"{tmp_path / 'bad_reward.py'}:score"))
    prompt = task.sample(0, 1, 0)[0]
    line = prompt.metadata["line"]
    with pytest.raises(RewardError, match=rf"on the record at .*train\.jsonl:{line} {pattern}"):
        task.reward(prompt, "city0")


def test_reward_accepts_any_real_number(data, tmp_path):
    _, path = data
    (tmp_path / "ok_reward.py").write_text(
        "def score(response, answer, record):\n    return response == answer\n"
    )
    task = build_task(_cfg(path, reward_fn=f"{tmp_path / 'ok_reward.py'}:score"))
    prompt = task.sample(0, 1, 0)[0]
    assert task.reward(prompt, prompt.answer) == 1.0 and task.reward(prompt, "no") == 0.0


def test_longest_prompts_cover_the_file(data):
    _, path = data
    task = build_task(_cfg(path, prompt_template="Q: {prompt}\nA: "))
    longest = max(map(len, task.longest_prompts()))
    assert longest == max(len(p.text) for p in task.sample(0, 400, 0) + task.heldout(100))
