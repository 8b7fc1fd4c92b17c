"""The one adapter from moe-rl's ModelConfig to megatron-core: TransformerConfig + layer spec.

Qwen3-MoE architecture: RMSNorm, QK-norm, RoPE, SwiGLU experts, softmax top-k router
renormalised over the chosen experts (``moe_router_pre_softmax=False``: softmax over the
top-k logits), no shared expert, no biases. Every layer is an MoE layer.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moe_rl.config import ModelConfig, ParallelConfig

log = logging.getLogger(__name__)


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm that accepts sequence parallelism.

    megatron-core's WrappedTorchNorm asserts ``not config.sequence_parallel`` (0.16.1,
    0.19.2). A norm is elementwise along the sequence, so SP only needs its parameters
    tagged ``sequence_parallel`` so that their gradients are all-reduced across TP ranks.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_ignored) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)


def use_transformer_engine(cfg: ModelConfig) -> bool:
    """Whether to build the transformer-engine spec (needs CUDA and the package)."""
    if cfg.transformer_impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401

        have_te = True
    except Exception:  # ImportError, or a broken install without CUDA
        have_te = False
    if cfg.transformer_impl == "transformer_engine":
        if not (have_te and torch.cuda.is_available()):
            raise RuntimeError(
                "model.transformer_impl=transformer_engine needs CUDA and the "
                "transformer-engine package (pip install 'moe-rl[gpu]'); "
                "set model.transformer_impl=local"
            )
        return True
    return have_te and torch.cuda.is_available()


def transformer_config(cfg: ModelConfig, par: ParallelConfig):
    """megatron-core TransformerConfig for the policy."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    recompute = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if cfg.recompute
        else {}
    )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.moe_ffn_hidden_size,
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher,
        moe_grouped_gemm=False,
        moe_enable_routing_replay=True,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=cfg.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=par.tensor_parallel,
        expert_model_parallel_size=par.expert_parallel,
        expert_tensor_parallel_size=1,
        sequence_parallel=par.tensor_parallel > 1,
        pipeline_dtype=dtype,
        **recompute,
    )


def layer_spec(cfg: ModelConfig, config, *, stock_local: bool = False):
    """Transformer-engine block spec on GPU when available, else the local spec with our norm,
    SDPA attention and grouped experts (``stock_local``: megatron's own local modules, the
    reference the tests compare them with)."""
    if use_transformer_engine(cfg):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        log.info("building the transformer-engine layer spec")
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_norm, normalization="RMSNorm"
    )
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if not stock_local:
        from moe_rl.megatron.local_layers import GroupedExperts, SDPAttention

        sub.self_attention.submodules.core_attention = SDPAttention
        sub.mlp.submodules.experts.module = GroupedExperts
    if cfg.qk_norm:
        sub.self_attention.submodules.q_layernorm = RMSNorm
        sub.self_attention.submodules.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * cfg.num_layers, layer_norm=RMSNorm)


def build_gpt(cfg: ModelConfig, par: ParallelConfig, *, stock_local: bool = False):
    """Build the megatron-core GPTModel (after :func:`moe_rl.megatron.parallel.init_parallel`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # Routers register their RouterReplay in a class-level list; a second model in one
    # process would join the same list. Each Policy keeps its own routers instead.
    RouterReplay.clear_global_router_replay_instances()
    config = transformer_config(cfg, par)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(cfg, config, stock_local=stock_local),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        position_embedding_type="rope",
        rotary_base=cfg.rope_theta,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        parallel_output=True,
    )
    RouterReplay.clear_global_router_replay_instances()
    for name, p in model.named_parameters():
        # Experts are replicated over the expert-data-parallel group whatever EP is (under
        # TP with expert-TP 1 each TP rank routes only its sequence-parallel share of the
        # tokens, so their gradients differ across TP ranks); megatron-core tags them
        # allreduce=False (reduced by its DDP over the expert-data-parallel group) only when
        # EP > 1 (0.16.1: tensor_parallel/layers.py), which under TP=2, EP=1 would reduce them
        # over the data-parallel group alone and leave out the other TP rank's tokens.
        p.moe_expert = ".mlp.experts." in name
        if p.moe_expert:
            p.allreduce = False
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def moe_routers(model) -> list:
    """The TopKRouter of every MoE layer, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]
