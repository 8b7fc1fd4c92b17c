"""The run's sections of the recipe: ``train`` (stages, batch sizes, step counts, probes, where a run
writes) and ``sentinel`` (collapse detectors). Part of the recipe (:mod:`moe_rl.config`, which
re-exports both), in a module of their own as the task and SGLang sections are."""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass
from typing import Literal

from moe_rl.configlib import check_choices, check_text, require, require_in, require_positive, require_seed
from moe_rl.names import DEFAULT_LOGGERS, LOGGERS


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Stages, batch sizes and step counts of a run (SFT warm start, then RL)."""

    stages: tuple[Literal["sft", "rl"], ...] = ("sft", "rl")
    "Stages to run in order: sft (teacher-forced warm start on task demonstrations) and/or rl."
    out_dir: str = "runs/default"
    "Directory for metrics (JSONL, TensorBoard), checkpoints and reports."
    seed: int = 1234
    "Seed of sampling and data order."
    sft_steps: int = 200
    "Optimizer steps of the SFT stage."
    sft_batch_size: int = 32
    "Demonstrations per SFT step (global, across data-parallel ranks)."
    sft_lr: float | None = None
    "SFT learning rate (None: optim.lr)."
    rl_steps: int = 20
    "RL steps (one rollout batch each)."
    prompts_per_step: int = 8
    "Prompts per rollout batch (global)."
    group_size: int = 8
    "Responses sampled per prompt (G)."
    minibatches: int = 4
    "Optimizer steps per rollout batch (the off-policy knob; must divide the batch)."
    shuffle_minibatches: bool = False
    "Shuffle the rollout batch's rows (seeded per step) before splitting it into minibatches, so each update sees rows of many prompts (verl's actor.shuffle); false: contiguous slices, whole prompt groups per update."
    micro_batch_size: int = 0
    "Sequences per forward/backward on one rank (gradient accumulation within a minibatch); 0: the whole share."
    packing: bool = True
    "Pack each micro-batch's rows into one sequence (pi_old, training and probe forwards): no padding position is computed."
    pack_tokens: int = 0
    "With packing: most input tokens per micro-batch (rows stay in order; a longer row goes alone); 0: micro_batch_size rows."
    max_new_tokens: int = 64
    "Longest response."
    temperature: float = 1.0
    "Rollout sampling temperature (log-probs use the same temperature)."
    top_p: float = 1.0
    "Rollout nucleus sampling mass."
    eval_every: int = 0
    "Greedy accuracy on held-out prompts every N RL steps (0: only at the end)."
    eval_prompts: int = 64
    "Held-out prompts per evaluation."
    samples_every: int = 10
    "Write train.samples_per_step rollouts of every N-th RL step (steps 0, N, 2N, ...: prompt, response, reward, advantage) and as many held-out generations of every evaluation (prompt, response, reward, correct) to <out_dir>/samples.jsonl and TensorBoard text (rank 0; 0: off)."
    samples_per_step: int = 4
    "Rollouts (the first rows of rank 0's batch) and held-out generations written each time train.samples_every writes."
    log_every: int = 1
    "Print a progress line every N steps."
    loggers: tuple[str, ...] = DEFAULT_LOGGERS
    "Where rank 0 sends metrics: jsonl (metrics.jsonl: always, --resume and moe-rl report read it) | tensorboard (scalars, hparams, the recipe, samples; <out_dir>/tb) | wandb (pip install wandb; WANDB_MODE, WANDB_PROJECT) | mlflow (pip install mlflow-skinny; MLFLOW_TRACKING_URI, else <out_dir>/mlruns); docs/design.md#trackers."
    flip_probe_sequences: int = 3
    "Sequences of each rollout batch whose routes are compared just before and after every optimizer step (0: off; each probe is a forward of them to the last router: ~5% of a step at 3, docs/algorithms.md)."
    flip_probe_every: int = 1
    "Measure the per-step flip rate every N optimizer steps."
    max_bad_steps: int = 3
    "Stop after this many consecutive steps with non-finite loss or gradients (each one is skipped)."
    start_jitter: float = 0.0
    "Std of Gaussian noise added once to every weight when a run starts (not on resume), seeded by train.seed: the chaos null's no-op perturbation (e.g. 1e-7), whose effect measures how far numerics alone move a run (0: off)."
    route_noise: float = 0.0
    "Selection noise of the trainer's routers in RL (pi_old, training and probe forwards; SFT routes without it): sigma of Gaussian noise on the router logits the top-k is taken from, gates from the clean logits; replayed routes stay exact (0: off; docs/algorithms.md#routing-noise)."
    freeze_router: bool = False
    "RL stage only: no update changes any MoE router weight (SFT still trains them), as verl's actor_rollout_ref.model.override_config.moe_config.freeze_moe_router and NeMo-RL's policy.megatron_cfg.freeze_moe_router; gradients still flow through the gates to the layers below (docs/algorithms.md#router-frozen)."
    router_lr_mult: float = 1.0
    "RL stage only: the MoE routers' learning rate (and weight decay) as a multiple of optim.lr, a volatility dial: how far each update moves the routing (1: as every other weight; 0 is train.freeze_router without its zeroed gradient; docs/algorithms.md#router-learning-rate)."

    def __post_init__(self) -> None:
        check_choices(self, "train")
        self._check_stages_and_paths()
        self._check_loggers()
        require_positive(self, "train", "sft_batch_size", "prompts_per_step", "group_size", "minibatches")
        require_positive(self, "train", "max_new_tokens", "eval_prompts", "log_every")
        require_positive(self, "train", "sft_steps", "rl_steps", "eval_every", strict=False)
        for stage in self.stages:
            steps = getattr(self, f"{stage}_steps")
            require(
                steps >= 1,
                f"train.{stage}_steps={steps} with {stage} in train.stages: give at least 1 step, or take "
                f"{stage} out of train.stages",
            )
        require_seed(self, "train", "seed")
        require_positive(self, "train", "micro_batch_size", "pack_tokens", strict=False)
        require_positive(self, "train", "samples_every", "samples_per_step", strict=False)
        require(
            self.group_size >= 2 or "rl" not in self.stages,
            "train.group_size must be >= 2 for RL: group advantages need several responses",
        )
        batch = self.prompts_per_step * self.group_size
        require(
            batch % self.minibatches == 0,
            f"train.minibatches={self.minibatches} does not divide the rollout batch "
            f"prompts_per_step x group_size = {batch}: pick a divisor of {batch}",
        )
        require(self.temperature > 0, f"train.temperature must be > 0, got {self.temperature}")
        require_in(self, "train", "top_p", 0, 1, "(0, 1]")
        require_positive(self, "train", "sft_lr")
        require(
            self.flip_probe_sequences >= 0 and self.flip_probe_every >= 1,
            "train.flip_probe_sequences must be >= 0 and train.flip_probe_every >= 1",
        )
        require(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")
        require_positive(self, "train", "route_noise", "start_jitter", "router_lr_mult", strict=False)
        require(
            not self.freeze_router or self.router_lr_mult == 1.0,
            f"train.freeze_router=true with train.router_lr_mult={self.router_lr_mult}: a frozen router takes "
            "no learning rate; set one of them (train.router_lr_mult=1 or train.freeze_router=false)",
        )
        require(
            self.packing or self.pack_tokens == 0,
            "train.pack_tokens is a packing budget: set train.packing=true or train.pack_tokens=0",
        )
        check_text(self, "train")

    def _check_loggers(self) -> None:
        """Every name in :data:`moe_rl.names.LOGGERS`, once, jsonl among them, each tracker's package
        importable (found, not imported: a recipe loads in milliseconds)."""
        for i, name in enumerate(self.loggers):
            require(
                name in LOGGERS,
                f"train.loggers[{i}]={name!r} is unknown: use {', '.join(LOGGERS)}",
            )
        require(
            len(set(self.loggers)) == len(self.loggers),
            f"train.loggers={list(self.loggers)} names a logger twice: list each once",
        )
        require(
            "jsonl" in self.loggers,
            f"train.loggers={list(self.loggers)} leaves out jsonl: metrics.jsonl is what --resume, "
            "moe-rl report and the lab read; add jsonl",
        )
        for name in self.loggers:
            if LOGGERS[name] is None:
                continue
            module, package = LOGGERS[name]
            require(
                _installed(module),
                f"train.loggers names {name}, whose package is not installed: pip install {package} "
                f"(or pip install 'moe-rl[track]'), or take {name} out of train.loggers",
            )

    def _check_stages_and_paths(self) -> None:
        require(bool(self.stages), "train.stages is empty: list the stages to run, e.g. [sft, rl]")
        require(
            tuple(self.stages) in (("sft",), ("rl",), ("sft", "rl")),
            f"train.stages={list(self.stages)}: use [sft, rl], [sft] or [rl] (each once, sft first)",
        )
        require(
            bool(self.out_dir.strip()),
            "train.out_dir is empty (the run would write into the current folder): name a run folder, "
            "e.g. runs/my_run",
        )


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module left without a spec
        return False


SentinelAction = Literal["off", "log", "stop", "rollback"]
SENTINEL_ACTIONS = typing.get_args(SentinelAction)


@dataclass(frozen=True, kw_only=True)
class SentinelConfig:
    """Collapse detectors for long MoE runs; each has an action: off | log | stop | rollback."""

    reward_drop_frac: float = 0.5
    "Reward detector: fires when the reward mean stays below this fraction of its running best ..."
    reward_window: int = 5
    "... for this many consecutive RL steps."
    reward_min_best: float = 0.05
    "The reward detector arms once the running best exceeds this."
    reward_action: SentinelAction = "log"
    "Action of the reward detector."
    max_abs_seq_log_ratio: float = 50.0
    "Ratio detector: fires when |sum_t log-ratio| of any sequence exceeds this (GRPO's clip leaves it free)."
    ratio_action: SentinelAction = "log"
    "Action of the ratio detector."
    max_grad_norm: float = 1000.0
    "Gradient detector: fires when the pre-clip gradient norm exceeds this."
    grad_action: SentinelAction = "log"
    "Action of the gradient detector."
    min_entropy: float = 0.02
    "Entropy detector: fires when the mean per-token entropy of the responses falls below this."
    entropy_action: SentinelAction = "log"
    "Action of the entropy detector."
    rollback_lr_factor: float = 0.5
    "On rollback, reload the last good checkpoint and multiply the learning rate by this."
    max_rollbacks: int = 3
    "Stop instead of rolling back after this many rollbacks."

    def __post_init__(self) -> None:
        check_choices(self, "sentinel")
        require(0 < self.reward_drop_frac < 1, "sentinel.reward_drop_frac must be in (0, 1)")
        require(self.reward_window >= 1, "sentinel.reward_window must be >= 1")
        require(0 < self.rollback_lr_factor <= 1, "sentinel.rollback_lr_factor must be in (0, 1]")
        require_positive(self, "sentinel", "max_abs_seq_log_ratio", "max_grad_norm")
        require_positive(self, "sentinel", "reward_min_best", "min_entropy", "max_rollbacks", strict=False)
        check_text(self, "sentinel")
