"""The tiny policy the in-process tests share, built in code (never downloaded).

Hidden 64, 2 layers, 4 heads in 2 query groups, 4 experts top-2, vocab 64, 64 positions: small
enough that a forward, a backward and a generate call take milliseconds on one CPU thread.
"""

from __future__ import annotations

from typing import Any

from moe_rl.lab.arms import flatten
from moe_rl.lab.starts import SMOKE_BASE

TINY_MODEL: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    moe_ffn_hidden_size=64,
    num_experts=4,
    moe_router_topk=2,
    max_seq_len=64,
)


def tiny_model_config(**overrides: Any):
    """``ModelConfig`` of the tiny policy with ``overrides`` (any ModelConfig field)."""
    from moe_rl.config import ModelConfig

    return ModelConfig(**{**TINY_MODEL, **overrides})


def tiny_policy(**overrides: Any):
    """The tiny policy (``overrides`` as in :func:`tiny_model_config`) in a world-of-one layout."""
    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy

    info = init_parallel(ParallelConfig(), seed=1)
    return build_policy(tiny_model_config(**overrides), ParallelConfig(), info)


TINY_RL: dict[str, Any] = {
    "model": {**TINY_MODEL, "vocab_size": 104},  # the char tokenizer's vocabulary
    "optim": {"lr": 1e-3},
    "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 2, "digits": 1}},
    "train": {
        "stages": ["rl"],
        "rl_steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "minibatches": 2,
        "max_new_tokens": 6,
        "eval_prompts": 2,
        "flip_probe_sequences": 2,
    },
}
"The smallest RL recipe of the tiny policy (one step of 2 prompts x 2 samples, 2 minibatches)."


TINY_E2E: dict[str, Any] = {
    "model": {**TINY_MODEL, "vocab_size": 104},  # the char tokenizer's vocabulary
    "optim": {"lr": 1e-3},
    "task": {"name": "arithmetic", "arithmetic": {"min_operands": 2, "max_operands": 2, "digits": 1}},
    "train": {
        "stages": ["sft", "rl"],
        "sft_steps": 3,
        "sft_batch_size": 8,
        "rl_steps": 2,
        "prompts_per_step": 2,
        "group_size": 4,
        "minibatches": 2,
        "max_new_tokens": 12,
        "eval_prompts": 4,
        "flip_probe_sequences": 2,
    },
}
"""The end-to-end recipe of the tiny policy: 3 SFT steps, then 2 RL steps of 2 prompts x 4 samples."""


def tiny_rl_recipe(out_dir, *, base: dict[str, Any] = TINY_RL, **sections: dict):
    """``base`` (:data:`TINY_RL`, :data:`TINY_E2E`) with ``sections`` merged into its sections,
    writing to ``out_dir``."""
    from moe_rl.config import recipe_from_dict

    data = {k: dict(v) for k, v in base.items()}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    data["train"]["out_dir"] = str(out_dir)
    return recipe_from_dict(data)


def tiny_e2e(tmp_path, **sections: dict):
    """:data:`TINY_E2E` with ``sections``, writing to ``tmp_path``/run."""
    return tiny_rl_recipe(tmp_path / "run", base=TINY_E2E, **sections)


def ready_run(out_dir, *, base: dict[str, Any] = TINY_E2E, stage: str = "rl", **sections: dict):
    """A trainer Run of ``base`` + ``sections`` with only ``stage`` (``train.stages``), its engine and
    that stage's optimizer built: what a test needs to drive one step by hand. Close it after."""
    from moe_rl.trainer.context import Run

    sections["train"] = {**sections.get("train", {}), "stages": [stage]}
    run = Run(tiny_rl_recipe(out_dir, base=base, **sections))
    run.ensure_engine()
    run.make_optimizer(stage)
    return run


COMPARE_TINY = [
    *flatten(SMOKE_BASE),
    "model.max_seq_len=32",
    "train.sft_steps=1",
    "train.sft_batch_size=2",
    "train.rl_steps=1",
    "train.prompts_per_step=2",
    "train.group_size=2",
    "train.minibatches=1",
    "train.max_new_tokens=4",
    "train.eval_prompts=1",
    "train.flip_probe_sequences=1",
]
"The tiny policy on recipes/demo/base.yaml (SFT stage): one SFT step, then one RL step a run."
