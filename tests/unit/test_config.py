from pathlib import Path

import pytest

from moe_rl.config import AlgoConfig, ConfigError, ModelConfig, load_recipe, recipe_from_dict

RECIPES = sorted(Path(__file__).parents[2].joinpath("recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert len(RECIPES) >= 3


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    r = load_recipe(path)
    assert r.model.vocab_size % r.parallel.tensor_parallel == 0


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
