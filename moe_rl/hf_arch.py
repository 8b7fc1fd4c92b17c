"""A Hugging Face Qwen3-MoE ``config.json`` as :class:`~moe_rl.config.ModelConfig` fields, and
``model.hf_path``'s part in loading a recipe: the architecture comes from the folder.

Plain JSON (no torch, no megatron-core): :mod:`moe_rl.config` uses it while loading a recipe,
:mod:`moe_rl.preflight` to check the folder, and :mod:`moe_rl.megatron.hf_mapping` (the
name/layout map, which builds a ModelConfig from it) re-exports it.

With ``model.hf_path`` set, every architecture field (:data:`ARCH_FIELDS`) the recipe leaves
unset takes the folder's value; a field the recipe sets must agree with it (else one
:class:`ConfigError` line names both values and the fix). Fields ``config.json`` does not decide
(``max_seq_len``, ``dtype``, ``tokenizer``, ``seed``...) stay the recipe's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_rl.configlib import ConfigError

HF_ARCH = "Qwen3MoeForCausalLM"

ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "moe_ffn_hidden_size",
    "num_experts",
    "moe_router_topk",
    "moe_norm_topk_prob",
    "rope_theta",
    "norm_eps",
    "qk_norm",
    "tie_embeddings",
)
"""ModelConfig fields that decide the weights' shapes and the forward (compared on import, read
from ``config.json`` under ``model.hf_path``)."""

HF_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "num_experts": "num_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_norm_topk_prob": "norm_topk_prob",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "qk_norm": "(Qwen3: always true)",
    "tie_embeddings": "tie_word_embeddings",
    "max_seq_len": "max_position_embeddings",
}
"The ``config.json`` key each ModelConfig field comes from (for messages)."


def _rope_theta(hf: dict, problems: list[str]) -> float:
    """RoPE base from transformers 5 ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = hf.get("rope_scaling")
    for name, rope in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        if kind != "default":
            problems.append(f"{name}={rope!r} (only plain RoPE without scaling is supported)")
    theta = (params or {}).get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        problems.append("rope_theta is missing (set rope_theta or rope_parameters.rope_theta)")
        return 0.0
    return float(theta)


def unsupported(hf: dict) -> list[str]:
    """What in an HF ``config.json`` dict this port cannot represent (empty: supported)."""
    problems = []
    archs = hf.get("architectures") or []
    if (archs and HF_ARCH not in archs) or hf.get("model_type", "qwen3_moe") != "qwen3_moe":
        problems.append(f"architectures={archs} model_type={hf.get('model_type')!r} (only {HF_ARCH})")
    if (hf.get("shared_expert_intermediate_size") or 0) > 0 or (hf.get("n_shared_experts") or 0) > 0:
        problems.append(
            f"shared_expert_intermediate_size={hf.get('shared_expert_intermediate_size')} "
            "(shared experts are not supported)"
        )
    if hf.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={hf['mlp_only_layers']} (every layer must be an MoE layer)")
    if hf.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']} (every layer must be MoE: 1)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (no biases are supported)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
        problems.append("use_sliding_window/layer_types: sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu)")
    if not hf.get("num_experts", hf.get("num_local_experts")):
        problems.append("num_experts is missing or 0 (a dense model)")
    return problems


def fields_from_hf(hf: dict) -> dict[str, Any]:
    """ModelConfig fields of an HF Qwen3-MoE ``config.json`` dict: :data:`ARCH_FIELDS` and
    ``max_seq_len`` (= ``max_position_embeddings``). ConfigError naming every unsupported field,
    or a required key that is missing."""
    problems = unsupported(hf)
    theta = _rope_theta(hf, problems)
    if problems:
        raise ConfigError("unsupported Hugging Face config: " + "; ".join(problems))
    try:
        heads = hf["num_attention_heads"]
        return dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            num_experts=hf.get("num_experts", hf.get("num_local_experts")),
            moe_router_topk=hf["num_experts_per_tok"],
            moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            max_seq_len=hf.get("max_position_embeddings", 4096),
            rope_theta=theta,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            qk_norm=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise ConfigError(f"Hugging Face config has no {e.args[0]}: not a Qwen3-MoE config.json") from None


def read_config_json(path: str | Path) -> dict:
    """The ``config.json`` dict of a local HF checkpoint directory; ConfigError (one line) when the
    directory or the file is missing or unreadable."""
    folder = Path(path)
    f = folder / "config.json"
    if not folder.is_dir():
        why = "is a file, not a directory" if folder.exists() else "does not exist"
        raise ConfigError(
            f"model.hf_path={path} {why}: give a local Hugging Face checkpoint directory "
            "(config.json + *.safetensors), or null to start from random weights"
        )
    if not f.is_file():
        raise ConfigError(
            f"model.hf_path={path} has no config.json: not a Hugging Face checkpoint directory "
            "(give the folder holding config.json and the *.safetensors weights)"
        )
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_path={path}: config.json is unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.hf_path={path}: config.json is not a JSON object")
    return data


def with_hf_architecture(model: dict, coerce: Callable[[str, Any], Any]) -> dict:
    """The recipe's ``model`` section (a YAML mapping, overrides applied) with the architecture of
    ``model.hf_path``'s ``config.json`` filled in: each of :data:`ARCH_FIELDS` the section leaves
    unset takes the folder's value; one it sets must agree (``coerce(field, value)`` gives the
    typed value to compare), else ConfigError, one line naming both values and the fix.

    Without ``hf_path``, or when its ``config.json`` cannot be read here (a cluster recipe loaded
    on another machine, a relative path from another directory), the section is returned as it
    is: ``moe-rl check`` and ``moe-rl train`` refuse such a folder (:func:`moe_rl.preflight.check_hf_path`).
    """
    path = model.get("hf_path")
    if not path:
        return model
    try:
        hf = fields_from_hf(read_config_json(path))
    except ConfigError:
        return model
    wrong = []
    for name in ARCH_FIELDS:
        if name in model and coerce(name, model[name]) != hf[name]:
            wrong.append(f"model.{name}={model[name]} vs {HF_NAMES[name]}={hf[name]}")
    if wrong:
        names = ", ".join(w.split("=", 1)[0] for w in wrong)
        raise ConfigError(
            f"model.hf_path={path}: the recipe disagrees with its config.json ({'; '.join(wrong)}): "
            f"remove {names} from the recipe (the architecture is read from config.json), or point "
            "model.hf_path at the checkpoint they describe"
        )
    return {**{n: hf[n] for n in ARCH_FIELDS}, **model}
