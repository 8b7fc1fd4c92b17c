"""Checkpoint keys of the policy under megatron-core's two layer specs, and the one mapping
between them.

``moe_rl.megatron.model.layer_spec`` builds the local spec (CPU, or a GPU without
transformer-engine) or the transformer-engine spec (``get_gpt_decoder_block_spec(config,
use_transformer_engine=True)`` with ``moe_grouped_gemm=False``). Their ``sharded_state_dict`` keys
(what ``dist_checkpointing`` files a tensor under; layers stacked as ``decoder.layers.<name>``)
agree on everything but the MoE layer's pre-MLP norm (megatron-core 0.16.1 to 0.19.2 and
Megatron-LM main, ``models/gpt/gpt_layer_specs.py``):

- input norm: TE fuses it into ``TELayerNormColumnParallelLinear`` (``self_attention.linear_qkv.
  layer_norm_weight``); the local spec's ``sharded_state_dict_keys_map`` files its
  ``input_layernorm.weight`` under that same name. Same key.
- pre-MLP norm: the local spec maps ``pre_mlp_layernorm.`` to the fused name a dense TE layer
  has (``mlp.linear_fc1.layer_norm_weight``), but a TE MoE layer keeps an unfused ``TENorm`` under
  ``pre_mlp_layernorm.weight`` (an MoE layer has no ``linear_fc1``). **Different**: the one rename.
- q/k norms (``self_attention.{q,k}_layernorm.weight``), router, embedding, output layer, final
  norm: the same modules' parameters under the same names.
- experts: both specs build moe-rl's ``GroupedExperts`` (one stacked parameter per projection),
  whose sharded state dict is ``SequentialMLP``'s: the same
  ``mlp.experts.experts.linear_fc{1,2}.weight`` with the expert axis (checkpoints of the earlier
  per-expert layout load into it). TE's grouped GEMM (``TEGroupedMLP``,
  ``...experts.linear_fc1.weight<i>``) is a third layout this does not map.
- ``_extra_state`` objects (fp8 metadata of TE modules, ``None`` for local linears) may exist in
  one layout only; a load leaves a module's own extra state where the checkpoint has none.

Keys carry prefixes (``optimizer.state.exp_avg.``, ``chained_0.``): a key is renamed by its end.
"""

from __future__ import annotations

from collections.abc import Iterable

LOCAL = "local"
TRANSFORMER_ENGINE = "transformer_engine"
LAYOUTS = (LOCAL, TRANSFORMER_ENGINE)

RENAMES: tuple[tuple[str, str], ...] = (
    # (local layout, transformer-engine layout)
    ("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight"),
)
"""Every key that differs between the two layouts, as (local, transformer-engine) key ends."""

EXTRA_STATE = "._extra_state"


def _pairs(src: str, dst: str) -> list[tuple[str, str]]:
    for layout in (src, dst):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layer-spec layout {layout!r}; one of {LAYOUTS}")
    return [(a, b) if src == LOCAL else (b, a) for a, b in RENAMES]


def convert(key: str, src: str, dst: str) -> str:
    """``key`` of layout ``src`` under layout ``dst`` (unchanged where both layouts agree)."""
    if src == dst:
        return key
    for a, b in _pairs(src, dst):
        if key == a or key.endswith("." + a):
            return key[: len(key) - len(a)] + b
    return key


MARKERS = dict(zip(LAYOUTS, RENAMES[0], strict=True))
"""The key end that tells each layout: the pre-MLP norm of the MoE layers (the first rename)."""


def layout_of(keys: Iterable[str]) -> str | None:
    """The layout a set of checkpoint keys was written in (:data:`MARKERS`); None when the keys
    have neither marker, or both."""
    found = {
        layout
        for key in keys
        for layout, marker in MARKERS.items()
        if key == marker or key.endswith("." + marker)
    }
    return found.pop() if len(found) == 1 else None
