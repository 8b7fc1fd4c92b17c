"""Bad recipes and overrides: each is refused at load with one line naming the field and the fix.

Most cases run ``moe-rl check`` in this process (milliseconds); the ``train`` cases show the
refusal comes before anything is written (no run folder, no process group). Every case checks
that the user's files (the recipe, an existing run folder) are unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.badinput.conftest import assert_kept, snapshot

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml"

recipe_case = pytest.mark.bad_input("recipe")
override_case = pytest.mark.bad_input("override")


def _write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(f"include: {RECIPE}\n{text}")
    return p


# One field with a value that is not a value: (YAML under the tiny recipe, the line's pattern).
FIELD_CASES = {
    "inf_lr": ("optim:\n  lr: .inf\n", r"configuration error: optim\.lr=inf is not a finite number"),
    "nan_temperature": ("train:\n  temperature: .nan\n", r"train\.temperature=nan is not a finite"),
    "inf_beta1": ("optim:\n  beta1: -.inf\n", r"optim\.beta1=-inf is not a finite"),
    "beta2_one": ("optim:\n  beta2: 1.0\n", r"optim\.beta2=1\.0 must be in \[0, 1\)"),
    "negative_adv_eps": ("algo:\n  adv_eps: -1.0e-6\n", r"algo\.adv_eps=-1e-06 must be > 0.*flips"),
    "top_p_above_one": ("train:\n  top_p: 1.5\n", r"train\.top_p=1\.5 must be in \(0, 1\]"),
    "zero_temperature": ("train:\n  temperature: 0\n", r"train\.temperature must be > 0, got 0"),
    "zero_lr": ("optim:\n  lr: 0\n", r"optim\.lr must be positive, got 0"),
    "negative_eps_low": ("algo:\n  eps_low: -0.1\n", r"algo\.eps_low=-0\.1 must be in \[0, 1\)"),
    "negative_eps_high": ("algo:\n  eps_high: -0.1\n", r"algo\.eps_high=-0\.1 must be >= 0"),
    "negative_timeout": ("rollout:\n  timeout_s: -5\n", r"rollout\.timeout_s=-5\.0 must be > 0"),
    "zero_parallel_timeout": ("parallel:\n  timeout_s: 0\n", r"parallel\.timeout_s=0\.0 must be > 0"),
    "inf_sentinel": ("sentinel:\n  max_grad_norm: .inf\n", r"sentinel\.max_grad_norm=inf is not a finite"),
    "bad_port": (
        "rollout:\n  sglang:\n    port: 70000\n",
        r"rollout\.sglang\.port=70000 must be in 0\.\.65535",
    ),
    "empty_stages": ("train:\n  stages: []\n", r"train\.stages is empty: list the stages"),
    "stages_twice": ("train:\n  stages: [rl, sft, rl]\n", r"train\.stages=.*each once, sft first"),
    "unknown_logger": (
        "train:\n  loggers: [jsonl, neptune]\n",
        r"train\.loggers\[1\]='neptune' is unknown: use jsonl, tensorboard, wandb, mlflow",
    ),
    "loggers_without_jsonl": ("train:\n  loggers: [wandb]\n", r"train\.loggers=\['wandb'\] leaves out jsonl"),
    "empty_out_dir": ("train:\n  out_dir: ''\n", r"train\.out_dir is empty .*current folder"),
    "negative_weight_decay": ("optim:\n  weight_decay: -0.1\n", r"optim\.weight_decay=-0\.1 must be >= 0"),
    "zero_adam_eps": ("optim:\n  adam_eps: 0\n", r"optim\.adam_eps=0\.0 must be > 0"),
    "no_engines": (
        "rollout:\n  engine: sglang\n  sglang:\n    engines: []\n",
        r"rollout\.sglang\.engines=\[\]: give a count >= 1 or a non-empty list",
    ),
    "empty_url": ("rollout:\n  sglang:\n    url: ''\n", r"rollout\.sglang\.url is empty: give one or null"),
    "empty_checkpoint_dir": (
        "checkpoint:\n  dir: ''\n",
        r"checkpoint\.dir is empty: give a directory or null",
    ),
    # against the tokenizer (moe_rl/preflight.py): the char tokenizer has 104 ids
    "vocab_smaller_than_the_tokenizer": (
        "model:\n  vocab_size: 64\n",
        r"model\.vocab_size=64 is smaller than the tokenizer's 104 ids: set model\.vocab_size=104",
    ),
    # known before SFT (they used to fail when the RL stage began)
    "tp2_embedded_rl": (
        "parallel:\n  tensor_parallel: 2\n  data_parallel: 1\ntrain:\n  stages: [sft, rl]\n",
        r"parallel\.tensor_parallel=2 with rollout\.engine=embedded: the embedded engine decodes at TP 1 only",
    ),
    # issue 49: the trainer builds the reference now; the coefficient's old name says its new one
    "kl_coefficient_moved": (
        "algo:\n  beta: 0.1\ntrain:\n  stages: [sft, rl]\n",
        r"algo\.beta moved: use algo\.kl_coef",
    ),
    "kl_coef_negative": ("algo:\n  kl_coef: -0.1\n", r"algo\.kl_coef=-0\.1 must be >= 0"),
    "kl_estimator_unknown": ("algo:\n  kl_estimator: k4\n", r"algo\.kl_estimator='k4': use k1, k2 or k3"),
    "jsonl_sft_without_responses": (
        "task:\n  name: jsonl\n  jsonl: {path: data.jsonl, reward_fn: 'score.py:score'}\ntrain:\n  stages: [sft, rl]\n",
        r"train\.stages includes sft but the jsonl task has no demonstrations: set task\.jsonl\.response_field",
    ),
}


@recipe_case
@pytest.mark.parametrize("name", sorted(FIELD_CASES))
def test_field_refused_at_load(cli, tmp_path, name):
    text, pattern = FIELD_CASES[name]
    recipe = _write(tmp_path, text)
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(pattern)
    assert_kept(before, tmp_path)


@recipe_case
@pytest.mark.parametrize(("logger", "package"), [("wandb", "wandb"), ("mlflow", "mlflow-skinny")])
def test_logger_whose_package_is_missing(cli, tmp_path, monkeypatch, logger, package):
    """A tracker named in train.loggers whose package is not installed is refused at load (not at
    the first metric, after the model is built), naming the field and the pip package."""
    monkeypatch.setitem(sys.modules, logger, None)  # as if not installed: import and find_spec fail
    recipe = _write(tmp_path, f"train:\n  loggers: [jsonl, {logger}]\n")
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(
        rf"configuration error: train\.loggers names {logger}, whose package is not installed: "
        rf"pip install {package} \(or pip install 'moe-rl\[track\]'\), or take {logger} out of train\.loggers"
    )
    assert_kept(before, tmp_path)


@override_case
def test_logger_whose_package_is_missing_by_override(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cli("check", RECIPE, "train.loggers=[jsonl,tensorboard,wandb]").one_line(
        r"train\.loggers names wandb, whose package is not installed: pip install wandb"
    )


@recipe_case
def test_empty_recipe_file(cli, tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    before = snapshot(tmp_path)
    cli("check", tmp_path / "empty.yaml").one_line(
        r"recipe .*empty\.yaml is empty: write at least one section"
    )
    assert_kept(before, tmp_path)


@recipe_case
def test_repeated_key_names_both_lines(cli, tmp_path):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(f"include: {RECIPE}\noptim:\n  lr: 1.0e-3\n  warmup_steps: 2\n  lr: 3.0e-3\n")
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(r"dup\.yaml:5: key 'lr' repeated \(first at line 3\): keep one")
    assert_kept(before, tmp_path)


@recipe_case
def test_repeated_section(cli, tmp_path):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text("train:\n  seed: 1\noptim:\n  lr: 1.0e-3\ntrain:\n  seed: 2\n")
    cli("check", recipe).one_line(r"dup\.yaml:5: key 'train' repeated \(first at line 1\)")


@recipe_case
def test_folder_as_recipe(cli, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    cli("check", tmp_path / "run").one_line(r"recipe .*run is a folder: give the YAML file inside it")
    assert_kept(before, tmp_path)


@recipe_case
def test_yaml_syntax_error_has_file_line_column(cli, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("optim:\n  lr: 1.0e-3\ntrain: [sft\n")
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(r"bad\.yaml:\d+:\d+: YAML syntax error")
    assert_kept(before, tmp_path)


@recipe_case
def test_missing_recipe(cli, tmp_path):
    cli("check", tmp_path / "nope.yaml").one_line(r"recipe .*nope\.yaml does not exist")


@recipe_case
def test_missing_include(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("include: base_gone.yaml\ntrain:\n  seed: 3\n")
    cli("check", recipe).one_line(r"base_gone\.yaml does not exist")


@recipe_case
def test_non_utf8_recipe(cli, tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(b"train:\n  out_dir: runs/caf\xe9\n")
    before = snapshot(tmp_path)
    cli("check", recipe).one_line(r"latin1\.yaml:2: recipe is not UTF-8 text")
    assert_kept(before, tmp_path)


@recipe_case
def test_prompt_and_response_longer_than_the_model(cli, tmp_path):
    recipe = _write(tmp_path, "train:\n  stages: [sft, rl]\n  max_new_tokens: 250\n")
    cli("check", recipe).one_line(
        r"longest prompt \(\d+ tokens\) \+ train\.max_new_tokens=250 exceeds model\.max_seq_len=256: "
        r"lower train\.max_new_tokens to \d+"
    )


@recipe_case
def test_fewer_eval_prompts_than_data_parallel_ranks(cli, tmp_path):
    recipe = _write(
        tmp_path, "train:\n  stages: [sft, rl]\n  eval_prompts: 1\nparallel:\n  data_parallel: 2\n"
    )
    cli("check", recipe).one_line(
        r"1 held-out prompts for evaluation, fewer than parallel\.data_parallel=2 .*raise train\.eval_prompts"
    )


@recipe_case
def test_tokenizer_folder_without_tokenizer_json(cli, tmp_path):
    (tmp_path / "tok").mkdir()
    recipe = _write(tmp_path, f"model:\n  tokenizer: {tmp_path / 'tok'}\n")
    cli("check", recipe).one_line(r"model\.tokenizer=.*tok.*has no tokenizer\.json")


@recipe_case
def test_r3_against_a_server_without_routes(cli, tmp_path):
    from moe_rl.serve.http import ServerThread
    from tests.unit.test_sglang_contract import _EchoEngine

    server = ServerThread(_EchoEngine(), weight_version="v0", enable_return_routed_experts=False)
    try:
        recipe = _write(
            tmp_path,
            f"rollout:\n  engine: sglang\n  sglang:\n    url: {server.url}\n"
            "algo:\n  routing: r3\ntrain:\n  stages: [sft, rl]\n",
        )
        cli("check", recipe).one_line(
            r"algo\.routing=r3 .*without --enable-return-routed-experts: restart it with that flag"
        )
    finally:
        server.stop()


@recipe_case
def test_train_refuses_before_writing_anything(cli, tmp_path):
    """A bad field stops ``train`` before the run folder exists (no SFT, no process group)."""
    out = tmp_path / "run"
    recipe = _write(tmp_path, f"train:\n  out_dir: {out}\noptim:\n  lr: .nan\n")
    cli("train", recipe).one_line(r"optim\.lr=nan is not a finite number")
    assert not out.exists()


@recipe_case
def test_train_keeps_an_existing_run_folder(cli, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"stage": "sft", "step": 0}\n')
    (out / "checkpoints" / "latest").write_text("step_1\n")
    recipe = _write(tmp_path, f"train:\n  out_dir: {out}\n  stages: []\n")
    before = snapshot(tmp_path)
    cli("train", recipe).one_line(r"train\.stages is empty")
    assert_kept(before, tmp_path)


@recipe_case
def test_verbose_shows_the_traceback_and_the_line(cli, tmp_path):
    recipe = _write(tmp_path, "optim:\n  lr: .inf\n")
    r = cli("-v", "check", recipe)
    assert r.code == 2 and "Traceback" in r.err and "ConfigError" in r.err
    assert r.err.strip().splitlines()[-1].startswith("moe-rl: configuration error: optim.lr=inf")


# Overrides on the command line.
OVERRIDE_CASES = {
    "inf": ("optim.lr=inf", r"optim\.lr=inf is not a finite number"),
    "yaml_inf": ("train.temperature=.inf", r"train\.temperature=inf is not a finite number"),
    "nan_beta": ("optim.beta1=nan", r"optim\.beta1=nan is not a finite number"),
    "broken_yaml": ("optim.lr=[", r"override 'optim\.lr=\[': .*quote the value"),
    "no_equals": ("optim.lr", r"override 'optim\.lr' must look like section\.field=value"),
    "empty_key": ("=3", r"override '=3' has an empty key"),
    "unknown_key": ("train.bogus=1", r"unknown key\(s\) train\.bogus"),
    "empty_stages": ("train.stages=[]", r"train\.stages is empty"),
    "unknown_loss": ("algo.name=ppo", r"algo\.name='ppo' is unknown: use one of grpo, gspo, gspo_token"),
    "zero_top_p": ("train.top_p=0", r"train\.top_p=0\.0 must be in \(0, 1\]"),
    "blank_out_dir": ("train.out_dir=' '", r"train\.out_dir is empty"),
    "section_as_value": ("optim=3", r"optim must be a mapping of fields"),
    "repeated_key": ("optim={lr: 1, lr: 2}", r"override 'optim=\{lr: 1, lr: 2\}', line:1: key 'lr' repeated"),
    "text_for_number": ("optim.lr=fast", r"optim\.lr must be a number, got 'fast'"),
}


@override_case
@pytest.mark.parametrize("name", sorted(OVERRIDE_CASES))
def test_override_refused(cli, tmp_path, name):
    override, pattern = OVERRIDE_CASES[name]
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(RECIPE.read_bytes())
    before = snapshot(tmp_path)
    cli("check", recipe, override).one_line(pattern)
    assert_kept(before, tmp_path)


def test_replay_gate_weights_is_refused_without_r3_or_with_an_engine_that_returns_no_gates():
    """The engine's gates are replayed with its routes (R3 only), and only the embedded engine returns
    them (``Rollouts.gates_BTLK``): other settings are refused at load, naming the field and the fix."""
    from moe_rl.config import ConfigError, recipe_from_dict

    for routing in ("none", "r2"):
        with pytest.raises(
            ConfigError, match=rf"replay_gate_weights=true .*algo.routing={routing}.*routing=r3"
        ):
            recipe_from_dict({}, ["algo.replay_gate_weights=true", f"algo.routing={routing}"])
    with pytest.raises(ConfigError, match=r"gates_BTLK.*SGLang.*rollout.engine=embedded or set algo.replay"):
        recipe_from_dict({}, ["algo.replay_gate_weights=true", "algo.routing=r3", "rollout.engine=sglang"])
    algo = recipe_from_dict({}, ["algo.replay_gate_weights=true", "algo.routing=r3"]).algo
    assert algo.replay_gate_weights and algo.routing == "r3"
