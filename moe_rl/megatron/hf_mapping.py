"""Hugging Face Qwen3-MoE <-> megatron-core GPTModel: config conversion and the name/layout map.

Pure functions of names, shapes and ranks (torch only, no megatron-core, no I/O); the
streaming import/export that uses them is :mod:`moe_rl.megatron.hf`.

Shape legend: V = vocab, H = hidden, Q = query heads, G = key/value heads (query groups),
D = head_dim, R = Q // G, E = experts, I = expert intermediate width.

Layouts (megatron-core local spec, 0.16.1 .. 0.19):
- ``linear_qkv.weight`` ``[G * (R + 2) * D, H]`` interleaves per query group
  ``[R query heads, 1 key head, 1 value head]``; TP splits whole groups (rows).
- ``linear_proj.weight`` ``[H, Q * D]``: row-parallel, TP splits columns.
- ``embedding.word_embeddings.weight`` and ``output_layer.weight`` ``[V, H]``: TP splits rows.
- ``mlp.experts.linear_fc1.weight`` ``[E_local, 2 * I, H]``: local expert j's ``[gate; up]`` rows;
  ``mlp.experts.linear_fc2.weight`` ``[E_local, H, I]``; EP rank r holds global experts
  ``r * E_local .. (r + 1) * E_local - 1`` (expert tensor parallelism is 1).
- Norms and the router are replicated.

HF checkpoints name experts one by one (``mlp.experts.{e}.gate_proj.weight``, what
transformers 5's ``save_pretrained`` writes and SGLang loads); transformers 5 *modules* hold
them fused (``mlp.experts.gate_up_proj`` ``[E, 2 * I, H]`` = per expert ``[gate; up]``,
``mlp.experts.down_proj`` ``[E, H, I]``). Both are read; per-expert names are written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moe_rl.config import ConfigError, ModelConfig
from moe_rl.hf_arch import ARCH_FIELDS as ARCH_FIELDS  # the config.json side lives there (no torch)
from moe_rl.hf_arch import HF_ARCH, fields_from_hf
from moe_rl.hf_arch import unsupported as unsupported

ALL = (slice(None),)
"Index of a whole tensor."


# -- config ------------------------------------------------------------------------------------
def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig of an HF Qwen3-MoE ``config.json`` dict; ``overrides`` set other fields.

    Fields HF does not describe (dtype, seed, tokenizer, max_seq_len...) keep ModelConfig's
    defaults unless overridden, except ``max_seq_len`` = ``max_position_embeddings``.
    Raises ConfigError naming every unsupported field (:func:`moe_rl.hf_arch.fields_from_hf`).
    """
    fields = fields_from_hf(hf)
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config(cfg: ModelConfig, *, dtype: torch.dtype | None = None) -> dict:
    """HF ``config.json`` dict (Qwen3MoeForCausalLM) for ``cfg``; readable by transformers 4.5x
    (SGLang) and 5.x. ``dtype`` is the dtype the weights are written in (default cfg.dtype)."""
    if not cfg.qk_norm:
        raise ConfigError("model.qk_norm=false has no Qwen3-MoE equivalent (Qwen3 always has QK-norm)")
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else cfg.dtype
    return {
        "architectures": [HF_ARCH],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        # the dense MLP width is unused (every layer is MoE); Qwen3-MoE releases set it to K * I
        "intermediate_size": cfg.moe_ffn_hidden_size * cfg.moe_router_topk,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "norm_topk_prob": cfg.moe_norm_topk_prob,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.num_layers,
        "initializer_range": cfg.init_std,
        "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
        "output_router_logits": False,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def mismatches(a: ModelConfig, b: ModelConfig) -> list[str]:
    """ARCH_FIELDS on which two configs differ, as ``field: a vs b``."""
    return [f"{f}: {getattr(a, f)} vs {getattr(b, f)}" for f in ARCH_FIELDS if getattr(a, f) != getattr(b, f)]


# -- names and shapes --------------------------------------------------------------------------
def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name (per-expert form) -> full shape; no ``lm_head`` when tied."""
    h, d, i_ = cfg.hidden_size, cfg.head_dim, cfg.moe_ffn_hidden_size
    q, g = cfg.num_attention_heads * d, cfg.num_query_groups * d
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (g, h),
                p + "self_attn.v_proj.weight": (g, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate.weight": (cfg.num_experts, h),
            }
        )
        for e in range(cfg.num_experts):
            x = f"{p}mlp.experts.{e}."
            out.update(
                {
                    x + "gate_proj.weight": (i_, h),
                    x + "up_proj.weight": (i_, h),
                    x + "down_proj.weight": (h, i_),
                }
            )
    out["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def fused_expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers 5 in-memory fused expert names -> shapes."""
    e, h, i_ = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
    out = {}
    for layer in range(cfg.num_layers):
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = (e, 2 * i_, h)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = (e, h, i_)
    return out


def ignorable(name: str, cfg: ModelConfig) -> bool:
    """Checkpoint entries that carry no weight of ours (tied lm_head, stale RoPE buffers)."""
    return (cfg.tie_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")


# -- the placement plan ------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """This rank's place in the TP and EP layouts (world 1: the defaults)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


@dataclass(frozen=True)
class Piece:
    """``megatron_param[dst] <- hf_tensor[src]`` (reshaped): one rectangular region of each."""

    hf: str
    mg: str
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def _span(start: int, size: int) -> tuple[slice, ...]:
    return (slice(start, start + size),)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.linear_fc([12])\.weight")
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def _qkv(p: str, mg: str, cfg: ModelConfig, lay: Layout) -> list[Piece]:
    d = cfg.head_dim
    r = cfg.num_attention_heads // cfg.num_query_groups
    groups = cfg.num_query_groups // lay.tp_size
    out = []
    for gl in range(groups):
        g, base = lay.tp_rank * groups + gl, gl * (r + 2) * d
        out += [
            Piece(p + "self_attn.q_proj.weight", mg, _span(g * r * d, r * d), _span(base, r * d)),
            Piece(p + "self_attn.k_proj.weight", mg, _span(g * d, d), _span(base + r * d, d)),
            Piece(p + "self_attn.v_proj.weight", mg, _span(g * d, d), _span(base + (r + 1) * d, d)),
        ]
    return out


def _experts(p: str, mg: str, fc: str, cfg: ModelConfig, lay: Layout, fused: bool) -> list[Piece]:
    """The stacked projection ``mg`` ([E_local, ...]) of this rank's experts."""
    local = cfg.num_experts // lay.ep_size
    first, i_ = lay.ep_rank * local, cfg.moe_ffn_hidden_size
    if fused:
        name = p + ("mlp.experts.gate_up_proj" if fc == "1" else "mlp.experts.down_proj")
        return [Piece(name, mg, (slice(first, first + local), slice(None), slice(None)), ALL)]
    out = []
    for j in range(local):
        x, row = f"{p}mlp.experts.{first + j}.", slice(j, j + 1)
        if fc == "2":
            out.append(Piece(x + "down_proj.weight", mg, ALL, (row,)))
            continue
        out += [
            Piece(x + "gate_proj.weight", mg, ALL, (row, slice(0, i_))),
            Piece(x + "up_proj.weight", mg, ALL, (row, slice(i_, 2 * i_))),
        ]
    return out


def param_pieces(mg: str, cfg: ModelConfig, lay: Layout = Layout(), *, fused: bool = False) -> list[Piece]:
    """Where the local megatron parameter ``mg`` comes from in HF tensors (KeyError if unknown).

    ``fused``: read experts from transformers 5's fused names instead of per-expert ones.
    """
    if mg in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = cfg.vocab_size // lay.tp_size
        hf = "model.embed_tokens.weight" if mg.startswith("embedding") else "lm_head.weight"
        return [Piece(hf, mg, _span(lay.tp_rank * rows, rows), ALL)]
    if mg == "decoder.final_layernorm.weight":
        return [Piece("model.norm.weight", mg, ALL, ALL)]
    m = _LAYER.fullmatch(mg)
    if m is None:
        raise KeyError(f"no Hugging Face mapping for megatron parameter {mg!r}")
    p, rest = f"model.layers.{m[1]}.", m[2]
    if rest in _REPLICATED:
        return [Piece(p + _REPLICATED[rest], mg, ALL, ALL)]
    if rest == "self_attention.linear_qkv.weight":
        return _qkv(p, mg, cfg, lay)
    if rest == "self_attention.linear_proj.weight":
        cols = cfg.num_attention_heads * cfg.head_dim // lay.tp_size
        return [
            Piece(p + "self_attn.o_proj.weight", mg, (slice(None), *_span(lay.tp_rank * cols, cols)), ALL)
        ]
    ex = _EXPERT.fullmatch(rest)
    if ex is None:
        raise KeyError(f"no Hugging Face mapping for megatron parameter {mg!r}")
    return _experts(p, mg, ex[1], cfg, lay, fused)


def shard_kind(mg: str) -> tuple[str, int]:
    """How a local megatron parameter is split: ("tp", dim), ("ep", 0: experts along dim 0) or ("none", 0)."""
    if mg in ("embedding.word_embeddings.weight", "output_layer.weight") or mg.endswith(
        "self_attention.linear_qkv.weight"
    ):
        return "tp", 0
    if mg.endswith("self_attention.linear_proj.weight"):
        return "tp", 1
    return ("ep", 0) if _EXPERT.search(mg) else ("none", 0)


def hf_from_full(
    mg: str, full: torch.Tensor, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors held by one *full* (world-1 named) megatron parameter.

    ``shapes`` is :func:`hf_shapes` ``(cfg)``, passed in by callers that loop over many params.
    """
    shapes = hf_shapes(cfg) if shapes is None else shapes
    by_name: dict[str, list[Piece]] = {}
    for pc in param_pieces(mg, cfg):
        by_name.setdefault(pc.hf, []).append(pc)
    out = []
    for name, pieces in by_name.items():
        if len(pieces) == 1:  # in the world-1 layout a single piece is the whole HF tensor
            out.append((name, full[pieces[0].dst].reshape(shapes[name])))
            continue
        t = full.new_empty(shapes[name])
        for pc in pieces:
            t[pc.src] = full[pc.dst].reshape(t[pc.src].shape)
        out.append((name, t))
    return out
