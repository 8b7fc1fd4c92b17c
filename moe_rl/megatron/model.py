"""The one adapter from moe-rl's ModelConfig to megatron-core: TransformerConfig + layer spec.

Qwen3-MoE architecture: RMSNorm, QK-norm, RoPE, SwiGLU experts, softmax top-k router
renormalised over the chosen experts (``moe_router_pre_softmax=False``: softmax over the
top-k logits), no shared expert, no biases. Every layer is an MoE layer.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

import torch
import torch.nn.functional as F

from moe_rl.config import ModelConfig, ParallelConfig
from moe_rl.megatron import rope
from moe_rl.megatron.deferred_compile import compile_here

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


def _have(module: str, *names: str) -> bool:
    """Whether ``module`` imports and binds every one of ``names`` to something (megatron-core
    sets a fused kernel it could not import to None)."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # ImportError, or a broken CUDA extension
        return False
    return all(getattr(mod, n, None) is not None for n in names)


def fusions(cfg: ModelConfig, par: ParallelConfig) -> dict[str, tuple[bool, str]]:
    """megatron-core's fusion switches for this build, each on where its kernel exists here:
    ``{switch: (on, what runs / why not)}``. :func:`transformer_config` applies them and
    :func:`build_gpt` logs them in one line."""
    cuda = torch.cuda.is_available()
    te = use_transformer_engine(cfg)
    rope_fused = cuda and _have(
        "megatron.core.models.common.embeddings.rope_utils", "fused_apply_rotary_pos_emb_thd"
    )
    permute = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_unpermute")
    permute_fused = cuda and te and _have("megatron.core.transformer.moe.moe_utils", *permute)
    apex_wgrad = cuda and _have("fused_weight_gradient_mlp_cuda")
    compiled = compile_here()
    from moe_rl.megatron.local_layers import grouped_mm_ok

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    grouped = grouped_mm_ok(torch.empty(0, dtype=dtype, device="cuda" if cuda else "cpu"))
    return {
        "moe_grouped_gemm": (
            True,
            "GroupedExperts, one parameter per projection: "
            + (
                "torch._grouped_mm"
                if grouped
                else f"a per-expert loop (no torch._grouped_mm for {dtype} here)"
            ),
        ),
        "gradient_accumulation_fusion": (
            te or apex_wgrad,
            "weight gradients accumulate into DDP's main_grad in the GEMM"
            if te or apex_wgrad
            else "needs transformer-engine's or apex's wgrad kernels",
        ),
        "moe_permute_fusion": (
            permute_fused,
            "transformer-engine's fused permute"
            if permute_fused
            else "needs transformer-engine >= 2.1 on CUDA",
        ),
        "moe_router_fusion": (
            False,
            "off: routing replay and route capture take megatron-core's unfused top-k (RouterReplay)",
        ),
        "apply_rope_fusion": (
            rope_fused,
            "transformer-engine's fused RoPE" if rope_fused else "needs transformer-engine on CUDA",
        ),
        "bias_activation_fusion": (
            compiled,
            "megatron-core's fused weighted SwiGLU (torch.compile)" if compiled else "needs CUDA and Triton",
        ),
        "masked_softmax_fusion": (False, "n/a: attention runs SDPA (local) or transformer-engine's own"),
        "persist_layer_norm": (False, "n/a: the norms are torch's RMSNorm (local) or transformer-engine's"),
    }


def describe_build(cfg: ModelConfig, par: ParallelConfig, switches: dict[str, tuple[bool, str]]) -> str:
    """The one log line :func:`build_gpt` writes: the layer spec, the dispatcher, each switch."""
    spec = "transformer-engine" if use_transformer_engine(cfg) else "local"
    on = [f"{k} ({why})" for k, (v, why) in switches.items() if v]
    off = [f"{k} ({why})" for k, (v, why) in switches.items() if not v]
    return (
        f"policy build: {spec} layer spec, {cfg.moe_token_dispatcher} token dispatcher "
        f"(EP {par.expert_parallel}); on: {'; '.join(on) or 'none'}; off: {'; '.join(off) or 'none'}"
    )


def transformer_config(cfg: ModelConfig, par: ParallelConfig):
    """megatron-core TransformerConfig for the policy.

    Random init (``cfg.seed``) runs on CPU: megatron-core then draws each TP-split weight in full
    and slices it, so every layout gets the same weights. With ``cfg.hf_path`` the import fills
    every parameter (``hf.import_hf`` checks each one is written in full), so nothing is drawn:
    parameters are allocated uninitialised, directly on the GPU where there is one.
    """
    from megatron.core.transformer import TransformerConfig

    from_hf = bool(cfg.hf_path)
    switches = {k: on for k, (on, _) in fusions(cfg, par).items()}

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
        use_cpu_initialization=not (from_hf and torch.cuda.is_available()),
        perform_initialization=not from_hf,
        **switches,
        tensor_model_parallel_size=par.tensor_parallel,
        expert_model_parallel_size=par.expert_parallel,
        expert_tensor_parallel_size=1,
        sequence_parallel=par.tensor_parallel > 1,
        pipeline_dtype=dtype,
        **recompute,
    )


def megatron_core_version() -> str:
    """The installed megatron-core's version (for messages)."""
    try:
        from megatron.core import __version__

        return str(__version__)
    except ImportError:
        return "unknown"


def spec_module(spec):
    """The class a layer-spec entry builds: a ``ModuleSpec``'s ``module``, a ``functools.partial``'s
    function (megatron-core >= 0.17 builds some submodules from partials), or the class itself."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    while isinstance(spec, ModuleSpec | functools.partial):
        spec = spec.module if isinstance(spec, ModuleSpec) else spec.func
    return spec


def spec_submodules(spec):
    """The submodules dataclass of a layer-spec entry (``ModuleSpec.submodules``, or the
    ``submodules=`` keyword of a ``functools.partial``); None when it has none."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return spec.submodules
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return None


def replace_spec(spec, module=None, **submodules):
    """A copy of the layer-spec entry ``spec`` that builds ``module`` (when given) with the named
    fields of its submodules replaced; ``spec`` itself is left as it was.

    megatron-core's specs are ``ModuleSpec`` dataclasses up to 0.16 and, for the MLP / MoE layer
    and its experts, ``functools.partial(cls, submodules=...)`` from 0.17 on (a partial has no
    ``module`` or ``submodules`` to set: an assignment either raises or lands on the partial's
    ``__dict__`` and is never read). Both shapes are rebuilt here; any other raises."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def fields(sub):
        if not submodules:
            return sub
        if sub is None or not dataclasses.is_dataclass(sub):
            raise TypeError(
                f"{spec!r} has no submodules dataclass to set {sorted(submodules)} on "
                f"(megatron-core {megatron_core_version()})"
            )
        return dataclasses.replace(sub, **submodules)

    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=module or spec.module, submodules=fields(spec.submodules))
    if isinstance(spec, functools.partial):
        kw = dict(spec.keywords)
        if submodules:
            kw["submodules"] = fields(kw.get("submodules"))
        return functools.partial(module or spec.func, *spec.args, **kw)
    if isinstance(spec, type) and module is not None and not submodules:
        return module
    raise TypeError(
        f"cannot override the layer-spec entry {spec!r} (megatron-core {megatron_core_version()}): "
        "neither a ModuleSpec nor a functools.partial"
    )


def _grouped_experts(layer):
    """A layer spec whose MoE experts are :class:`GroupedExperts` (in place of ``SequentialMLP``)."""
    from moe_rl.megatron.local_layers import GroupedExperts

    mlp = layer.submodules.mlp
    mlp = replace_spec(mlp, experts=replace_spec(spec_submodules(mlp).experts, GroupedExperts))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def layer_spec(cfg: ModelConfig, config, *, stock_local: bool = False):
    """Transformer-engine block spec on GPU when available, else the local spec with our norm and
    SDPA attention; :class:`GroupedExperts` experts in both (``stock_local``: megatron's own local
    modules, ``SequentialMLP`` experts included, the reference the tests compare them with)."""
    if use_transformer_engine(cfg):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
        return dataclasses.replace(block, layer_specs=[_grouped_experts(s) for s in block.layer_specs])
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_norm, normalization="RMSNorm"
    )
    attention = {}
    if not stock_local:
        from moe_rl.megatron.local_layers import SDPAttention

        attention["core_attention"] = SDPAttention
        spec = _grouped_experts(spec)
    sub = spec.submodules
    if cfg.qk_norm:
        attention.update(q_layernorm=RMSNorm, k_layernorm=RMSNorm)
    sub = dataclasses.replace(
        sub,
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
        self_attention=replace_spec(sub.self_attention, **attention),
    )
    spec = dataclasses.replace(spec, submodules=sub)
    return TransformerBlockSubmodules(layer_specs=[spec] * cfg.num_layers, layer_norm=RMSNorm)


def check_built(model, cfg: ModelConfig, *, stock_local: bool = False) -> None:
    """Raise when the built model lacks the modules :func:`layer_spec` asked for: GroupedExperts
    experts in every layer (either spec); with the local spec also SDPAttention and our RMSNorm for
    every norm. A spec
    override that did not take (a megatron-core whose spec shape is new) builds a model that
    runs, slower and on other code paths; this makes it an error naming the version."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from moe_rl.megatron.local_layers import GroupedExperts, SDPAttention

    wrong = []

    def want(module, attr, cls):
        got = getattr(module, attr, None)
        if not isinstance(got, cls):
            wrong.append(f"{attr}: {type(got).__name__}, not {cls.__name__}")

    local = not use_transformer_engine(cfg)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers if local else ():
        want(layer, "input_layernorm", RMSNorm)
        want(layer, "pre_mlp_layernorm", RMSNorm)
    attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
    moes = [m for m in model.modules() if isinstance(m, MoELayer)]
    for attn in attentions if local else ():
        if not stock_local:
            want(attn, "core_attention", SDPAttention)
        if cfg.qk_norm:
            want(attn, "q_layernorm", RMSNorm)
            want(attn, "k_layernorm", RMSNorm)
    for moe in moes:
        if not stock_local:
            want(moe, "experts", GroupedExperts)
    n = len(layers)
    if len(attentions) != n or len(moes) != n:
        wrong.append(f"{n} layers, {len(attentions)} self-attentions, {len(moes)} MoE layers")
    if wrong:
        raise RuntimeError(
            f"megatron-core {megatron_core_version()} built a model other than the local layer spec "
            f"asked for ({'; '.join(sorted(set(wrong)))}): moe_rl.megatron.model.layer_spec does not "
            "know this version's spec shape"
        )


class _GPTModelDeprecation(logging.Filter):
    """Drops megatron-core 0.19's "GPTModel IS DEPRECATED" warning, logged at every GPTModel.

    Its recommendation, ``HybridModel`` (megatron-core's hybrid-model migration guide), is a
    different module tree: other parameter names, so other checkpoint keys,
    HF mapping and decoders, and absent from 0.16-0.18, which moe-rl also runs. GPTModel still
    receives critical fixes there, so moe-rl keeps it and silences just this one record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("GPTModel IS DEPRECATED")


def _quiet_gpt_model_deprecation() -> None:
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, _GPTModelDeprecation) for f in logger.filters):
        logger.addFilter(_GPTModelDeprecation())


def build_gpt(cfg: ModelConfig, par: ParallelConfig, *, stock_local: bool = False):
    """Build the megatron-core GPTModel (after :func:`moe_rl.megatron.parallel.init_parallel`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # Routers register their RouterReplay in a class-level list; a second model in one
    # process would join the same list. Each Policy keeps its own routers instead.
    RouterReplay.clear_global_router_replay_instances()
    _quiet_gpt_model_deprecation()
    rope.install()  # packed rows' RoPE in one pass (moe_rl/megatron/rope.py)
    config = transformer_config(cfg, par)
    log.info(describe_build(cfg, par, fusions(cfg, par)))
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
    check_built(model, cfg, stock_local=stock_local)
    if not stock_local:
        from moe_rl.megatron import dispatch

        local = dispatch.install(model)
        if local:
            log.info(
                "token dispatch: moe-rl's local dispatcher in %d MoE layers (EP = TP = 1: no host reads)",
                local,
            )
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
