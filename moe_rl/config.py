"""The recipe: frozen, keyword-only configuration dataclasses, one per concern, and its loader.

A recipe is a YAML file whose top-level keys are the sections of :class:`Recipe`
(``model``, ``parallel``, ``optim``, ``checkpoint``, ``algo``, ...). Command-line
overrides are ``section.field=value`` strings parsed as YAML scalars.

Every field carries a one-line docstring (the string literal after it). Choice fields are
``Literal`` types, checked by ``moe_rl.configlib`` (which also holds the loader machinery);
the task sections live beside the tasks, in ``moe_rl.tasks.config``, the SGLang section in
``moe_rl.sglang_config``, the train and sentinel sections in ``moe_rl.train_config``. Registered names (losses, tasks, corrections) are checked against the
plain lists of ``moe_rl.names``, so importing this module imports no torch. Validation lives in
``__post_init__`` and names the field and the fix; cross-section checks live in
:meth:`Recipe.__post_init__` so they run before any process group starts.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Literal

from moe_rl.configlib import ConfigError as ConfigError  # re-exported with to_dict: callers import them here
from moe_rl.configlib import build_dataclass as build_dataclass
from moe_rl.configlib import (
    check_choices,
    check_text,
    check_type,
    parse_overrides,
    require,
    require_in,
    require_positive,
    require_registered,
    require_seed,
    resolve_paths,
    set_path,
)
from moe_rl.configlib import read_yaml_with_includes as read_recipe_data
from moe_rl.configlib import to_dict as to_dict
from moe_rl.hf_arch import with_hf_architecture
from moe_rl.names import (
    DEFAULT_BOUNDS,
    LOSS_NAMES,
    PAPER_CLIP,
    TOKEN_LEVEL,
    TOKEN_RATIO_LOSSES,
)
from moe_rl.routing import RoutingMode
from moe_rl.sglang_config import SGLangConfig
from moe_rl.tasks.config import TaskConfig
from moe_rl.tasks.tokenizer import model_tokenizer
from moe_rl.train_config import SentinelConfig as SentinelConfig  # re-exported: callers import sections here
from moe_rl.train_config import TrainConfig as TrainConfig

RECIPE_PATHS = (
    "model.tokenizer",
    "model.hf_path",
    "checkpoint.load",
    "task.jsonl.path",
    "task.jsonl.heldout_path",
    "task.jsonl.reward_fn",
    "rollout.sglang.model_path",
)
"""The recipe keys naming files the run reads. Written in a recipe file, a relative one is relative
to that file's folder; given on the command line (an override) or in a dict built in Python, to the
current folder; either is made absolute as the recipe loads (so the recipe.yaml a run saves reads
the same files from anywhere). Where a run writes (train.out_dir, checkpoint.dir,
rollout.weight_sync_dir) stays relative to the current folder: ``moe-rl train recipes/x.yaml``
writes under ./runs, not recipes/."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Qwen3-MoE-style decoder (RMSNorm, QK-norm, RoPE, SwiGLU experts, softmax top-k router)."""

    vocab_size: int = 104
    "Vocabulary size: at least the tokenizer's, divisible by parallel.tensor_parallel."
    tokenizer: str | None = None
    "char (the built-in character tokenizer, 104 ids) or a local Hugging Face tokenizer directory; None: model.hf_path's own (its tokenizer.json; char when it has none, said in one line), char without model.hf_path."
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
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
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
    dtype: Literal["float32", "bfloat16"] = "float32"
    "Parameter and compute dtype: float32 | bfloat16 (bfloat16 needs CUDA)."
    recompute: bool = False
    "Full activation recompute of every layer in backward (saves memory)."
    logprob_impl: Literal["auto", "logits", "torch", "triton"] = "auto"
    "Log-prob pass: auto (fused vocab-chunked Triton kernel on CUDA, full logits elsewhere) | logits | torch (chunked reference) | triton."
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    "Layer spec: auto (transformer-engine when installed and CUDA present) | local | transformer_engine."
    seed: int = 1234
    "Seed of the weight initialisation."
    hf_path: str | None = None
    "Local Hugging Face Qwen3-MoE checkpoint to start from (None: random init)."

    def __post_init__(self) -> None:
        if (
            self.tokenizer is None
        ):  # the model's own, as verl and TRL take it (a blank hf_path: its own error)
            hf = self.hf_path if self.hf_path and self.hf_path.strip() else None
            object.__setattr__(self, "tokenizer", model_tokenizer(hf))
        check_choices(self, "model")
        require_positive(self, "model", "vocab_size", "hidden_size", "num_layers", "num_attention_heads")
        require_positive(self, "model", "num_query_groups", "head_dim", "moe_ffn_hidden_size", "num_experts")
        require_positive(self, "model", "moe_router_topk", "max_seq_len")
        require_positive(self, "model", "rope_theta", "norm_eps", "init_std")
        require_positive(self, "model", "moe_aux_loss_coeff", "moe_z_loss_coeff", strict=False)
        require_seed(self, "model", "seed")
        require(bool(self.tokenizer), "model.tokenizer is empty: use char or a tokenizer directory")
        require(self.hf_path != "", "model.hf_path is empty: give a checkpoint directory or null")
        require(
            self.moe_router_topk <= self.num_experts,
            f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_experts="
            f"{self.num_experts}: choose topk <= num_experts",
        )
        require(
            self.moe_router_topk >= 2 or not self.moe_norm_topk_prob,
            "model.moe_router_topk=1 with model.moe_norm_topk_prob=true gives every token gate weight 1, "
            "which megatron-core's router refuses: use moe_router_topk >= 2, or moe_norm_topk_prob=false "
            "(softmax over all experts)",
        )
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={self.num_query_groups}",
        )
        check_text(self, "model")


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
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    "torch.distributed backend: auto (nccl with CUDA, gloo without) | gloo | nccl."
    timeout_s: float = 600.0
    "Timeout of every collective, seconds."

    def __post_init__(self) -> None:
        check_choices(self, "parallel")
        for name in ("tensor_parallel", "expert_parallel", "pipeline_parallel", "data_parallel"):
            require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        require_positive(self, "parallel", "timeout_s")
        require(
            self.pipeline_parallel == 1,
            f"parallel.pipeline_parallel={self.pipeline_parallel}: pipeline parallelism is not "
            "supported yet; set parallel.pipeline_parallel=1 and use tensor/expert/data parallelism",
        )
        require(
            (self.tensor_parallel * self.data_parallel) % self.expert_parallel == 0,
            f"parallel.expert_parallel={self.expert_parallel} must divide tensor_parallel x "
            f"data_parallel = {self.tensor_parallel * self.data_parallel}",
        )
        check_text(self, "parallel")

    @property
    def world_size(self) -> int:
        """Processes this layout needs."""
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """megatron-core's Adam (decoupled weight decay) behind its DistributedDataParallel, with
    global-norm gradient clipping, a warmup + decay LR schedule and fp32 main weights."""

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
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    "constant | linear | cosine."
    distributed: Literal["auto"] | bool = "auto"
    "megatron-core's distributed optimizer (ZeRO-1: fp32 main weights and Adam moments sharded over data-parallel ranks, experts over expert-data-parallel ranks): auto (on where data_parallel > 1) | true | false."
    grad_reduce_in_fp32: bool = True
    "Accumulate and reduce gradients in fp32 (DDP's grad buffers) whatever the parameter dtype."
    overlap_grad_reduce: bool = True
    "Overlap DDP's bucketed gradient reduction with backward (GPU only; CPU reduces at the step)."
    overlap_param_gather: bool = False
    "Defer the distributed optimizer's weight all-gather into the next forward (GPU only; off by default: the embedded engine's lean decoder reads weights without a forward)."
    bucket_size: int | None = None
    "DDP bucket size in elements when overlapping (None: megatron-core's default, max(4e7, 1e6 x DP))."

    def __post_init__(self) -> None:
        check_choices(self, "optim")
        require(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        require_positive(self, "optim", "adam_eps")
        require_positive(self, "optim", "weight_decay", strict=False)
        for name in ("beta1", "beta2"):
            require_in(self, "optim", name, 0, 1, "[0, 1)")
        require(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must be in [0, optim.lr]")
        require(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")
        require(
            self.warmup_steps >= 0 and self.decay_steps >= 0,
            "optim.warmup_steps and optim.decay_steps must be >= 0",
        )
        require(
            self.bucket_size is None or self.bucket_size > 0,
            f"optim.bucket_size must be positive or null, got {self.bucket_size}",
        )
        check_text(self, "optim")


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
        check_choices(self, "checkpoint")
        require(self.every >= 0, f"checkpoint.every must be >= 0, got {self.every}")
        for name in ("dir", "load"):
            require(getattr(self, name) != "", f"checkpoint.{name} is empty: give a directory or null")
        require(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")
        check_text(self, "checkpoint")


LossAggregation = Literal["seq_mean", "token_mean"]
LOSS_AGGREGATIONS = typing.get_args(LossAggregation)
RolloutCorrection = Literal["none", "tis", "seq_tis", "icepop", "icepop_mask", "geo_mask"]
"moe_rl.names.CORRECTIONS as a config choice (a test checks they agree)."


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """Policy-gradient algorithm, clip band, KL, routing replay and rollout correction (docs/algorithms.md)."""

    moved_keys: ClassVar[dict[str, str]] = {"beta": "kl_coef"}
    "algo.beta (the KL coefficient before the trainer built a reference) is algo.kl_coef."

    name: str = "gspo"
    "Loss in moe_rl.losses.LOSSES (names in moe_rl.names.LOSS_NAMES): grpo | gspo | gspo_token."
    eps_low: float | None = None
    "Lower clip: ratio >= 1 - eps_low (None: the paper value, moe_rl.names.PAPER_CLIP: grpo 0.2, gspo 3e-4)."
    eps_high: float | None = None
    "Upper clip: ratio <= 1 + eps_high (None: the paper value, moe_rl.names.PAPER_CLIP: grpo 0.27, gspo 4e-4)."
    clip_ratio_c: float | None = None
    "Dual-clip constant c > 1: for A < 0 the objective is at least c * A (verl's clip_ratio_c in its vanilla loss, slime's eps_clip_c; TRL's delta only when delta >= 1 + eps_high; verl's GSPO has none); None: off."
    aggregation: LossAggregation = "seq_mean"
    "seq_mean (mean over tokens of a sequence, then over sequences) | token_mean (all tokens equal)."
    kl_coef: float = 0.0
    "Coefficient of the KL(pi_theta || pi_ref) loss term, pi_ref the RL stage's starting weights, frozen (verl's actor.use_kl_loss with kl_loss_coef, TRL's beta); 0: off (GSPO's authors and verl's default); docs/algorithms.md#kl-to-a-reference."
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    "Estimator of the KL term and of the reward penalty, with d = log pi_ref - log pi_theta: k1 = -d | k2 = d^2/2 | k3 = e^d - 1 - d (verl's kl_loss_type kl | mse | low_var_kl; TRL's beta: k3)."
    kl_reward_coef: float = 0.0
    "KL in the reward instead (or as well): each sequence's reward minus kl_reward_coef times the sum over its tokens of algo.kl_estimator of pi_old against pi_ref, before the group advantages (verl's algorithm.use_kl_in_reward with kl_ctrl.kl_coef); 0: off."
    adv_eps: float = 1e-6
    "Epsilon in A_i = (r_i - mean) / (std + eps)."
    adv_std_normalize: bool = True
    "Divide group-centred rewards by the group std (false: Dr.GRPO-style centring only)."
    adv_std_unbiased: bool = True
    "Group std with Bessel's correction, as torch.std, verl and TRL (false: population std)."
    routing: RoutingMode = RoutingMode.NONE
    "Routing replay (moe_rl.routing.RoutingMode): none | r2 (replay trainer-recorded routes) | r3 (replay rollout-engine routes)."
    replay_gate_weights: bool = False
    "R3 only: also replay the gate weights the engine mixed the experts with (Rollouts.gates_BTLK; the embedded engine returns them, SGLang does not), in the pi_old recompute and in training, instead of recomputing them from the live router; used straight through (the backward takes the live gates' gradient), so the router keeps learning (docs/algorithms.md#replayed-gate-weights)."
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    "Source of pi_old log-probs: recompute (trainer forward) | rollout (engine log-probs, bypass mode)."
    rollout_correction: RolloutCorrection = "none"
    "Train-inference mismatch correction by rho = pi_old / pi_rollout: none | tis | seq_tis | icepop (rho where kept) | icepop_mask (1 where kept) | geo_mask."
    correction_c: float = 2.0
    "Truncation C >= 1 of tis and seq_tis: weights min(rho, C)."
    correction_low: float | None = None
    "Lower ratio bound of icepop, icepop_mask and geo_mask (None: icepop and icepop_mask 0.5, geo_mask 1/1.001)."
    correction_high: float | None = None
    "Upper ratio bound of icepop, icepop_mask and geo_mask (None: icepop and icepop_mask 5.0, geo_mask 1.001)."

    def __post_init__(self) -> None:
        check_choices(self, "algo")
        require_registered(self.name, LOSS_NAMES, "algo.name")
        require_positive(self, "algo", "kl_coef", "kl_reward_coef", strict=False)
        require(
            self.adv_eps > 0 if self.adv_std_normalize else self.adv_eps >= 0,
            f"algo.adv_eps={self.adv_eps} must be > 0: A = (r - mean) / (std + eps) needs a positive eps "
            "(a negative one flips the advantage signs, 0 divides by 0 in a group of equal rewards)",
        )
        require(
            not self.replay_gate_weights or self.routing.wants_engine_routes,
            f"algo.replay_gate_weights=true replays the rollout engine's gate weights with its routes, which "
            f"only R3 replays (algo.routing={self.routing}): set algo.routing=r3 or algo.replay_gate_weights=false",
        )
        if self.eps_low is not None:
            require(0 <= self.eps_low < 1, f"algo.eps_low={self.eps_low} must be in [0, 1)")
        if self.eps_high is not None:
            require(self.eps_high >= 0, f"algo.eps_high={self.eps_high} must be >= 0")
        require(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            f"algo.clip_ratio_c={self.clip_ratio_c} must be > 1 (verl uses 3.0); "
            "set algo.clip_ratio_c=null to turn dual-clip off",
        )
        self._check_correction()
        check_text(self, "algo")

    def _check_correction(self) -> None:
        corr = self.rollout_correction
        require(
            corr == "none" or self.old_logprobs == "recompute",
            f"algo.rollout_correction={corr} with algo.old_logprobs=rollout: bypass mode: pi_old is the "
            "rollout policy, rho = 1; set algo.old_logprobs=recompute or algo.rollout_correction=none",
        )
        require(
            corr not in TOKEN_LEVEL or self.name in TOKEN_RATIO_LOSSES,
            f"algo.rollout_correction={corr} weights or masks single tokens but algo.name={self.name} clips one "
            "ratio per sequence: use algo.name=gspo_token, or algo.rollout_correction=seq_tis or geo_mask",
        )
        require(
            self.correction_c >= 1,
            f"algo.correction_c={self.correction_c} must be >= 1 (verl's default is 2.0)",
        )
        low, high = self.correction_bounds
        require(
            0 < low < high,
            f"algo.correction_low={low} and algo.correction_high={high} must satisfy 0 < low < high",
        )

    @property
    def clip_low(self) -> float:
        """eps_low, or the paper value for the algorithm (moe_rl.names.PAPER_CLIP, as in LOSSES)."""
        return PAPER_CLIP[self.name][0] if self.eps_low is None else self.eps_low

    @property
    def clip_high(self) -> float:
        """eps_high, or the paper value for the algorithm (moe_rl.names.PAPER_CLIP, as in LOSSES)."""
        return PAPER_CLIP[self.name][1] if self.eps_high is None else self.eps_high

    @property
    def correction_bounds(self) -> tuple[float, float]:
        """(low, high) ratio bounds of icepop / icepop_mask / geo_mask, defaults filled in (icepop's for other modes)."""
        dlow, dhigh = DEFAULT_BOUNDS.get(self.rollout_correction, DEFAULT_BOUNDS["icepop"])
        return (
            dlow if self.correction_low is None else self.correction_low,
            dhigh if self.correction_high is None else self.correction_high,
        )


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Which engine samples the rollouts, at what precision, and how its weights are kept current."""

    moved_keys: ClassVar[dict[str, str]] = {
        f"sglang_{f.name}": f"sglang.{f.name}" for f in fields(SGLangConfig)
    }
    "Every rollout.sglang_<x> key of the flat layout moved to rollout.sglang.<x>."

    engine: Literal["embedded", "sglang"] = "embedded"
    "Engine in moe_rl.rollout.ROLLOUT_ENGINES: embedded (in-process, every machine) | sglang."
    embedded_decoder: Literal["auto", "lean", "megatron"] = "auto"
    "Forward of the embedded engine: lean (moe_rl.megatron.decode; TP=1) | megatron | auto (lean where it runs)."
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    "Precision the engine serves: auto (SGLang: bf16; the embedded engine and moe-rl serve: the policy's own) | fp32 | bf16 | fp16."
    router_dtype: Literal["same", "fp32"] = "same"
    "Router logits and softmax of the engine: same (as rollout.dtype) | fp32 (kept in fp32)."
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    "The SGLang server (engine=sglang)."
    weight_sync: Literal["distributed", "disk", "tensor"] = "distributed"
    "How new weights reach SGLang: distributed (NCCL/gloo broadcast) | disk (HF safetensors) | tensor (colocated)."
    weight_sync_dir: str | None = None
    "Directory for disk weight sync (None: <out_dir>/weights)."
    timeout_s: float = 600.0
    "Timeout of one engine request, seconds."
    retries: int = 3
    "Retries of a failed request (connection errors and 5xx only)."
    verify_every: int = 10
    "Check the first push and every N-th: each engine's and the trainer's scores of the same tokens, and read-back by name where the engine has it (0: never; SGLang engines)."
    verify_tolerance: float | None = None
    "Largest mean |log-prob difference| the push check allows (None: by precision, fp32 1e-3, fp16 4e-3, bf16 2e-2)."
    route_noise: float = 0.0
    "Selection noise of the engine's routers: sigma of Gaussian noise on the router logits its top-k is taken from, gates from the clean logits (embedded engine; 0: off; docs/algorithms.md#routing-noise)."

    def __post_init__(self) -> None:
        check_choices(self, "rollout")
        require_positive(self, "rollout", "timeout_s", "verify_tolerance")
        require(self.retries >= 0, f"rollout.retries={self.retries} must be >= 0")
        require(self.verify_every >= 0, f"rollout.verify_every={self.verify_every} must be >= 0 (0: never)")
        require_positive(self, "rollout", "route_noise", strict=False)
        require(
            self.route_noise == 0 or self.engine == "embedded",
            f"rollout.route_noise={self.route_noise} emulates routing noise in the embedded engine; an SGLang "
            "server routes with its own numerics: set rollout.route_noise=0 or rollout.engine=embedded",
        )
        require(self.weight_sync_dir != "", "rollout.weight_sync_dir is empty: give a directory or null")
        require(
            self.weight_sync != "tensor" or self.sglang.colocate,
            "rollout.weight_sync=tensor hands SGLang CUDA-IPC handles: it needs rollout.sglang.colocate=true",
        )
        require(
            not (self.sglang.colocate and self.weight_sync == "distributed"),
            "rollout.sglang.colocate=true with rollout.weight_sync=distributed: trainer rank 0 and the "
            "engine's first TP rank would join one NCCL group on the same GPU, which NCCL refuses "
            "('Duplicate GPU detected'); set rollout.weight_sync=tensor (CUDA IPC, as verl and slime) or disk",
        )
        check_text(self, "rollout")

    @property
    def colocated(self) -> bool:
        """SGLang engines on the trainer's own GPUs (``engine=sglang`` with ``sglang.colocate``)."""
        return self.engine == "sglang" and self.sglang.colocate


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
        require(
            m.num_experts % p.expert_parallel == 0,
            f"model.num_experts={m.num_experts} is not divisible by parallel.expert_parallel="
            f"{p.expert_parallel}: pick an expert_parallel that divides it",
        )
        require(
            m.num_attention_heads % p.tensor_parallel == 0,
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"parallel.tensor_parallel={p.tensor_parallel}",
        )
        require(
            m.num_query_groups % p.tensor_parallel == 0,
            f"model.num_query_groups={m.num_query_groups} is not divisible by "
            f"parallel.tensor_parallel={p.tensor_parallel}",
        )
        require(
            m.vocab_size % p.tensor_parallel == 0,
            f"model.vocab_size={m.vocab_size} is not divisible by parallel.tensor_parallel="
            f"{p.tensor_parallel}: pad the vocabulary",
        )
        b = self.train.prompts_per_step * self.train.group_size
        require(
            b % (p.data_parallel * self.train.minibatches) == 0,
            f"the rollout batch ({b}) must split into train.minibatches={self.train.minibatches} "
            f"x parallel.data_parallel={p.data_parallel} equal shares",
        )
        require(
            self.train.sft_batch_size % p.data_parallel == 0,
            f"train.sft_batch_size={self.train.sft_batch_size} must be divisible by "
            f"parallel.data_parallel={p.data_parallel}",
        )
        require(
            not self.algo.replay_gate_weights or self.rollout.engine == "embedded",
            "algo.replay_gate_weights=true needs the engine's gate weights (Rollouts.gates_BTLK), which an "
            "SGLang engine does not return (return_routed_experts gives expert ids only): use "
            "rollout.engine=embedded or set algo.replay_gate_weights=false",
        )
        require(
            self.train.route_noise == 0 or not m.recompute,
            f"train.route_noise={self.train.route_noise} with model.recompute=true: the recomputed forward "
            "would draw new noise and route differently from the forward it recomputes; set one of them off",
        )
        require(
            m.dtype == "float32" or p.backend != "gloo",
            "model.dtype=bfloat16 needs CUDA (nccl); set model.dtype=float32 on CPU",
        )
        # known before anything trains (they used to fail when the RL stage began, after SFT)
        require(
            self.task.name != "jsonl"
            or "sft" not in self.train.stages
            or bool(self.task.jsonl.response_field),
            "train.stages includes sft but the jsonl task has no demonstrations: set "
            "task.jsonl.response_field to the key holding a reference response, or train.stages=[rl]",
        )

    @property
    def rollout_dtype(self) -> str:
        """The precision the rollout engine serves (``rollout.dtype``, auto resolved): SGLang's
        ``launch_server`` bf16 (what verl and slime serve); the embedded engine and ``moe-rl serve``
        (``rollout.sglang.module=moe_rl.serve.embedded``, the CPU stand-in) the policy's own."""
        if self.rollout.dtype != "auto":
            return self.rollout.dtype
        if self.rollout.engine == "sglang" and self.rollout.sglang.module == "sglang.launch_server":
            return "bf16"
        return "bf16" if self.model.dtype == "bfloat16" else "fp32"


# ---------------------------------------------------------------------------------------
# Loading: YAML mapping (with includes) + overrides -> Recipe (moe_rl.configlib refuses what is wrong).


def recipe_from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Build a :class:`Recipe` from a parsed YAML mapping plus overrides. Relative paths of
    :data:`RECIPE_PATHS` left in it (overrides, a mapping built in code) are made absolute against
    the current folder (:func:`load_recipe` has made a file's own absolute against its folder).

    With ``model.hf_path``, the model's architecture fields the recipe leaves unset are read from
    that folder's ``config.json``, and one it sets that disagrees is refused
    (:func:`moe_rl.hf_arch.with_hf_architecture`)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (data or {}).items()}
    for k, v in parse_overrides(overrides):
        set_path(data, k, v)
    # what is still relative (an override, a dict built in Python) is relative to the current folder;
    # made absolute now, so that the recipe.yaml a run saves names the same files from anywhere
    data = resolve_paths(data, os.getcwd(), RECIPE_PATHS)
    if isinstance(data.get("algo"), dict) and data["algo"].get("beta") in (0, 0.0):
        del data["algo"]["beta"]  # every recipe.yaml saved before algo.kl_coef holds algo.beta: 0.0
    if isinstance(data.get("model"), dict):
        data["model"] = with_hf_architecture(data["model"], _model_field)
    return build_dataclass(Recipe, data)


def _model_field(name: str, value: object) -> object:
    """``value`` as ModelConfig's field ``name`` holds it (a YAML ``1e-6`` string as a float)."""
    return check_type(value, typing.get_type_hints(ModelConfig)[name], f"model.{name}")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a YAML recipe (following ``include``) and apply ``section.field=value`` overrides. The
    files it names (:data:`RECIPE_PATHS`) are relative to the recipe file's folder; overrides' to the
    current folder."""
    return recipe_from_dict(read_recipe_data(path, RECIPE_PATHS), overrides)
