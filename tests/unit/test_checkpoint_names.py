"""Checkpoint folders named by stage and step (``0003-sft-step-000060``), beside the older
``step-N`` folders of existing runs, and ``model.hf_path``'s architecture read from config.json.

No model is built: checkpoints here are folders with a ``meta.json`` (what :func:`verify_checkpoint`
reads), saves are recorded instead of written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import moe_rl.megatron.checkpoint as ck
from moe_rl.config import ConfigError, load_recipe
from moe_rl.trainer.state import Checkpointer, RunState


def fake_checkpoint(root: Path, name: str, number: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": number, "extra": {"stage": "sft", "step": number}}))
    return d


def test_the_name_says_stage_and_step_and_its_number_orders_it():
    assert ck.checkpoint_name(3, "sft-step-000060") == "0003-sft-step-000060"
    assert ck.checkpoint_name(12345, "rl-step-000040") == "12345-rl-step-000040"
    assert ck.checkpoint_name(7) == "0007-checkpoint"
    for name, number in [("0003-sft-step-000060", 3), ("step-00000002", 2), ("12345-rl-step-000040", 12345)]:
        assert ck.step_number(Path(name)) == number
    for other in ("latest", ".tmp-0003-sft-step-000060", "hf", "0003", "step-", "3-SFT"):
        assert ck.step_number(Path(other)) is None
    with pytest.raises(ValueError):
        ck.checkpoint_name(1, "has space")


def test_checkpoints_of_both_schemes_are_listed_by_number_and_the_newest_is_found(tmp_path):
    """An old run's ``step-N`` folders and the ones written after them, numbered on: the order is
    by number (a name sort puts every ``0004-...`` before ``step-...``), the newest one is loaded."""
    old1 = fake_checkpoint(tmp_path, "step-00000001", 1)
    old2 = fake_checkpoint(tmp_path, "step-00000002", 2)
    new3 = fake_checkpoint(tmp_path, "0003-sft-step-000060", 3)
    new10 = fake_checkpoint(tmp_path, "0010-rl-step-000040", 10)
    (tmp_path / ".tmp-0011-rl-step-000050").mkdir()
    (tmp_path / "0012-not-a-folder").write_text("")
    assert ck.checkpoint_dirs(tmp_path) == [old1, old2, new3, new10]
    assert ck.latest_checkpoint(tmp_path) == new10  # no ``latest``: the highest number
    (tmp_path / "latest").write_text("0003-sft-step-000060")
    assert ck.latest_checkpoint(tmp_path) == new3  # ``latest`` names it


def test_an_old_run_folder_resumes_from_its_newest_step_n(tmp_path):
    fake_checkpoint(tmp_path, "step-00000001", 1)
    newest = fake_checkpoint(tmp_path, "step-00000002", 2)
    assert ck.latest_checkpoint(tmp_path) == newest
    assert Checkpointer(tmp_path, None, keep=2).saved_state().step == 2


@pytest.mark.parametrize(
    ("state", "label"),
    [
        (RunState(stage="sft", step=60), "sft-step-000060"),
        (RunState(stage="rl", step=40, finished=["sft"], completed={"sft": 60}), "rl-step-000040"),
        (RunState(stage="sft", step=0, finished=["sft"], completed={"sft": 60}), "sft-step-000060"),
        (RunState(stage="rl", step=0, finished=["sft"], completed={"sft": 60}), "rl-step-000000"),
        (RunState(), "init-step-000000"),
    ],
)
def test_a_saves_label_is_its_stage_and_the_steps_of_it_done(state, label):
    """At the end of a stage ``step`` is back to 0: the label says the steps the stage ran."""
    assert state.checkpoint_label() == label


def test_the_next_save_is_numbered_after_every_checkpoint_of_either_scheme(tmp_path, monkeypatch):
    """A resumed old run (``step-00000002`` was its SFT step 60) writes ``0003-sft-step-000080``."""
    saved = []
    monkeypatch.setattr(
        ck, "save_checkpoint", lambda root, n, model, opt, **kw: saved.append((n, kw["label"])) or Path(root)
    )
    fake_checkpoint(tmp_path, "step-00000001", 1)
    fake_checkpoint(tmp_path, "step-00000002", 2)
    state = RunState(stage="sft", step=80, checkpoint_seq=2)
    Checkpointer(tmp_path, None, keep=2).save(None, state)
    assert saved == [(3, "sft-step-000080")] and state.checkpoint_seq == 3
    assert ck.checkpoint_name(*saved[0]) == "0003-sft-step-000080"


# -- model.hf_path: the architecture comes from config.json ------------------------------------------
HF = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 48,
    "moe_intermediate_size": 24,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "norm_topk_prob": False,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"A config.json whose every architecture field differs from ModelConfig's defaults."


def hf_recipe(tmp_path: Path, model: dict) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(HF))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_path": str(folder), **model}}))
    return path


def test_hf_path_fills_the_architecture_the_recipe_leaves_unset(tmp_path):
    m = load_recipe(hf_recipe(tmp_path, {"max_seq_len": 96})).model
    got = {f: getattr(m, f) for f in ck_fields()}
    assert got == {
        "vocab_size": 128,
        "hidden_size": 48,
        "num_layers": 3,
        "num_attention_heads": 6,
        "num_query_groups": 3,
        "head_dim": 8,
        "moe_ffn_hidden_size": 24,
        "num_experts": 6,
        "moe_router_topk": 3,
        "moe_norm_topk_prob": False,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "tie_embeddings": True,
    }
    assert m.max_seq_len == 96 and m.tokenizer == "char"  # not architecture: the recipe's


def test_hf_path_fields_the_recipe_sets_in_agreement_are_fine(tmp_path):
    """Values compared as the fields hold them: YAML reads ``1e-5`` as a string, ``10000`` as an int."""
    path = hf_recipe(tmp_path, {"num_layers": 3, "norm_eps": "1e-5", "rope_theta": 10000})
    assert load_recipe(path, ["model.num_experts=6"]).model.num_layers == 3


def test_hf_path_a_field_that_disagrees_is_one_line_naming_both_values(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_recipe(hf_recipe(tmp_path, {"num_layers": 4}), ["model.hidden_size=64"])
    msg = str(e.value)
    assert "\n" not in msg
    assert (
        "model.num_layers=4 vs num_hidden_layers=3" in msg and "model.hidden_size=64 vs hidden_size=48" in msg
    )
    assert "remove model.hidden_size, model.num_layers from the recipe" in msg


def test_hf_path_not_readable_here_leaves_the_recipe_as_written(tmp_path):
    """A cluster recipe loaded on another machine: check and train refuse it (tests/badinput)."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": {"hf_path": str(tmp_path / "nowhere"), "num_layers": 2}}))
    assert load_recipe(path).model.num_layers == 2


def ck_fields():
    from moe_rl.hf_arch import ARCH_FIELDS

    return ARCH_FIELDS


def test_the_position_a_resume_names():
    """The resume's log line says where the run stands (issue 49: a run resumed after its finished RL
    stage of 4 steps said "at rl step 0")."""
    assert RunState().position() == "the start (before any stage)"
    assert RunState(stage="sft", step=30).position() == "sft step 30"
    done = RunState(stage="rl", step=0, finished=["sft", "rl"], completed={"sft": 60, "rl": 4})
    assert done.position() == "rl step 4 (the stage finished)"
