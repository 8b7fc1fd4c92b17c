"""``model.hf_path`` pointing at something that is not a Hugging Face checkpoint, or a recipe that
disagrees with its ``config.json``: ``moe-rl check`` and ``moe-rl train`` say so in one line.

A wrong path used to pass ``check`` and end ``train`` in a traceback (FileNotFoundError from
``read_hf_config`` or safetensors), after the run folder was made.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.badinput.conftest import assert_kept, snapshot

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / "recipes" / "demo" / "start"
"A real HF checkpoint of the default model (config.json, one shard and its index, tokenizer)."

recipe_case = pytest.mark.bad_input("recipe")


def hf_recipe(tmp_path: Path, hf_path: Path, **model) -> Path:
    path = tmp_path / "r.yaml"
    data = {
        "model": {"hf_path": str(hf_path), **model},
        "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 2, "digits": 1}},
        "train": {"stages": ["sft"], "sft_steps": 1, "sft_batch_size": 2, "out_dir": str(tmp_path / "run")},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def broken_start(tmp_path: Path, how: str) -> Path:
    """A copy of the shipped start, broken as ``how`` says."""
    folder = tmp_path / "start"
    shutil.copytree(START, folder)
    if how == "no_config":
        (folder / "config.json").unlink()
    elif how == "no_weights":
        for f in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
            f.unlink()
    elif how == "missing_shard":
        next(folder.glob("*.safetensors")).unlink()
    elif how == "bad_config":
        (folder / "config.json").write_text("{not json")
    elif how == "dense":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "num_experts": 0}))
    return folder


CASES = {
    "nowhere": (
        None,
        r"model\.hf_path=.*nowhere does not exist: give a local Hugging Face checkpoint directory",
    ),
    "a_file": (None, r"model\.hf_path=.*a_file is a file, not a directory"),
    "no_config": ("no_config", r"model\.hf_path=.*start has no config\.json: not a Hugging Face checkpoint"),
    "no_weights": (
        "no_weights",
        r"model\.hf_path=.*start has config\.json but no weights \(no model\.safetensors",
    ),
    "missing_shard": (
        "missing_shard",
        r"model\.hf_path=.*start: 1 of the 1 weight files model\.safetensors\.index\.json lists are missing "
        r"\(model-00001-of-00001\.safetensors\)",
    ),
    "bad_config": ("bad_config", r"model\.hf_path=.*start: config\.json is unreadable"),
    "dense": (
        "dense",
        r"model\.hf_path=.*start: unsupported Hugging Face config: num_experts is missing or 0",
    ),
}


@recipe_case
@pytest.mark.parametrize("case", sorted(CASES))
def test_check_refuses_a_hf_path_that_is_no_checkpoint(cli, tmp_path, case):
    how, said = CASES[case]
    if how is not None:
        folder = broken_start(tmp_path, how)
    else:
        folder = tmp_path / case
        if case == "a_file":
            folder.write_text("weights?")
    path = hf_recipe(tmp_path, folder)
    before = snapshot(tmp_path)
    cli("check", path).one_line(r"configuration error: " + said)
    assert_kept(before, tmp_path)


@recipe_case
def test_train_refuses_a_missing_hf_path_before_anything_is_written(cli, tmp_path):
    path = hf_recipe(tmp_path, tmp_path / "nowhere")
    cli("train", path).one_line(r"configuration error: model\.hf_path=.*nowhere does not exist")
    assert not (tmp_path / "run").exists()


@recipe_case
def test_a_recipe_field_that_disagrees_with_config_json_is_one_line(cli, tmp_path):
    """The recipe says 2 layers, the checkpoint has 4: it used to fail when the policy was built
    (after the run folder and process group were made), as a ValueError listing field pairs."""
    path = hf_recipe(tmp_path, START, num_layers=2)
    line = cli("check", path).one_line(
        r"configuration error: model\.hf_path=.*start: the recipe disagrees with its config\.json "
        r"\(model\.num_layers=2 vs num_hidden_layers=4\): remove model\.num_layers from the recipe"
    )
    assert "point model.hf_path at the checkpoint they describe" in line
    cli("train", path).one_line(r"model\.num_layers=2 vs num_hidden_layers=4")
    assert not (tmp_path / "run").exists()


@recipe_case
def test_check_of_a_good_hf_path_prints_the_folders_architecture(cli, tmp_path):
    """Nothing set in the recipe but the path: the resolved recipe shows config.json's values."""
    cfg = json.loads((START / "config.json").read_text())
    res = cli("check", hf_recipe(tmp_path, START, max_seq_len=64))
    assert res.code == 0, res.err[-2000:]
    model = yaml.safe_load(res.out)["model"]
    assert (model["num_layers"], model["hidden_size"]) == (cfg["num_hidden_layers"], cfg["hidden_size"])
