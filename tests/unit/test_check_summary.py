"""``moe-rl check`` ends with what it detected (issue 49, item 9): the model and its weights, the
tokenizer and how it was chosen, the data layout and prompt form, the reward function's signature
and what the run will do, as YAML comments after the resolved recipe (which still parses).

Before: 180 lines of YAML, and not a word on what was detected.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from moe_rl.cli import main

ROOT = Path(__file__).resolve().parents[2]


def check(capsys, *args) -> tuple[dict, list[str]]:
    assert main(["check", *map(str, args)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = lines.index("# detected:")
    return yaml.safe_load(out), [ln.removeprefix("#   ") for ln in lines[start + 1 :]]


def test_check_of_a_builtin_recipe_says_what_it_found(capsys):
    recipe, said = check(capsys, ROOT / "recipes" / "tiny.yaml")
    assert recipe["model"]["num_layers"] == 4  # the YAML above the summary is whole
    assert said == [
        "model: 4 layers, hidden 128, 8 experts top-2, vocabulary 104, float32; random weights (model.seed 1234)",
        "tokenizer: the built-in character tokenizer, 104 ids",
        "task: arithmetic (built in, prompts generated from task.seed); evaluation on 64 held-out prompts",
        "run: sft (60 steps); gspo with routing none; KL: none; 1 process(es): tp 1, ep 1, dp 1; "
        "rollouts: embedded; writes into runs/tiny",
    ]


def test_check_names_the_data_layout_the_prompt_form_and_the_reward_signature(tmp_path, capsys):
    """verl's RL layout with chat prompts, scored by verl's compute_score, the start from an HF
    folder: each named as found."""
    row = {
        "data_source": "my/addition",
        "ability": "math",
        "extra_info": {},
    }
    rows = [
        {
            **row,
            "prompt": [{"role": "user", "content": f"{i}+{j}="}],
            "reward_model": {"ground_truth": str(i + j)},
        }
        for i in range(5)
        for j in range(5)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    (tmp_path / "r.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"hf_path": str(ROOT / "recipes" / "demo" / "start"), "max_seq_len": 64},
                "task": {
                    "name": "jsonl",
                    "heldout_fraction": 0.2,
                    "jsonl": {"path": "train.jsonl", "reward_fn": "score.py:compute_score"},
                },
                "train": {
                    "stages": ["rl"],
                    "rl_steps": 3,
                    "out_dir": "runs/mine",
                    "eval_prompts": 2,
                    "max_new_tokens": 8,
                },
                "algo": {"kl_coef": 0.01},
            }
        )
    )
    _, said = check(capsys, tmp_path / "r.yaml")
    text = "\n".join(said)
    assert (
        f"weights and architecture from model.hf_path={ROOT / 'recipes/demo/start'} (its config.json)" in text
    )
    assert "tokenizer: the built-in character tokenizer (model.hf_path=" in text
    assert f"data: {tmp_path / 'train.jsonl'}: " in text
    assert "training prompts in verl's RL layout (data_source, prompt, reward_model.ground_truth)" in text
    assert "prompts are chat messages, rendered as role: content lines" in text
    assert f"reward: {tmp_path / 'score.py'}:compute_score, verl signature" in text
    assert "KL: k3 to the RL start, loss x0.01, reward x0.0" in text
