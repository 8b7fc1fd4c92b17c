"""The jsonl task on data in verl's RL layout (parquet and JSONL), chat prompts, and verl-style rewards.

The rows are verl's (``examples/data_preprocess/gsm8k.py``): ``data_source``, ``prompt`` as chat
messages, ``ability``, ``reward_model = {"style": "rule", "ground_truth": ...}``, ``extra_info``. A
verl ``compute_score`` is called by keyword as verl's NaiveRewardManager calls it, and a batched
one as its BatchRewardManager does.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_rl.config import ConfigError
from moe_rl.tasks import CharTokenizer, JsonlConfig, TaskConfig, batch_rewards, build_task
from moe_rl.tasks.data import PLAIN_ASSISTANT_CUE, plain_chat, prompt_text, render_chat
from moe_rl.tasks.rewards import REWARD_SIGNATURES, RewardError


def verl_rows(n: int, start: int = 0) -> list[dict]:
    """``n`` rows in verl's RL layout; row i asks i+1 and keeps i in extra_info."""
    return [
        {
            "data_source": "toy/add",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(start, start + n)
    ]


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(path, heldout=None, **jsonl) -> TaskConfig:
    return TaskConfig(name="jsonl", jsonl=JsonlConfig(path=path, heldout_path=heldout, **jsonl))


def _reward_file(tmp_path, body: str, name: str = "score.py") -> str:
    (tmp_path / name).write_text(body)
    return str(tmp_path / name)


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_verl_layout_rows_become_prompts_and_answers(tmp_path, kind):
    write = write_parquet if kind == "parquet" else write_jsonl
    train = write(tmp_path / f"train.{kind}", verl_rows(6))
    held = write(tmp_path / f"held.{kind}", verl_rows(2, start=50))
    task = build_task(_cfg(train, held), CharTokenizer())  # no chat template: the plain rendering
    prompts = sorted(task.sample(0, 6, 0), key=lambda p: p.metadata["line"])
    assert [p.text for p in prompts] == [f"user: {i}+1=\nassistant:" for i in range(6)]
    assert [p.answer for p in prompts] == [str(i + 1) for i in range(6)]  # reward_model.ground_truth
    assert [p.text for p in task.heldout(5)] == ["user: 50+1=\nassistant:", "user: 51+1=\nassistant:"]
    where = prompts[2].metadata["where"]
    assert where == (f"{train} row 2" if kind == "parquet" else f"{train}:3")


def test_auto_format_is_per_file_and_explicit_format_wins(tmp_path):
    verl = write_parquet(tmp_path / "v.parquet", verl_rows(4))
    plain = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": f"a{i}"} for i in range(4)])
    task = build_task(_cfg(verl, plain))  # training file verl, held-out file plain
    assert sorted(p.answer for p in task.heldout(9)) == ["a0", "a1", "a2", "a3"]
    assert sorted(p.answer for p in task.sample(0, 4, 0)) == ["1", "2", "3", "4"]
    with pytest.raises(ConfigError, match=r"p\.jsonl:1: missing field 'data_source'.*format=plain"):
        build_task(_cfg(plain, format="verl"))
    with pytest.raises(ConfigError, match=r"v\.parquet: missing column 'answer'"):
        build_task(_cfg(verl, format="plain"))


def test_parquet_with_a_plain_layout_and_a_string_prompt(tmp_path):
    rows = [{"q": f"what is {i}?", "a": i, "resp": f"it is {i}"} for i in range(5)]
    path = write_parquet(tmp_path / "plain.parquet", rows)
    c = {
        "prompt_field": "q",
        "answer_field": "a",
        "response_field": "resp",
        "prompt_template": "Q: {prompt}\n",
    }
    task = build_task(_cfg(path, write_parquet(tmp_path / "h.parquet", rows[:1]), **c))
    assert sorted(p.text for p in task.sample(0, 4, 0)) == [f"Q: what is {i}?\n" for i in range(1, 5)]
    assert sorted(task.demonstrations(4, 0)) == [(f"Q: what is {i}?\n", f"it is {i}") for i in range(1, 5)]


class FakeChatTokenizer:
    """A tokenizer with a chat template: records how apply_chat_template was called."""

    chat_template = "{{ fake }}"
    bos_token = "<s>"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, **kw):
        self.calls.append((messages, kw))
        return "<s>" + "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"


def test_chat_prompts_use_the_tokenizers_template(tmp_path):
    rows = verl_rows(3)
    rows[0]["prompt"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "0+1="}]
    tok = FakeChatTokenizer()
    task = build_task(_cfg(write_parquet(tmp_path / "t.parquet", rows), prompt_template="{prompt}"), tok)
    texts = sorted(p.text for p in (*task.sample(0, 3, 0), *task.heldout(3)))
    assert "<|system|>be brief<|user|>0+1=<|assistant|>" in texts  # the leading BOS text is dropped
    assert texts.count("<|user|>1+1=<|assistant|>") == 1
    messages, kw = tok.calls[0]
    assert messages == rows[0]["prompt"] and kw == {"tokenize": False, "add_generation_prompt": True}
    # without a template: role: content lines, then the assistant cue
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert (
        render_chat(msgs, CharTokenizer()) == plain_chat(msgs) == "system: s\nuser: u\n" + PLAIN_ASSISTANT_CUE
    )
    tok.chat_template = None
    assert render_chat(msgs, tok) == plain_chat(msgs)


def test_hf_tokenizer_renders_its_chat_template(tmp_path):
    from moe_rl.tasks.tokenizer import HFTokenizer

    d = CharTokenizer().save_pretrained(tmp_path / "tok")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = HFTokenizer(d)
    msgs = [{"role": "user", "content": "2+2="}]
    assert tok.apply_chat_template(msgs) == "<bos>[user]2+2=\n[assistant]"
    assert prompt_text(msgs, "f:1", "prompt", tok) == "[user]2+2=\n[assistant]"  # the trainer adds <bos>


@pytest.mark.parametrize("value", [7, None, [], ["hi"], [{"role": "user"}], {"role": "user", "content": "x"}])
def test_a_prompt_neither_string_nor_messages_is_named(value):
    with pytest.raises(
        ConfigError, match=r"f\.parquet row 3: field 'prompt' must be a string, got .*chat messages"
    ):
        prompt_text(value, "f.parquet row 3", "prompt")


VERL_SCORE = """
import json
LOG = {log!r}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(LOG, "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    return {{"score": 0.5 if solution_str.strip() == str(ground_truth) else 0.25, "acc": True}}
"""


def _calls(log) -> list:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_verl_compute_score_gets_verls_arguments(tmp_path):
    rows = verl_rows(4)
    for r in rows:  # any value, passed as stored (not as the answer text)
        r["reward_model"]["ground_truth"] = int(r["reward_model"]["ground_truth"])
    log = tmp_path / "calls.jsonl"
    fn = _reward_file(tmp_path, VERL_SCORE.format(log=str(log)))
    task = build_task(_cfg(write_parquet(tmp_path / "t.parquet", rows), reward_fn=f"{fn}:compute_score"))
    assert task.reward_fn.kind == "verl"
    by_line = {p.metadata["line"]: p for p in (*task.sample(0, 4, 0), *task.heldout(4))}
    assert task.reward(by_line[1], " 2 ") == 0.5 and task.reward(by_line[3], "no") == 0.25
    assert _calls(log) == [
        ["toy/add", " 2 ", 2, {"split": "train", "index": 1}],
        ["toy/add", "no", 4, {"split": "train", "index": 3}],
    ]
    assert by_line[3].answer == "4"  # the plain answer text is JSON-encoded


def test_reward_signature_detection_and_its_errors(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", verl_rows(4))
    fn = _reward_file(
        tmp_path,
        "def plain(response, answer, record):\n    return 1.0\n"
        "def verl_batch(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0] * len(solution_strs)\n"
        "def verl_kw(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 1.0\n"
        "def two(a, b):\n    return 1.0\n",
    )
    assert build_task(_cfg(path, reward_fn=f"{fn}:plain")).reward_fn.kind == "plain"
    assert build_task(_cfg(path, reward_fn=f"{fn}:verl_kw")).reward_fn.kind == "verl"
    batched = build_task(_cfg(path, reward_fn=f"{fn}:verl_batch", reward_batched=True))
    assert batched.reward_fn.kind == "verl"
    with pytest.raises(ConfigError, match=r"verl_batch.* takes lists .*set task\.jsonl\.reward_batched=true"):
        build_task(_cfg(path, reward_fn=f"{fn}:verl_batch"))
    with pytest.raises(ConfigError, match=r"verl_kw.* takes one row .*set reward_batched=false"):
        build_task(_cfg(path, reward_fn=f"{fn}:verl_kw", reward_batched=True))
    with pytest.raises(ConfigError, match=r"two.* cannot be called as fn\(data_source=, solution_str="):
        build_task(_cfg(path, reward_fn=f"{fn}:two", reward_signature="verl"))
    with pytest.raises(ConfigError, match=r"two.* cannot be called as fn\(response, answer, record\)"):
        build_task(_cfg(path, reward_fn=f"{fn}:two"))


BATCHED = """
CALLS = []

def plain_batch(responses, answers, records):
    CALLS.append(("plain", responses, answers, [r["extra_info"]["index"] for r in records]))
    return [float(r == a) for r, a in zip(responses, answers)]

def verl_batch(data_sources, solution_strs, ground_truths, extra_infos):
    CALLS.append(("verl", data_sources, solution_strs, ground_truths, extra_infos))
    return [{"score": float(s == g)} for s, g in zip(solution_strs, ground_truths)]

def short(responses, answers, records):
    return [1.0]
"""


@pytest.mark.parametrize("name", ["plain_batch", "verl_batch"])
def test_batched_reward_is_called_once_per_batch_with_lists(tmp_path, name):
    fn = _reward_file(tmp_path, BATCHED, f"batched_{name}.py")
    path = write_parquet(tmp_path / "t.parquet", verl_rows(8))
    task = build_task(
        _cfg(
            path,
            write_parquet(tmp_path / "h.parquet", verl_rows(1, 50)),
            reward_fn=f"{fn}:{name}",
            reward_batched=True,
        )
    )
    calls = task.reward_fn.fn.__globals__["CALLS"]
    prompts = task.sample(0, 3, 0)
    group = [prompts[0], prompts[0], prompts[1], prompts[2]]  # a rollout batch: group rows repeat
    responses = [group[0].answer, "x", group[2].answer, "y"]
    assert batch_rewards(task, group, responses) == [1.0, 0.0, 1.0, 0.0]
    assert len(calls) == 1
    answers = [p.answer for p in group]
    if name == "plain_batch":
        assert calls[0] == ("plain", responses, answers, [p.metadata["line"] for p in group])
    else:
        extra = [{"split": "train", "index": p.metadata["line"]} for p in group]
        assert calls[0] == ("verl", ["toy/add"] * 4, responses, answers, extra)
    assert task.reward(prompts[0], prompts[0].answer) == 1.0 and len(calls) == 2  # one row: a list of one


def test_batched_reward_errors_name_the_row(tmp_path):
    fn = _reward_file(tmp_path, BATCHED + "\ndef bad(responses, answers, records):\n    return [1.0, 'x']\n")
    path = write_parquet(tmp_path / "t.parquet", verl_rows(4))
    for name, pattern in [
        ("short", r"short on the batch of 2 rows .* returned 1 values for 2 rows"),
        ("bad", r"bad on the record at .*t\.parquet row \d returned 'x' \(str\)"),
    ]:
        task = build_task(_cfg(path, reward_fn=f"{fn}:{name}", reward_batched=True, reward_signature="plain"))
        p = task.sample(0, 2, 0)
        with pytest.raises(RewardError, match=pattern):
            task.rewards(p, ["1", "2"])


@pytest.mark.parametrize(
    ("ret", "pattern"),
    [
        ("{'acc': 1.0}", r"returned \{'acc': 1\.0\} \(dict\) \(a dict needs a finite number under 'score'\)"),
        ("{'score': float('nan')}", r"returned \{'score': nan\} \(dict\)"),
        ("None", r"returned None \(NoneType\)"),
    ],
)
def test_verl_reward_values_that_are_not_numbers(tmp_path, ret, pattern):
    fn = _reward_file(
        tmp_path,
        f"def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return {ret}\n",
    )
    task = build_task(
        _cfg(write_parquet(tmp_path / "t.parquet", verl_rows(4)), reward_fn=f"{fn}:compute_score")
    )
    p = task.sample(0, 1, 0)[0]
    with pytest.raises(
        RewardError, match=rf"compute_score on the record at .*t\.parquet row {p.metadata['line']} {pattern}"
    ):
        task.reward(p, "1")


def test_bad_parquet_files(tmp_path, monkeypatch):
    import sys

    garbage = tmp_path / "broken.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(
        ConfigError, match=r"task\.jsonl\.path=.*broken\.parquet.*: not a readable parquet file .*write_table"
    ):
        build_task(_cfg(str(garbage)))
    rows = verl_rows(3)
    for r in rows:
        del r["data_source"]
    path = write_parquet(tmp_path / "nods.parquet", rows)
    with pytest.raises(
        ConfigError,
        match=r"nods\.parquet: missing column 'data_source' \(columns: prompt, ability.*format=plain",
    ) as e:
        build_task(_cfg(path))
    assert e.value.kind == "data error"
    rows = verl_rows(3)
    rows[1]["reward_model"] = {"style": "rule"}
    path = write_jsonl(tmp_path / "nogt.jsonl", rows)
    with pytest.raises(
        ConfigError, match=r"nogt\.jsonl:2: field 'reward_model' must be an object holding 'ground_truth'"
    ):
        build_task(_cfg(path))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(
        ConfigError,
        match=r"is a parquet file: reading it needs pyarrow: pip install pyarrow .*moe-rl\[data\]",
    ):
        build_task(_cfg(str(garbage)))


def test_reward_signatures_agree_with_the_config_choices():
    import typing

    hints = typing.get_type_hints(JsonlConfig)
    assert sorted(typing.get_args(hints["reward_signature"])) == sorted(["auto", *REWARD_SIGNATURES])


E2E_SCORE = """
import json
LOG = {log!r}

def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    with open(LOG, "a") as f:
        f.write(json.dumps([data_sources, solution_strs, ground_truths, extra_infos]) + "\\n")
    return [{{"score": 0.25}} for _ in solution_strs]
"""


def test_rl_run_on_a_verl_parquet_file_scores_with_the_users_compute_score(tmp_path, parallel_info):
    from moe_rl.trainer.metrics import read_metrics, read_samples
    from moe_rl.trainer.run import run
    from tests.tiny import tiny_rl_recipe

    log = tmp_path / "calls.jsonl"
    fn = _reward_file(tmp_path, E2E_SCORE.format(log=str(log)))
    jsonl = {
        "path": write_parquet(tmp_path / "train.parquet", verl_rows(8)),
        "heldout_path": write_parquet(tmp_path / "test.parquet", verl_rows(2, start=50)),
        "reward_fn": f"{fn}:compute_score",
        "reward_batched": True,
    }
    recipe = tiny_rl_recipe(tmp_path / "run", task={"name": "jsonl", "jsonl": jsonl}, train={"rl_steps": 2})
    run(recipe)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert [r["step"] for r in rows] == [0, 1] and all(r["reward/mean"] == 0.25 for r in rows)
    calls = _calls(log)
    # one call per rollout batch: 2 steps of 2 prompts x 2 samples, and the evaluations of 2 prompts
    assert sorted(len(c[1]) for c in calls) == [2] * (len(calls) - 2) + [4, 4]
    for sources, _responses, truths, extras in calls:
        assert set(sources) == {"toy/add"}
        assert all(e["index"] == int(t) - 1 for t, e in zip(truths, extras))
    assert {s["prompt"] for s in read_samples(tmp_path / "run")} <= {
        f"user: {i}+1=\nassistant:" for i in [*range(8), 50, 51]
    }
