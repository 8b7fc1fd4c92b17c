import subprocess
import sys
import typing

import pytest

from moe_rl.config import (
    AlgoConfig,
    ConfigError,
    ModelConfig,
    RolloutConfig,
    SentinelConfig,
    TrainConfig,
    load_recipe,
    recipe_from_dict,
)


def test_overrides_parse_yaml_scalars():
    r = recipe_from_dict(
        {},
        [
            "optim.lr=3e-4",
            "model.qk_norm=false",
            "algo.name=grpo",
            "checkpoint.dir=null",
            "train.stages=[sft]",
        ],
    )
    assert r.optim.lr == 3e-4 and r.model.qk_norm is False and r.algo.name == "grpo"
    assert r.checkpoint.dir is None and r.train.stages == ("sft",)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.bogus=1"], "unknown key(s) model.bogus"),
        (["bogus.x=1"], "unknown key(s) bogus"),
        (["optim.lr=fast"], "optim.lr must be a number"),
        (["model.num_layers=2.5"], "model.num_layers must be an integer"),
        (["model.qk_norm=1"], "model.qk_norm must be true or false"),
        (["model.moe_router_topk=9"], "exceeds model.num_experts"),
        (
            ["parallel.expert_parallel=3", "parallel.data_parallel=3"],
            "not divisible by parallel.expert_parallel",
        ),
        (["parallel.tensor_parallel=3"], "num_attention_heads=4 is not divisible"),
        (["parallel.pipeline_parallel=2"], "pipeline parallelism is not supported"),
        (["parallel.expert_parallel=2"], "must divide tensor_parallel x data_parallel"),
        (["algo.name=ppo"], "algo.name='ppo' is unknown"),
        (["algo.routing=r4"], "algo.routing"),
        (["train.minibatches=3"], "does not divide the rollout batch"),
        (["task.name=chess"], "task.name='chess' is unknown"),
        (["model.vocab_size=105", "parallel.tensor_parallel=2"], "vocab_size=105 is not divisible"),
        (["optim.lr=-1"], "optim.lr must be positive"),
        (["model.dtype=float16"], "model.dtype"),
        (["rollout.embedded_decoder=fast"], "rollout.embedded_decoder='fast': use auto, lean or megatron"),
        (["bad"], "must look like section.field=value"),
    ],
)
def test_bad_values_name_the_field(overrides, needle):
    with pytest.raises(ConfigError) as e:
        recipe_from_dict({}, overrides)
    assert needle in str(e.value)


def test_world_size_mismatch_fails_before_any_group():
    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.parallel import check_world

    check_world(ParallelConfig(tensor_parallel=2), 2)
    with pytest.raises(ConfigError, match="launch 2 processes|data_parallel"):
        check_world(ParallelConfig(tensor_parallel=2), 4)


def test_algo_paper_defaults():
    assert (AlgoConfig(name="grpo").clip_low, AlgoConfig(name="grpo").clip_high) == (0.2, 0.27)
    assert (AlgoConfig(name="gspo").clip_low, AlgoConfig(name="gspo").clip_high) == (3e-4, 4e-4)
    assert AlgoConfig(name="gspo", eps_high=1e-3).clip_high == 1e-3


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(64)  # positional
    m = ModelConfig()
    with pytest.raises(AttributeError):
        m.hidden_size = 3


def test_missing_recipe_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe("/nonexistent/recipe.yaml")


def test_top1_routing_with_renormalisation_is_refused():
    with pytest.raises(ConfigError, match="moe_router_topk=1"):
        recipe_from_dict({}, ["model.moe_router_topk=1"])
    assert recipe_from_dict({}, ["model.moe_router_topk=1", "model.moe_norm_topk_prob=false"])


def test_clip_defaults_come_from_the_loss_registry():
    from moe_rl.losses import LOSSES

    for name, spec in LOSSES.items():
        algo = AlgoConfig(name=name)
        assert (algo.clip_low, algo.clip_high) == (spec.eps_low, spec.eps_high), name
    with pytest.raises(ConfigError, match="algo.name='ppo' is unknown: use one of grpo, gspo, gspo_token"):
        AlgoConfig(name="ppo")


def test_routing_is_parsed_once_into_its_mode_and_written_back_as_text(tmp_path):
    """``algo.routing`` from a recipe, an override, code or ``dataclasses.replace`` is a
    :class:`RoutingMode` member, and the recipe it writes (``recipe.yaml``) holds the text again, so
    a run's saved recipe loads as before."""
    import dataclasses

    import yaml

    from moe_rl.config import to_dict
    from moe_rl.routing import RouterAction, RoutingMode

    r = recipe_from_dict({"algo": {"routing": "r3"}}, ["algo.routing=r2"])
    assert r.algo.routing is RoutingMode.R2 and r.algo.routing.pi_old_action is RouterAction.RECORD
    assert AlgoConfig(routing="r3").routing is RoutingMode.R3
    assert dataclasses.replace(r.algo, routing="none").routing is RoutingMode.NONE
    text = yaml.safe_dump(to_dict(r), sort_keys=False)
    assert "routing: r2\n" in text
    (tmp_path / "recipe.yaml").write_text(text)
    assert load_recipe(tmp_path / "recipe.yaml") == r


@pytest.mark.parametrize(
    "section, kw, needle",
    [
        (
            ModelConfig,
            {"moe_token_dispatcher": "flex"},
            "model.moe_token_dispatcher='flex': use alltoall or allgather",
        ),
        (AlgoConfig, {"routing": "r4"}, "algo.routing='r4': use none, r2 or r3"),
        (AlgoConfig, {"aggregation": "sum"}, "algo.aggregation='sum': use seq_mean or token_mean"),
        (RolloutConfig, {"dtype": "fp8"}, "rollout.dtype='fp8': use auto, fp32, bf16 or fp16"),
        (RolloutConfig, {"router_dtype": "bf16"}, "rollout.router_dtype='bf16': use same or fp32"),
        (TrainConfig, {"stages": ("sft", "ppo")}, "train.stages[1]='ppo': use sft or rl"),
        (
            SentinelConfig,
            {"grad_action": "panic"},
            "sentinel.grad_action='panic': use off, log, stop or rollback",
        ),
    ],
)
def test_choice_fields_are_checked_in_code_and_in_recipes(section, kw, needle):
    with pytest.raises(ConfigError) as e:
        section(**kw)  # constructed in code
    assert needle in str(e.value)
    name = needle.split(".")[0]
    ((k, v),) = kw.items()
    with pytest.raises(ConfigError) as e:
        recipe_from_dict({name: {k: list(v) if isinstance(v, tuple) else v}})  # loaded from a recipe
    assert needle in str(e.value)


def test_choice_literals_match_their_registries():
    from moe_rl.losses.core import AGGREGATIONS
    from moe_rl.rollout import ROLLOUT_ENGINES

    hints = typing.get_type_hints(RolloutConfig)
    assert set(typing.get_args(hints["engine"])) == set(ROLLOUT_ENGINES)
    assert set(typing.get_args(typing.get_type_hints(AlgoConfig)["aggregation"])) == set(AGGREGATIONS)
    from moe_rl.losses.corrections import CORRECTIONS

    assert typing.get_args(typing.get_type_hints(AlgoConfig)["rollout_correction"]) == CORRECTIONS


@pytest.mark.integration
def test_tasks_do_not_import_the_recipe_module():
    code = "import sys, moe_rl.tasks; print('moe_rl.config' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_rollout_precision_fields():
    r = recipe_from_dict({}, ["rollout.dtype=bf16", "rollout.router_dtype=fp32"])
    assert (r.rollout.dtype, r.rollout.router_dtype) == ("bf16", "fp32")
    assert (RolloutConfig().dtype, RolloutConfig().router_dtype) == ("auto", "same")
    assert recipe_from_dict({}).rollout_dtype == "fp32"  # the embedded engine: the policy's own
    assert recipe_from_dict({}, ["rollout.engine=sglang"]).rollout_dtype == "bf16"
    assert recipe_from_dict({}, ["rollout.dtype=fp16"]).rollout.dtype == "fp16"


def test_dual_clip_constant():
    assert AlgoConfig().clip_ratio_c is None
    assert recipe_from_dict({}, ["algo.clip_ratio_c=3.0"]).algo.clip_ratio_c == 3.0
    for c in (1.0, 0.5, -2.0):
        with pytest.raises(ConfigError, match=r"algo\.clip_ratio_c=.* must be > 1.*algo\.clip_ratio_c=null"):
            recipe_from_dict({}, [f"algo.clip_ratio_c={c}"])


@pytest.mark.parametrize(
    "name, corr",
    [
        ("grpo", "tis"),
        ("grpo", "seq_tis"),
        ("grpo", "icepop"),
        ("grpo", "icepop_mask"),
        ("grpo", "geo_mask"),
        ("gspo", "seq_tis"),
        ("gspo", "geo_mask"),
        ("gspo_token", "tis"),
        ("gspo_token", "icepop"),
        ("gspo_token", "icepop_mask"),
    ],
)
def test_rollout_correction_accepted(name, corr):
    algo = recipe_from_dict({}, [f"algo.name={name}", f"algo.rollout_correction={corr}"]).algo
    assert (algo.name, algo.rollout_correction, algo.old_logprobs) == (name, corr, "recompute")


@pytest.mark.parametrize("corr", ["tis", "seq_tis", "icepop", "icepop_mask", "geo_mask"])
def test_rollout_correction_refused_in_bypass_mode(corr):
    msg = "bypass mode: pi_old is the rollout policy, rho = 1; set algo.old_logprobs=recompute or algo.rollout_correction=none"
    with pytest.raises(ConfigError) as e:
        recipe_from_dict(
            {}, ["algo.name=grpo", "algo.old_logprobs=rollout", f"algo.rollout_correction={corr}"]
        )
    assert msg in str(e.value) and f"algo.rollout_correction={corr}" in str(e.value)
    assert recipe_from_dict({}, ["algo.old_logprobs=rollout"]).algo.rollout_correction == "none"


@pytest.mark.parametrize("corr", ["tis", "icepop", "icepop_mask"])
def test_token_level_correction_refused_for_gspo(corr):
    with pytest.raises(ConfigError) as e:
        recipe_from_dict({}, ["algo.name=gspo", f"algo.rollout_correction={corr}"])
    assert "use algo.name=gspo_token, or algo.rollout_correction=seq_tis or geo_mask" in str(e.value)
    with pytest.raises(
        ConfigError,
        match="algo.rollout_correction='bogus': use none, tis, seq_tis, icepop, icepop_mask or geo_mask",
    ):
        recipe_from_dict({}, ["algo.rollout_correction=bogus"])


def test_correction_truncation_and_bounds():
    assert AlgoConfig().correction_c == 2.0
    assert AlgoConfig(correction_c=1.0).correction_c == 1.0
    for c in (0.5, 0.0, -1.0):
        with pytest.raises(ConfigError, match=r"algo\.correction_c=.* must be >= 1"):
            AlgoConfig(correction_c=c)
    assert AlgoConfig(name="grpo", rollout_correction="icepop").correction_bounds == (0.5, 5.0)
    assert AlgoConfig(name="grpo", rollout_correction="icepop_mask").correction_bounds == (0.5, 5.0)
    assert AlgoConfig(rollout_correction="geo_mask").correction_bounds == (1 / 1.001, 1.001)
    icepop = AlgoConfig(name="grpo", rollout_correction="icepop", correction_low=0.25, correction_high=8.0)
    assert icepop.correction_bounds == (0.25, 8.0)
    assert AlgoConfig(rollout_correction="geo_mask", correction_high=1.01).correction_bounds == (
        1 / 1.001,
        1.01,
    )
    bad = [
        {"correction_low": 2.0, "correction_high": 1.5},
        {"correction_low": 1.0, "correction_high": 1.0},
        {"correction_low": 0.0},
        {"correction_low": -0.5},
        {"correction_high": -1.0},
        {"correction_low": 6.0},  # above icepop's default high
    ]
    for kw in bad:
        for corr in ("icepop", "icepop_mask"):
            with pytest.raises(
                ConfigError, match=r"algo\.correction_low=.* and algo\.correction_high=.* 0 < low < high"
            ):
                AlgoConfig(name="grpo", rollout_correction=corr, **kw)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: ModelConfig(rope_theta=float("inf")), r"model\.rope_theta=inf is not a finite number"),
        (lambda: AlgoConfig(correction_low=float("nan")), r"algo\.correction_low=nan is not a finite number"),
        (lambda: TrainConfig(sft_lr=float("-inf")), r"train\.sft_lr=-inf is not a finite number"),
        (lambda: TrainConfig(top_p=0.0), r"train\.top_p=0\.0 must be in \(0, 1\]"),
        (lambda: TrainConfig(stages=()), r"train\.stages is empty"),
        (lambda: TrainConfig(stages=("rl", "sft")), r"each once, sft first"),
        (lambda: TrainConfig(out_dir=""), r"train\.out_dir is empty"),
        (lambda: AlgoConfig(adv_eps=0.0), r"algo\.adv_eps=0\.0 must be > 0"),
        (lambda: SentinelConfig(min_entropy=-1.0), r"sentinel\.min_entropy=-1\.0 must be >= 0"),
        (lambda: RolloutConfig(timeout_s=-1.0), r"rollout\.timeout_s=-1\.0 must be > 0"),
    ],
)
def test_fields_checked_in_code_too(make, pattern):
    """Sections built in code (benchmarks, tests) get the same checks as a loaded recipe."""
    with pytest.raises(ConfigError, match=pattern):
        make()


def test_adv_eps_zero_allowed_without_std_normalisation():
    assert AlgoConfig(adv_eps=0.0, adv_std_normalize=False).adv_eps == 0.0
    assert TrainConfig(top_p=1.0, stages=("rl",)).top_p == 1.0


def test_repeated_keys_refused_in_includes_too(tmp_path):
    (tmp_path / "base.yaml").write_text("optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    (tmp_path / "top.yaml").write_text("include: base.yaml\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"base\.yaml:3: key 'lr' repeated \(first at line 2\)"):
        load_recipe(tmp_path / "top.yaml")


def test_yaml_merge_keys_may_be_overridden(tmp_path):
    """``<<: *anchor`` then a key of the anchor is YAML's override, not a repeated key."""
    (tmp_path / "r.yaml").write_text(
        "optim: &o\n  lr: 1.0e-3\n  warmup_steps: 2\nsft_optim_note: {<<: *o, lr: 2.0e-3}\n"
    )
    from moe_rl.configlib import load_yaml_file

    assert load_yaml_file(tmp_path / "r.yaml")["sft_optim_note"] == {"lr": 2.0e-3, "warmup_steps": 2}


def test_a_saved_recipe_with_the_old_kl_key_at_zero_still_loads():
    """Every recipe.yaml written before algo.kl_coef holds ``algo.beta: 0.0``: such a run's folder
    stays its own (the lab compares saved recipes to resume a run); a nonzero beta says the new key."""
    from moe_rl.config import ConfigError, recipe_from_dict

    assert recipe_from_dict({"algo": {"beta": 0.0}}).algo.kl_coef == 0.0
    with pytest.raises(ConfigError, match=r"algo\.beta moved: use algo\.kl_coef"):
        recipe_from_dict({"algo": {"beta": 0.1}})
