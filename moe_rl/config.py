"""Frozen, keyword-only configuration dataclasses, one per concern, and the recipe loader.

A recipe is a YAML file whose top-level keys are the sections of :class:`Recipe`
(``model``, ``parallel``, ``optim``, ``checkpoint``, ``algo``, ...). Command-line
overrides are ``section.field=value`` strings parsed as YAML scalars.

Every field carries a one-line docstring (the string literal after it). Validation
lives in ``__post_init__`` and names the field and the fix; cross-section checks live
in :meth:`Recipe.__post_init__` so they run before any process group starts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the field and the fix."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Qwen3-MoE-style decoder (RMSNorm, QK-norm, RoPE, SwiGLU experts, softmax top-k router)."""

    vocab_size: int = 104
    "Vocabulary size: at least the tokenizer's, divisible by parallel.tensor_parallel."
    tokenizer: str = "char"
    "char (the built-in character tokenizer, 104 ids) or a local Hugging Face tokenizer directory."
    hidden_size: int = 128
    "Model width."
    num_layers: int = 4
    "Number of transformer layers; every layer is an MoE layer."
    num_attention_heads: int = 4
    "Query heads."
    num_query_groups: int = 2
    "Key/value heads (grouped-query attention)."
    head_dim: int = 32
    "Width of one attention head (Qwen3 sets it independently of hidden_size)."
    moe_ffn_hidden_size: int = 128
    "Intermediate width of one SwiGLU expert."
    num_experts: int = 8
    "Routed experts per layer."
    moe_router_topk: int = 2
    "Experts chosen per token (K)."
    moe_norm_topk_prob: bool = True
    "Renormalise the softmax probabilities over the chosen K experts (Qwen3-MoE: true)."
    moe_aux_loss_coeff: float = 0.0
    "Load-balancing auxiliary loss coefficient (0 disables it)."
    moe_z_loss_coeff: float = 0.0
    "Router z-loss coefficient (0 disables it)."
    moe_token_dispatcher: str = "alltoall"
    "megatron-core token dispatcher: alltoall | allgather."
    max_seq_len: int = 256
    "Longest prompt + response the model is built for (RoPE table size)."
    rope_theta: float = 1_000_000.0
    "RoPE base."
    norm_eps: float = 1e-6
    "RMSNorm epsilon."
    qk_norm: bool = True
    "RMSNorm on per-head queries and keys (Qwen3)."
    tie_embeddings: bool = False
    "Share input embedding and output layer weights (Qwen3-30B-A3B: false)."
    init_std: float = 0.02
    "Std of the normal weight initialisation."
    dtype: str = "float32"
    "Parameter and compute dtype: float32 | bfloat16 (bfloat16 needs CUDA)."
    recompute: bool = False
    "Full activation recompute of every layer in backward (saves memory)."
    logprob_impl: str = "auto"
    "Log-prob pass: auto (fused vocab-chunked Triton kernel on CUDA, full logits elsewhere) | logits | torch (chunked reference) | triton."
    transformer_impl: str = "auto"
    "Layer spec: auto (transformer-engine when installed and CUDA present) | local | transformer_engine."
    seed: int = 1234
    "Seed of the weight initialisation."
    hf_path: str | None = None
    "Local Hugging Face Qwen3-MoE checkpoint to start from (None: random init)."

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "moe_ffn_hidden_size",
            "num_experts",
            "moe_router_topk",
            "max_seq_len",
        ):
            _require(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        _require(
            self.moe_router_topk <= self.num_experts,
            f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts="
            f"{self.num_experts}: choose topk <= num_experts",
        )
        _require(
            self.moe_router_topk >= 2 or not self.moe_norm_topk_prob,
            "model.moe_router_topk=1 with model.moe_norm_topk_prob=true gives every token gate weight 1, "
            "which megatron-core's router refuses: use moe_router_topk >= 2, or moe_norm_topk_prob=false "
            "(softmax over all experts)",
        )
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={self.num_query_groups}",
        )
        _require(
            self.dtype in ("float32", "bfloat16"), f"model.dtype={self.dtype!r}: use float32 or bfloat16"
        )
        _require(
            self.moe_token_dispatcher in ("alltoall", "allgather"),
            f"model.moe_token_dispatcher={self.moe_token_dispatcher!r}: use alltoall or allgather",
        )
        _require(
            self.logprob_impl in ("auto", "logits", "torch", "triton"),
            f"model.logprob_impl={self.logprob_impl!r}: use auto, logits, torch or triton",
        )
        _require(
            self.transformer_impl in ("auto", "local", "transformer_engine"),
            f"model.transformer_impl={self.transformer_impl!r}: use auto, local or transformer_engine",
        )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Process layout: world = tensor_parallel x pipeline_parallel x data_parallel.

    Experts are sharded over expert_parallel ranks carved out of tensor_parallel x
    data_parallel, as in megatron-core (expert tensor parallelism is 1).
    """

    tensor_parallel: int = 1
    "Tensor-parallel size (attention heads, vocab, sequence parallelism when > 1)."
    expert_parallel: int = 1
    "Expert-parallel size; must divide model.num_experts and tensor_parallel x data_parallel."
    pipeline_parallel: int = 1
    "Pipeline-parallel size (only 1 is supported for now)."
    data_parallel: int = 1
    "Data-parallel size."
    backend: str = "auto"
    "torch.distributed backend: auto (nccl with CUDA, gloo without) | gloo | nccl."
    timeout_s: float = 600.0
    "Timeout of every collective, seconds."

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "data_parallel"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _require(
            self.pipeline_parallel == 1,
            f"parallel.pipeline_parallel={self.pipeline_parallel}: pipeline parallelism is not "
            "supported yet; set parallel.pipeline_parallel=1 and use tensor/expert/data parallelism",
        )
        _require(
            (self.tensor_parallel * self.data_parallel) % self.expert_parallel == 0,
            f"parallel.expert_parallel={self.expert_parallel} must divide tensor_parallel x "
            f"data_parallel = {self.tensor_parallel * self.data_parallel}",
        )
        _require(
            self.backend in ("auto", "gloo", "nccl"),
            f"parallel.backend={self.backend!r}: use auto, gloo or nccl",
        )

    @property
    def world_size(self) -> int:
        """Processes this layout needs."""
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping and a warmup + decay LR schedule."""

    lr: float = 1e-4
    "Peak learning rate."
    min_lr: float = 0.0
    "Learning rate at the end of the decay."
    weight_decay: float = 0.0
    "Decoupled weight decay (not applied to norms)."
    beta1: float = 0.9
    "Adam beta1."
    beta2: float = 0.999
    "Adam beta2."
    adam_eps: float = 1e-8
    "Adam epsilon."
    grad_clip: float = 1.0
    "Global gradient-norm clip (0 disables clipping)."
    warmup_steps: int = 0
    "Linear warmup steps from 0 to lr."
    decay_steps: int = 0
    "Steps of decay after warmup (0: constant lr after warmup)."
    decay_style: str = "constant"
    "constant | linear | cosine."

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must be in [0, optim.lr]")
        _require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")
        _require(
            self.warmup_steps >= 0 and self.decay_steps >= 0,
            "optim.warmup_steps and optim.decay_steps must be >= 0",
        )
        _require(
            self.decay_style in ("constant", "linear", "cosine"),
            f"optim.decay_style={self.decay_style!r}: use constant, linear or cosine",
        )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how often to save; what to resume from."""

    dir: str | None = None
    "Checkpoint directory (None: no checkpoints)."
    every: int = 0
    "Save every N steps (0: only at the end)."
    keep: int = 2
    "Checkpoints to keep (oldest removed first)."
    load: str | None = None
    "Checkpoint directory to load weights from at start (None: none)."

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"checkpoint.every must be >= 0, got {self.every}")
        _require(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")


LOSS_AGGREGATIONS = ("seq_mean", "token_mean")


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """Policy-gradient algorithm, clip band, KL and routing replay (REFERENCE.md)."""

    name: str = "gspo"
    "Loss in moe_rl.losses.LOSSES: grpo | gspo | gspo_token."
    eps_low: float | None = None
    "Lower clip: ratio >= 1 - eps_low (None: the paper value, grpo 0.2, gspo 3e-4)."
    eps_high: float | None = None
    "Upper clip: ratio <= 1 + eps_high (None: the paper value, grpo 0.27, gspo 4e-4)."
    aggregation: str = "seq_mean"
    "seq_mean (mean over tokens of a sequence, then over sequences) | token_mean (all tokens equal)."
    beta: float = 0.0
    "Coefficient of the k3 KL(pi_theta || pi_ref) penalty (GSPO's authors use 0)."
    adv_eps: float = 1e-6
    "Epsilon in A_i = (r_i - mean) / (std + eps)."
    adv_std_normalize: bool = True
    "Divide group-centred rewards by the group std (false: Dr.GRPO-style centring only)."
    adv_std_unbiased: bool = True
    "Group std with Bessel's correction, as torch.std, verl and TRL (false: population std)."
    routing: str = "none"
    "Routing replay: none | r2 (replay trainer-recorded routes) | r3 (replay rollout-engine routes)."
    replay_gate_weights: bool = False
    "Under replay, also replay the recorded gate weights (not only the expert indices)."
    old_logprobs: str = "recompute"
    "Source of pi_old log-probs: recompute (trainer forward) | rollout (engine log-probs)."
    clip_ratio_c: float | None = None
    "Dual-clip constant c > 1 bounding the objective at c A for A < 0 (None: off)."
    rollout_correction: str = "none"
    "Train-inference mismatch correction: none | tis | seq_tis | icepop | geo_mask."
    correction_c: float = 2.0
    "Truncation C of tis / seq_tis."
    correction_low: float | None = None
    "Lower bound of icepop / geo_mask on the ratio pi_old / pi_roll (None: 0.5)."
    correction_high: float | None = None
    "Upper bound of icepop / geo_mask on the ratio pi_old / pi_roll (None: 5.0)."

    def __post_init__(self) -> None:
        _require(
            self.name in ("grpo", "gspo", "gspo_token"),
            f"algo.name={self.name!r} is unknown: use grpo, gspo or gspo_token",
        )
        _require(
            self.aggregation in LOSS_AGGREGATIONS,
            f"algo.aggregation={self.aggregation!r}: use one of {LOSS_AGGREGATIONS}",
        )
        _require(self.routing in ("none", "r2", "r3"), f"algo.routing={self.routing!r}: use none, r2 or r3")
        _require(
            self.old_logprobs in ("recompute", "rollout"),
            f"algo.old_logprobs={self.old_logprobs!r}: use recompute or rollout",
        )
        _require(self.beta >= 0, f"algo.beta must be >= 0, got {self.beta}")
        if self.eps_low is not None:
            _require(0 <= self.eps_low < 1, f"algo.eps_low={self.eps_low} must be in [0, 1)")
        if self.eps_high is not None:
            _require(self.eps_high >= 0, f"algo.eps_high={self.eps_high} must be >= 0")

    @property
    def clip_low(self) -> float:
        """eps_low, or the paper value for the algorithm."""
        if self.eps_low is not None:
            return self.eps_low
        return 0.2 if self.name == "grpo" else 3e-4

    @property
    def clip_high(self) -> float:
        """eps_high, or the paper value for the algorithm."""
        if self.eps_high is not None:
            return self.eps_high
        return 0.27 if self.name == "grpo" else 4e-4


@dataclass(frozen=True, kw_only=True)
class ArithmeticConfig:
    """Multi-step integer arithmetic with a written-out scratchpad."""

    min_operands: int = 2
    "Fewest operands in a question (steps = operands - 1)."
    max_operands: int = 4
    "Most operands in a question; the response grows by about 10 characters per operand."
    digits: int = 2
    "Operands are drawn uniformly from 0 .. 10**digits - 1."
    operators: str = "+-"
    "Operators to draw from, a subset of '+-*' (multiplication binds tighter, as usual)."
    scratchpad: bool = True
    "Demonstrations write every intermediate step before the answer (false: only 'A:<n>')."

    def __post_init__(self) -> None:
        _require(
            self.min_operands >= 2, f"task.arithmetic.min_operands must be >= 2, got {self.min_operands}"
        )
        _require(
            self.max_operands >= self.min_operands,
            f"task.arithmetic.max_operands={self.max_operands} is below task.arithmetic.min_operands="
            f"{self.min_operands}: raise max_operands or lower min_operands",
        )
        _require(
            self.max_operands <= 64, f"task.arithmetic.max_operands must be <= 64, got {self.max_operands}"
        )
        _require(1 <= self.digits <= 9, f"task.arithmetic.digits must be in 1..9, got {self.digits}")
        _require(
            bool(self.operators) and set(self.operators) <= set("+-*"),
            f"task.arithmetic.operators={self.operators!r}: use a non-empty subset of '+-*'",
        )


@dataclass(frozen=True, kw_only=True)
class CountdownConfig:
    """Reach a target from given numbers with + - * / and parentheses (each number at most once)."""

    num_numbers: int = 4
    "Numbers given in a question."
    max_number: int = 30
    "Given numbers are drawn uniformly from 1 .. max_number."
    max_target: int = 200
    "Targets lie in 1 .. max_target (built from a random expression, so always solvable)."
    operators: str = "+-*/"
    "Operators used to build targets and search traces, a subset of '+-*/'."
    use_all_numbers: bool = False
    "Targets are built from all the numbers, and a correct answer must use every one of them."
    max_failed_attempts: int = 2
    "Demonstrations show 0 .. this many failed tries before the solution (trace length)."

    def __post_init__(self) -> None:
        _require(
            2 <= self.num_numbers <= 8, f"task.countdown.num_numbers must be in 2..8, got {self.num_numbers}"
        )
        _require(self.max_number >= 2, f"task.countdown.max_number must be >= 2, got {self.max_number}")
        _require(self.max_target >= 2, f"task.countdown.max_target must be >= 2, got {self.max_target}")
        _require(
            bool(self.operators) and set(self.operators) <= set("+-*/"),
            f"task.countdown.operators={self.operators!r}: use a non-empty subset of '+-*/'",
        )
        _require(
            "+" in self.operators or "*" in self.operators,
            f"task.countdown.operators={self.operators!r} cannot build targets: include '+' or '*'",
        )
        _require(
            0 <= self.max_failed_attempts <= 16,
            f"task.countdown.max_failed_attempts must be in 0..16, got {self.max_failed_attempts}",
        )


@dataclass(frozen=True, kw_only=True)
class JsonlConfig:
    """Prompts and answers from a JSONL file, scored by a user reward function."""

    path: str | None = None
    "JSONL file, one JSON object per line (required when task.name=jsonl)."
    prompt_field: str = "prompt"
    "Key of the prompt string in each line."
    answer_field: str = "answer"
    "Key of the reference answer in each line (any JSON value; strings are kept, others JSON-encoded)."
    response_field: str | None = None
    "Key of a demonstration response for SFT (None: the task has no demonstrations)."
    reward_fn: str = "moe_rl.tasks.jsonl:exact_match"
    "module:function (or path/to/file.py:function) called as fn(response, answer, record) -> float."
    prompt_template: str = "{prompt}"
    "Prompt text given to the model; '{prompt}' is replaced by the prompt field."
    heldout_path: str | None = None
    "JSONL file of held-out prompts (None: hold out task.heldout_fraction of path by prompt hash)."

    def __post_init__(self) -> None:
        fn = self.reward_fn
        _require(
            fn.count(":") >= 1 and all(fn.rpartition(":")[::2]),
            f"task.jsonl.reward_fn={fn!r}: write it as module:function, e.g. mypkg.rewards:score",
        )
        _require(
            "{prompt}" in self.prompt_template,
            f"task.jsonl.prompt_template={self.prompt_template!r} must contain '{{prompt}}'",
        )
        for name in ("prompt_field", "answer_field"):
            _require(bool(getattr(self, name)), f"task.jsonl.{name} must be a non-empty key")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which verifiable task to train on, its difficulty and length knobs, and its reward shape."""

    name: str = "arithmetic"
    "Task in moe_rl.tasks.TASKS: arithmetic | countdown | jsonl."
    seed: int = 0
    "Seed of the training prompt stream (the trainer passes it to task.sample as rng_seed)."
    heldout_fraction: float = 0.05
    "Share of the prompt space (by prompt-text hash) reserved for held-out evaluation."
    format_reward: float = 0.0
    "Reward for a well-formed but wrong final answer (a correct one always scores 1.0)."
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    "Knobs of the arithmetic task."
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    "Knobs of the countdown task."
    jsonl: JsonlConfig = field(default_factory=JsonlConfig)
    "Knobs of the jsonl task."

    def __post_init__(self) -> None:
        from moe_rl.tasks import TASKS  # the registry lives in the package __init__

        _require(
            self.name in TASKS, f"task.name={self.name!r} is unknown: use one of {', '.join(sorted(TASKS))}"
        )
        _require(
            0.0 < self.heldout_fraction < 1.0,
            f"task.heldout_fraction={self.heldout_fraction} must be in (0, 1), e.g. 0.05",
        )
        _require(
            0.0 <= self.format_reward < 1.0,
            f"task.format_reward={self.format_reward} must be in [0, 1) so a correct answer scores most",
        )
        _require(
            self.name != "jsonl" or self.jsonl.path is not None,
            "task.name=jsonl needs task.jsonl.path: set it to a JSONL file of prompts and answers",
        )


# ---------------------------------------------------------------------------------------
# Prompts and the task protocol.


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Which engine samples the rollouts and how its weights are kept current."""

    engine: str = "embedded"
    "Engine in moe_rl.rollout.ROLLOUT_ENGINES: embedded (in-process, every machine) | sglang."
    embedded_decoder: str = "auto"
    "Forward of the embedded engine: lean (moe_rl.megatron.decode; TP=1) | megatron | auto (lean where it runs)."
    sglang_url: str | None = None
    "Attach to a running SGLang server at this URL (None with engine=sglang: launch one)."
    sglang_model_path: str | None = None
    "HF checkpoint directory the launched SGLang server starts from (the policy's export)."
    sglang_tp: int = 1
    "Tensor-parallel size of a launched SGLang server."
    sglang_ep: int = 1
    "Expert-parallel size of a launched SGLang server."
    sglang_port: int = 30000
    "Port of a launched SGLang server (bound to sglang_host; 0: a free port)."
    sglang_host: str = "127.0.0.1"
    "Host a launched SGLang server binds to."
    sglang_mem_fraction: float = 0.8
    "SGLang --mem-fraction-static."
    sglang_module: str = "sglang.launch_server"
    "Server module the launcher runs (moe_rl.rollout.serve_embedded: our SGLang-protocol server, CPU)."
    sglang_startup_timeout_s: float = 900.0
    "How long a launched server may take to answer /health_generate."
    weight_sync: str = "distributed"
    "How new weights reach SGLang: distributed (NCCL/gloo broadcast) | disk (HF safetensors)."
    weight_sync_dir: str | None = None
    "Directory for disk weight sync (None: <out_dir>/weights)."
    timeout_s: float = 600.0
    "Timeout of one engine request, seconds."
    retries: int = 3
    "Retries of a failed request (connection errors and 5xx only)."

    def __post_init__(self) -> None:
        _require(
            self.engine in ("embedded", "sglang"),
            f"rollout.engine={self.engine!r} is unknown: use embedded or sglang",
        )
        _require(
            self.embedded_decoder in ("auto", "lean", "megatron"),
            f"rollout.embedded_decoder={self.embedded_decoder!r}: use auto, lean or megatron",
        )
        _require(
            self.weight_sync in ("distributed", "disk"),
            f"rollout.weight_sync={self.weight_sync!r}: use distributed or disk",
        )
        _require(self.sglang_tp >= 1 and self.sglang_ep >= 1, "rollout.sglang_tp and sglang_ep must be >= 1")
        _require(0 < self.sglang_mem_fraction < 1, "rollout.sglang_mem_fraction must be in (0, 1)")
        _require(self.timeout_s > 0 and self.retries >= 0, "rollout.timeout_s > 0 and rollout.retries >= 0")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Stages, batch sizes and step counts of a run (SFT warm start, then RL)."""

    stages: tuple[str, ...] = ("sft", "rl")
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
    micro_batch_size: int = 0
    "Sequences per forward/backward on one rank (gradient accumulation within a minibatch); 0: the whole share."
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
    log_every: int = 1
    "Print a progress line every N steps."
    flip_probe_sequences: int = 8
    "Sequences of each rollout batch whose routes are compared just before and after every optimizer step (0: off)."
    flip_probe_every: int = 1
    "Measure the per-step flip rate every N optimizer steps."
    max_bad_steps: int = 3
    "Stop after this many consecutive steps with non-finite loss or gradients (each one is skipped)."

    def __post_init__(self) -> None:
        for s in self.stages:
            _require(s in ("sft", "rl"), f"train.stages has {s!r}: use sft and/or rl")
        for name in (
            "sft_batch_size",
            "prompts_per_step",
            "group_size",
            "minibatches",
            "max_new_tokens",
            "eval_prompts",
            "log_every",
        ):
            _require(getattr(self, name) >= 1, f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sft_steps", "rl_steps", "eval_every", "micro_batch_size"):
            _require(getattr(self, name) >= 0, f"train.{name} must be >= 0, got {getattr(self, name)}")
        _require(
            self.group_size >= 2 or "rl" not in self.stages,
            "train.group_size must be >= 2 for RL: group advantages need several responses",
        )
        batch = self.prompts_per_step * self.group_size
        _require(
            batch % self.minibatches == 0,
            f"train.minibatches={self.minibatches} does not divide the rollout batch "
            f"prompts_per_step x group_size = {batch}: pick a divisor of {batch}",
        )
        _require(self.temperature > 0, f"train.temperature must be > 0, got {self.temperature}")
        _require(
            self.flip_probe_sequences >= 0 and self.flip_probe_every >= 1,
            "train.flip_probe_sequences must be >= 0 and train.flip_probe_every >= 1",
        )
        _require(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")


SENTINEL_ACTIONS = ("off", "log", "stop", "rollback")


@dataclass(frozen=True, kw_only=True)
class SentinelConfig:
    """Collapse detectors for long MoE runs; each has an action: off | log | stop | rollback."""

    reward_drop_frac: float = 0.5
    "Reward detector: fires when the reward mean stays below this fraction of its running best ..."
    reward_window: int = 5
    "... for this many consecutive RL steps."
    reward_min_best: float = 0.05
    "The reward detector arms once the running best exceeds this."
    reward_action: str = "log"
    "Action of the reward detector."
    max_abs_seq_log_ratio: float = 50.0
    "Ratio detector: fires when |sum_t log-ratio| of any sequence exceeds this (GRPO's clip leaves it free)."
    ratio_action: str = "log"
    "Action of the ratio detector."
    max_grad_norm: float = 1000.0
    "Gradient detector: fires when the pre-clip gradient norm exceeds this."
    grad_action: str = "log"
    "Action of the gradient detector."
    min_entropy: float = 0.02
    "Entropy detector: fires when the mean per-token entropy of the responses falls below this."
    entropy_action: str = "log"
    "Action of the entropy detector."
    rollback_lr_factor: float = 0.5
    "On rollback, reload the last good checkpoint and multiply the learning rate by this."
    max_rollbacks: int = 3
    "Stop instead of rolling back after this many rollbacks."

    def __post_init__(self) -> None:
        for name in ("reward_action", "ratio_action", "grad_action", "entropy_action"):
            _require(
                getattr(self, name) in SENTINEL_ACTIONS,
                f"sentinel.{name}={getattr(self, name)!r}: use one of {', '.join(SENTINEL_ACTIONS)}",
            )
        _require(0 < self.reward_drop_frac < 1, "sentinel.reward_drop_frac must be in (0, 1)")
        _require(self.reward_window >= 1, "sentinel.reward_window must be >= 1")
        _require(0 < self.rollback_lr_factor <= 1, "sentinel.rollback_lr_factor must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A whole run: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    "The policy architecture."
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    "The process layout."
    optim: OptimConfig = field(default_factory=OptimConfig)
    "The optimizer."
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    "Checkpointing."
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    "The RL algorithm."
    task: TaskConfig = field(default_factory=TaskConfig)
    "The verifiable task."
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    "The rollout engine."
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    "Collapse detectors."
    train: TrainConfig = field(default_factory=TrainConfig)
    "Stages, batch sizes and step counts."

    def __post_init__(self) -> None:
        m, p = self.model, self.parallel
        _require(
            m.num_experts % p.expert_parallel == 0,
            f"model.num_experts={m.num_experts} is not divisible by parallel.expert_parallel="
            f"{p.expert_parallel}: pick an expert_parallel that divides it",
        )
        _require(
            m.num_attention_heads % p.tensor_parallel == 0,
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"parallel.tensor_parallel={p.tensor_parallel}",
        )
        _require(
            m.num_query_groups % p.tensor_parallel == 0,
            f"model.num_query_groups={m.num_query_groups} is not divisible by "
            f"parallel.tensor_parallel={p.tensor_parallel}",
        )
        _require(
            m.vocab_size % p.tensor_parallel == 0,
            f"model.vocab_size={m.vocab_size} is not divisible by parallel.tensor_parallel="
            f"{p.tensor_parallel}: pad the vocabulary",
        )
        b = self.train.prompts_per_step * self.train.group_size
        _require(
            b % (p.data_parallel * self.train.minibatches) == 0,
            f"the rollout batch ({b}) must split into train.minibatches={self.train.minibatches} "
            f"x parallel.data_parallel={p.data_parallel} equal shares",
        )
        _require(
            self.train.sft_batch_size % p.data_parallel == 0,
            f"train.sft_batch_size={self.train.sft_batch_size} must be divisible by "
            f"parallel.data_parallel={p.data_parallel}",
        )
        _require(
            self.algo.routing != "r3" or self.rollout.engine in ("embedded", "sglang"),
            "algo.routing=r3 needs an engine that returns routes (embedded or sglang)",
        )
        _require(
            m.dtype == "float32" or p.backend != "gloo",
            "model.dtype=bfloat16 needs CUDA (nccl); set model.dtype=float32 on CPU",
        )


# ---------------------------------------------------------------------------------------
# Loading: YAML dict -> dataclasses, with type checks that name the field.


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` coerced to annotation ``tp`` or raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin in (list, tuple):
        _require(isinstance(value, (list, tuple)), f"{where} must be a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return origin(_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        _require(isinstance(value, dict), f"{where} must be a mapping of fields, got {value!r}")
        return build_dataclass(tp, value, where)
    if tp is bool:
        _require(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        _require(
            isinstance(value, int) and not isinstance(value, bool),
            f"{where} must be an integer, got {value!r}",
        )
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            f"{where} must be a number, got {value!r}",
        )
        return float(value)
    if tp is str:
        _require(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def build_dataclass(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    prefix = f"{where}." if where else ""
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + u for u in unknown)}; "
            f"valid keys of {where or 'the recipe'}: {', '.join(sorted(names))}"
        )
    kwargs = {k: _check_type(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - kw_only dataclasses report missing fields here
        raise ConfigError(f"{where or 'recipe'}: {e}") from e


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        nxt = cur.setdefault(k, {})
        _require(isinstance(nxt, dict), f"override {dotted}: {k} is not a section")
        cur = nxt
    cur[keys[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Parse ``key.sub=value`` strings; values are YAML scalars (``1e-4``, ``true``, ``null``)."""
    out = []
    for o in overrides:
        _require("=" in o, f"override {o!r} must look like section.field=value")
        k, v = o.split("=", 1)
        _require(bool(k.strip()), f"override {o!r} has an empty key")
        out.append((k.strip(), yaml.safe_load(v) if v != "" else None))
    return out


def recipe_from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Build a :class:`Recipe` from a parsed YAML mapping plus overrides."""
    data = dict(data or {})
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for k, v in parse_overrides(overrides):
        _set_path(data, k, v)
    return build_dataclass(Recipe, data)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_recipe_data(path: str | Path, _seen: tuple = ()) -> dict:
    """A recipe file as a mapping, with ``include: other.yaml`` (relative path) deep-merged under it."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"recipe {path} does not exist")
    _require(path.resolve() not in _seen, f"recipe include cycle through {path}")
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    _require(isinstance(data, dict), f"recipe {path} must be a mapping of sections")
    inc = data.pop("include", None)
    if inc is not None:
        base = read_recipe_data(path.parent / inc, (*_seen, path.resolve()))
        data = _deep_merge(base, data)
    return data


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a YAML recipe (following ``include``) and apply ``section.field=value`` overrides."""
    return recipe_from_dict(read_recipe_data(path), overrides)


def to_dict(obj: Any) -> Any:
    """A recipe (or any config dataclass) as plain YAML-able data."""
    return dataclasses.asdict(obj)
