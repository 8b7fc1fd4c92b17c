"""Files a recipe names (``moe_rl.config.RECIPE_PATHS``) are relative to the recipe file's folder
(each included file's to its own); a path given on the command line is relative to the current
folder; where a run writes (``train.out_dir``) stays relative to the current folder.

Before: every relative path resolved against the current folder, so a recipe run from elsewhere
failed with "does not exist" for a file next to it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from moe_rl.config import load_recipe
from moe_rl.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.fixture
def project(tmp_path) -> Path:
    """proj/exp/my.yaml (data and reward beside it) including proj/base/model.yaml, whose tokenizer
    path is relative to proj/base."""
    proj = tmp_path / "proj"

    def rows(a: int) -> str:
        return "".join(
            f'{{"prompt": "{i}+{a}=", "answer": "{i + a}", "response": "{i + a}"}}\n' for i in range(8)
        )

    write(proj / "exp" / "data" / "train.jsonl", rows(1))
    write(proj / "exp" / "data" / "test.jsonl", rows(2))
    write(
        proj / "exp" / "score.py",
        "def score(response, answer, record):\n    return float(response == answer)\n",
    )
    from moe_rl.tasks import CharTokenizer

    CharTokenizer().save_pretrained(proj / "base" / "tok")
    write(proj / "base" / "model.yaml", {"model": {"tokenizer": "tok", "max_seq_len": 64}})
    write(
        proj / "exp" / "my.yaml",
        {
            "include": "../base/model.yaml",
            "task": {
                "name": "jsonl",
                "jsonl": {
                    "path": "data/train.jsonl",
                    "heldout_path": "./data/test.jsonl",
                    "reward_fn": "score.py:score",
                    "response_field": "response",
                },
            },
            "train": {
                "stages": ["sft", "rl"],
                "out_dir": "runs/mine",
                "eval_prompts": 2,
                "max_new_tokens": 8,
            },
        },
    )
    return proj


def test_a_recipes_files_are_relative_to_its_folder_from_any_cwd(project, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(project / "exp" / "my.yaml")
    j = recipe.task.jsonl
    assert j.path == str(project / "exp" / "data" / "train.jsonl")
    assert j.heldout_path == str(project / "exp" / "data" / "test.jsonl")
    assert j.reward_fn == f"{project / 'exp' / 'score.py'}:score"
    assert recipe.model.tokenizer == str(project / "base" / "tok")  # the included file's own folder
    assert recipe.train.out_dir == "runs/mine"  # outputs: the current folder, as before
    preflight(recipe)  # the data, the reward and the tokenizer are found


def test_a_relative_recipe_path_gives_the_same_files(project, monkeypatch):
    monkeypatch.chdir(project.parent)
    assert load_recipe("proj/exp/my.yaml").task.jsonl.path == str(project / "exp" / "data" / "train.jsonl")


def test_command_line_paths_are_relative_to_the_current_folder(project, monkeypatch):
    """(made absolute against it as the recipe loads)"""
    monkeypatch.chdir(project)
    recipe = load_recipe(
        project / "exp" / "my.yaml",
        ["task.jsonl.path=exp/data/test.jsonl", "model.tokenizer=char", "task.jsonl.reward_fn=mod:fn"],
    )
    assert recipe.task.jsonl.path == str(project / "exp" / "data" / "test.jsonl")
    assert recipe.task.jsonl.reward_fn == "mod:fn"
    assert recipe.model.tokenizer == "char"


def test_the_saved_recipe_reads_the_same_files_from_its_own_folder(project, tmp_path, monkeypatch):
    """A run's recipe.yaml (to_dict of the resolved recipe) loads back to the same recipe from the
    run's folder, whatever held the paths relative: the file, an override, a dict."""
    from moe_rl.config import recipe_from_dict, to_dict

    monkeypatch.chdir(project)
    recipe = load_recipe(project / "exp" / "my.yaml", ["task.jsonl.heldout_path=exp/data/test.jsonl"])
    saved = tmp_path / "run" / "recipe.yaml"
    write(saved, to_dict(recipe))
    monkeypatch.chdir(tmp_path)
    assert load_recipe(saved) == recipe
    monkeypatch.chdir(project)
    task = {"name": "jsonl", "jsonl": {"path": "exp/data/train.jsonl"}}
    built = recipe_from_dict({"task": task, "train": {"stages": ["rl"]}})
    assert built.task.jsonl.path == str(project / "exp" / "data" / "train.jsonl")


def test_module_functions_char_and_absolute_paths_are_kept(tmp_path):
    absolute = str(tmp_path / "abs.jsonl")
    path = write(
        tmp_path / "sub" / "r.yaml",
        {
            "model": {"tokenizer": "char"},
            "task": {
                "name": "jsonl",
                "jsonl": {"path": absolute, "reward_fn": "moe_rl.tasks.jsonl:exact_match"},
            },
            "checkpoint": {"load": "ckpt", "dir": "out/ckpt"},
            "train": {"stages": ["rl"]},
        },
    )
    recipe = load_recipe(path)
    assert (recipe.model.tokenizer, recipe.task.jsonl.path) == ("char", absolute)
    assert recipe.task.jsonl.reward_fn == "moe_rl.tasks.jsonl:exact_match"
    assert recipe.checkpoint.load == str(tmp_path / "sub" / "ckpt")  # read: beside the recipe
    assert recipe.checkpoint.dir == "out/ckpt"  # written: the current folder


def test_every_path_key_is_a_recipe_field():
    from dataclasses import fields, is_dataclass

    from moe_rl.config import RECIPE_PATHS, Recipe

    for dotted in RECIPE_PATHS:
        cls = Recipe
        for part in dotted.split("."):
            (f,) = [f for f in fields(cls) if f.name == part]
            cls = f.default_factory if f.default_factory is not f.default else None
            cls = cls if cls is not None and is_dataclass(cls) else None
        assert cls is None, f"{dotted} names a section, not a field"


@pytest.mark.parametrize("name", ["dial_demo.yaml", "closest.yaml", "noise_demo.yaml"])
def test_the_shipped_demo_recipes_load_from_any_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(ROOT / "recipes" / "demo" / name)
    assert (
        os.path.isdir(recipe.model.hf_path) and Path(recipe.model.hf_path).parent == ROOT / "recipes" / "demo"
    )
