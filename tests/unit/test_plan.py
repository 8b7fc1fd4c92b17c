"""moe_rl.plan: parameter counts against a built policy and published figures; memory; refusals."""

from pathlib import Path

import pytest

from moe_rl.config import ConfigError, ParallelConfig, load_recipe, recipe_from_dict, to_dict
from moe_rl.plan import PlanError, format_plan, main, param_counts, plan
from moe_rl.routing.codec import route_bytes_per_token

ROOT = Path(__file__).parents[2]
CLUSTER = sorted((ROOT / "recipes" / "cluster").glob("*.yaml"))
GSPO_30B = ROOT / "recipes" / "cluster" / "qwen3_30b_a3b_gspo.yaml"

QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    num_layers=48,
    num_attention_heads=32,
    num_query_groups=4,
    head_dim=128,
    moe_ffn_hidden_size=768,
    num_experts=128,
    moe_router_topk=8,
    tie_embeddings=False,
    qk_norm=True,
    max_seq_len=1024,
)


def component(name: str) -> str:
    """Which plan component a megatron-core parameter name belongs to."""
    if "word_embeddings" in name:
        return "embedding"
    if name.startswith("output_layer"):
        return "output"
    if "layernorm" in name:
        return "norms"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.experts." in name:
        return "experts"
    assert ".self_attention.linear_" in name, name
    return "attention"


@pytest.mark.parametrize(
    "variant", [{}, {"tie_embeddings": True, "qk_norm": False}], ids=["untied_qknorm", "tied_no_qknorm"]
)
def test_counts_equal_the_built_policy(parallel_info, tiny_model_cfg, variant):
    from dataclasses import replace

    from moe_rl.megatron.policy import build_policy

    cfg = replace(tiny_model_cfg, **variant)
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    measured = dict.fromkeys(("embedding", "output", "attention", "router", "experts", "norms"), 0)
    for name, p in policy.model.named_parameters():
        measured[component(name)] += p.numel()
    counts = param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in policy.parameters())
    assert {k: counts[k] for k in measured} == measured


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_memory_equals_the_measured_parameter_bytes(parallel_info, tiny_model_cfg, dtype):
    from dataclasses import replace

    from moe_rl.megatron.policy import build_policy

    cfg = replace(tiny_model_cfg, dtype=dtype)
    policy = build_policy(cfg, ParallelConfig(), parallel_info)
    measured = sum(p.numel() * p.element_size() for p in policy.parameters())
    pl = plan(recipe_from_dict({"model": to_dict(cfg)}))
    assert pl["memory"]["terms"]["weights"] == measured
    assert pl["memory"]["params_per_gpu"]["total"] == sum(p.numel() for p in policy.parameters())
    per_param = 4 + (12 if dtype == "bfloat16" else 8)  # fp32 grads + Adam (+ fp32 master in bf16)
    assert pl["memory"]["terms"]["gradients"] + pl["memory"]["terms"]["optimizer"] == per_param * sum(
        p.numel() for p in policy.parameters()
    )


def test_qwen3_30b_a3b_matches_the_published_sizes():
    # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated, 29.9B non-embedding
    cfg = recipe_from_dict({"model": QWEN3_30B_A3B}).model
    pl = plan(recipe_from_dict({"model": QWEN3_30B_A3B}), allow_unfit=True)
    total, active = pl["params"]["total"], pl["params"]["active"]
    assert round(total / 1e9, 1) == 30.5
    assert 3.3e9 <= active < 3.4e9
    c = param_counts(cfg)
    assert round((total - c["embedding"] - c["output"]) / 1e9, 1) == 29.9
    assert c["experts"] / total > 0.94  # why EP, not TP, decides whether it fits


def test_sharding_and_expert_dp_follow_the_layout():
    r = recipe_from_dict(
        {"model": QWEN3_30B_A3B, "parallel": {"tensor_parallel": 2, "expert_parallel": 4, "data_parallel": 4}}
    )
    pl = plan(r, allow_unfit=True)
    assert pl["layout"] == {"world": 8, "tp": 2, "pp": 1, "dp": 4, "ep": 4, "expert_tp": 1, "expert_dp": 2}
    full, shard = pl["params"], pl["memory"]["params_per_gpu"]
    assert shard["experts"] * 4 == full["experts"]
    assert shard["attention"] * 2 == full["attention"] and shard["embedding"] * 2 == full["embedding"]
    assert shard["router"] == full["router"] and shard["norms"] == full["norms"]


def test_per_step_bytes():
    r = load_recipe(GSPO_30B)
    pl = plan(r)
    tokens = r.train.prompts_per_step * r.train.group_size * r.model.max_seq_len
    assert (
        pl["routing_replay_bytes_per_step"]
        == tokens * 48 * 8 * 1
        == tokens * route_bytes_per_token(48, 8, 128)
    )
    assert pl["weight_sync_bytes_per_update"] == 2 * pl["params"]["total"]


def test_refuses_a_layout_that_cannot_fit():
    # Qwen3-30B-A3B at TP=2 EP=8 on 16 GPUs without the distributed optimizer: 4.4B parameters
    # per GPU, 18 bytes each in bf16 (with it the experts' state halves over expert-DP 2: fits)
    unsharded = ["parallel.expert_parallel=8", "optim.distributed=false"]
    assert plan(load_recipe(GSPO_30B, ["parallel.expert_parallel=8"]))["fits"]
    with pytest.raises(PlanError) as e:
        plan(load_recipe(GSPO_30B, unsharded))
    msg = str(e.value)
    assert "optimizer" in msg and "largest term" in msg
    assert "raise parallel.expert_parallel to 16" in msg and "tensor_parallel" in msg
    assert isinstance(e.value, ConfigError)
    pl = plan(load_recipe(GSPO_30B, unsharded), allow_unfit=True)
    assert not pl["fits"] and pl["memory"]["total"] > 0.9 * 80 * 2**30
    assert "DOES NOT FIT" in format_plan(pl)


def test_refusal_names_activations_when_rollouts_are_too_many():
    with pytest.raises(PlanError, match=r"activations .* pi_old forward .*train.prompts_per_step"):
        plan(load_recipe(GSPO_30B, ["train.prompts_per_step=64"]))
    # the same batch fits once each forward holds 2 sequences (a micro-batching trainer)
    assert plan(load_recipe(GSPO_30B, ["train.prompts_per_step=64"]), micro_batch=2)["fits"]


def test_num_gpus_rederives_data_parallel():
    pl = plan(load_recipe(GSPO_30B), num_gpus=32)
    assert (pl["layout"]["dp"], pl["layout"]["world"], pl["layout"]["expert_dp"]) == (16, 32, 2)
    with pytest.raises(ConfigError, match="multiple of tensor_parallel"):
        plan(load_recipe(GSPO_30B), num_gpus=15)


@pytest.mark.parametrize("path", CLUSTER, ids=lambda p: p.name)
def test_cluster_recipes_fit_on_80gb(path):
    pl = plan(load_recipe(path), gpu_mem_gib=80)
    assert pl["fits"]


def test_main_prints_the_plan_and_exits_nonzero_when_it_cannot_fit(capsys):
    assert main([str(GSPO_30B)]) == 0
    out = capsys.readouterr().out
    assert "EP 16" in out and "expert-DP 1" in out and "30.53B total" in out and "fits" in out
    assert main([str(GSPO_30B), "parallel.expert_parallel=8", "optim.distributed=false"]) == 1
    assert "raise parallel.expert_parallel" in capsys.readouterr().err
    assert main([str(GSPO_30B), "parallel.expert_parallel=7"]) == 2


def test_distributed_optimizer_shards_dense_state_over_dp_and_experts_over_expert_dp():
    # TP=2 EP=4 DP=4: dense state over DP 4, experts' over expert-DP 2 (12 bytes each in bf16)
    over = {
        "model": QWEN3_30B_A3B,
        "parallel": {"tensor_parallel": 2, "expert_parallel": 4, "data_parallel": 4},
    }
    pl = plan(recipe_from_dict(over), allow_unfit=True)
    shard, mem = pl["memory"]["params_per_gpu"], pl["memory"]
    dense = shard["total"] - shard["experts"]
    assert mem["optimizer_sharding"] == {"distributed": True, "dense_over": 4, "experts_over": 2}
    assert mem["terms"]["optimizer"] == int(dense * 8 / 4 + shard["experts"] * 8 / 2)  # fp32 model
    plain = plan(recipe_from_dict({**over, "optim": {"distributed": False}}), allow_unfit=True)["memory"]
    assert plain["terms"]["optimizer"] == 8 * shard["total"]  # every rank keeps all of its state
    assert plain["terms"]["gradients"] == mem["terms"]["gradients"] == 4 * shard["total"]  # never sharded
    bf16 = recipe_from_dict(
        {
            "model": {**QWEN3_30B_A3B, "dtype": "bfloat16"},
            "parallel": over["parallel"],
            "optim": {"grad_reduce_in_fp32": False},
        }
    )
    terms = plan(bf16, allow_unfit=True)["memory"]["terms"]
    assert terms["optimizer"] == int(dense * 12 / 4 + shard["experts"] * 12 / 2)  # + fp32 main weights
    assert terms["gradients"] == 2 * shard["total"]  # bf16 grad buffer


def test_qwen3_30b_a3b_on_one_node_needs_micro_batches():
    # 8 x 80 GB: EP=8 leaves 3.6B expert parameters per GPU whose state expert-DP 1 cannot shard
    one_node = ["parallel.tensor_parallel=2", "parallel.expert_parallel=8", "parallel.data_parallel=4"]
    assert not plan(load_recipe(GSPO_30B, one_node), allow_unfit=True)["fits"]
    pl = plan(load_recipe(GSPO_30B, [*one_node, "train.micro_batch_size=1"]))  # read from the recipe
    assert pl["fits"] and pl["memory"]["sequences_per_forward"] == 1
    assert pl["memory"]["optimizer_sharding"]["experts_over"] == 1


def test_colocated_engines_add_up_with_the_trainer_per_phase():
    """SGLang on the trainer's GPUs reserves mem_fraction of each while it generates: the plan adds
    engine and trainer per phase, fits the 30B recipe with the trainer offloaded, and refuses it
    without, naming the settings that make it fit."""
    root = Path(__file__).resolve().parents[2]
    colocated = ["rollout.engine=sglang", "rollout.sglang.colocate=true", "rollout.weight_sync=tensor"]
    fits = plan(load_recipe(root / "recipes/cluster/qwen3_30b_a3b_gspo.yaml", colocated))
    co, terms = fits["colocated"], fits["memory"]["terms"]
    gib = 1024**3
    assert fits["fits"] and co["train"] == fits["memory"]["total"]
    assert co["rollout"] == int(0.8 * 80 * gib)  # the trainer's state is on the host
    assert "colocated   SGLang on these GPUs" in format_plan(fits)
    recipe = load_recipe(
        root / "recipes/cluster/qwen3_30b_a3b_gspo.yaml", [*colocated, "rollout.sglang.offload_trainer=false"]
    )
    with pytest.raises(
        PlanError, match=r"rollout phase.*mem_fraction to 0\.\d\d or less.*offload_trainer=true"
    ):
        plan(recipe)
    unfit = plan(recipe, allow_unfit=True)
    resident = terms["weights"] + terms["gradients"] + terms["optimizer"]
    assert unfit["colocated"]["rollout"] == int(0.8 * 80 * gib + resident) and not unfit["fits"]
    assert plan(load_recipe(root / "recipes/cluster/qwen3_30b_a3b_gspo.yaml"))["colocated"] is None


ONE_NODE = [  # the 30B recipe colocated on one node of 8 x H100 (the recipe's own one-node layout)
    "rollout.engine=sglang",
    "rollout.sglang.colocate=true",
    "rollout.weight_sync=tensor",
    "parallel.tensor_parallel=2",
    "parallel.expert_parallel=8",
    "parallel.data_parallel=4",
    "train.micro_batch_size=1",
]


def test_colocated_plan_models_every_phase_and_the_hosts_memory():
    """Issue 45: each phase and transition as moe_rl.trainer.colocate runs them, the KV cache, and
    the host memory of a node (each rank's pinned arena and the engines' weight backup)."""
    root = Path(__file__).resolve().parents[2]
    pl = plan(load_recipe(root / "recipes/cluster/qwen3_30b_a3b_gspo.yaml", ONE_NODE))
    co, d, host, t = pl["colocated"], pl["colocated_detail"], pl["host"], pl["memory"]["terms"]
    gib = 1024**3
    assert list(co) == ["launch", "rollout", "rollout>train", "train", "train>push", "push", "push>train"]
    engine = int(2 * pl["params"]["total"] / 8)  # bf16, engine tp 8
    assert d["engine_weights"] == engine and d["kv_cache"] == int(0.8 * 80 * gib) - engine
    assert co["push"] == t["weights"] + engine + d["push_buffers"]  # no KV cache, no trainer state
    state = t["weights"] + t["gradients"] + t["optimizer"]
    assert co["rollout>train"] == co["push>train"] == state  # the larger side of each transition
    assert host == {
        "ranks": 8,
        "trainer_per_rank": t["weights"] + t["optimizer"],
        "engine_backup": 8 * engine,
        "total": 8 * (t["weights"] + t["optimizer"]) + 8 * engine,
    }
    text = format_plan(pl)
    assert "push>train" in text and "host/node   8 ranks x 50.9 GiB pinned" in text and pl["fits"]


@pytest.mark.parametrize(
    ("over", "kw", "refusal"),
    [
        (["train.micro_batch_size=0"], {}, r"needs 1\d\d\.\d GiB per GPU.*activations"),
        (["rollout.sglang.offload_trainer=false"], {}, r"the rollout phase needs .*offload_trainer=true"),
        (
            ["rollout.sglang.tp=1", "rollout.dtype=fp32"],
            {},
            r"the push phase needs 12\d\.\d GiB.*buffers\): raise rollout.sglang.tp",
        ),
        (
            ["rollout.sglang.mem_fraction=0.05"],
            {},
            r"holds no KV cache.*raise rollout.sglang.mem_fraction to 0\.1\d",
        ),
        (
            [],
            {"host_mem_gib": 256},
            r"host memory per node: 8 trainer ranks x 50.9 GiB.*--host-mem-gib.*expert_parallel",
        ),
    ],
    ids=["train", "rollout", "push", "kv_cache", "host"],
)
def test_colocated_plan_refuses_each_phase_naming_the_knob(over, kw, refusal):
    root = Path(__file__).resolve().parents[2]
    recipe = load_recipe(root / "recipes/cluster/qwen3_30b_a3b_gspo.yaml", ONE_NODE + over)
    with pytest.raises(PlanError, match=refusal):
        plan(recipe, **kw)
    assert not plan(recipe, allow_unfit=True, **kw)["fits"]
