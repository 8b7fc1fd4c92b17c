"""megatron-core's alltoall token dispatcher in a world of one, without host reads.

Shape legend: N = tokens of the layer's input, E = experts, K = experts per token, H = hidden.

With one expert-parallel and one tensor-parallel rank there is nothing to communicate, yet
megatron-core's ``MoEAlltoAllTokenDispatcher`` (0.16.1 .. 0.19) still reads the token counts back to
the host at every MoE layer (``tokens_per_expert`` moved to the CPU and synchronised before the
experts; ``masked_select`` in the unfused permutation; ``.tolist()`` of the counts in
``sort_chunks_by_idxs``, whose split and concatenation run one op per local expert, forward and
backward). On a GPU each is a stall of the host, and the per-expert ops a launch each.

:class:`LocalTokenDispatcher` computes the same permutation with static shapes on the device: every
token routes to exactly K experts (megatron-core's dropless rule, which sizes its own buffers as
``N * K``), so a stable sort of the routing map's expert-major entries puts the ``N * K`` chosen
(expert, token) pairs first in ``masked_select``'s order; the counts stay on the device for the
experts' grouped GEMM (:class:`moe_rl.megatron.local_layers.GroupedExperts`), and the combine is
megatron-core's own ``unpermute``. The values, and the gradients, are megatron-core's
(``tests/unit/test_dispatch.py``). :func:`install` puts it in every MoE layer it serves: EP = TP = 1,
dropless, no router padding, no shared experts, no fused permutation; any other layer keeps
megatron-core's dispatcher.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import unpermute
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` for EP = TP = 1: the same permutation, no host reads."""

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """Tokens ``[..., H]`` and the router's ``routing_map [N, E]`` (bool) and ``probs [N, E]`` ->
        tokens sorted by expert ``[N * K, H]`` and their probabilities ``[N * K]``."""
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_NH = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_NH.shape
        n, e = routing_map.shape
        chosen_EN = routing_map.T.reshape(-1)
        # the chosen (expert, token) pairs first, in masked_select's order (expert-major, tokens ascending)
        order = torch.argsort(torch.logical_not(chosen_EN).to(torch.int8), stable=True)[
            : n * self.config.moe_router_topk
        ]
        self.reversed_local_input_permutation_mapping = order % n  # the token of each permuted row
        self.tokens_per_expert = routing_map.sum(dim=0)
        tokens = hidden_NH.index_select(0, self.reversed_local_input_permutation_mapping)
        return tokens, probs.T.contiguous().view(-1).index_select(0, order)

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """Nothing to send: one rank holds every expert."""
        return permutated_local_input_tokens, permuted_probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """``(tokens, tokens_per_expert [E] on the device, probs)``: already sorted by expert."""
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens):
        """Expert outputs ``[N * K, H]`` summed back onto their tokens (megatron-core's ``unpermute``)
        and reshaped as the layer's input."""
        out = unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            routing_map=self.routing_map,
        )
        return out.view(self.hidden_shape)


def serves(dispatcher) -> bool:
    """Whether :class:`LocalTokenDispatcher` computes what ``dispatcher`` (megatron-core's) does."""
    config = dispatcher.config
    return (
        type(dispatcher) is MoEAlltoAllTokenDispatcher
        and dispatcher.ep_size == 1
        and dispatcher.tp_size == 1
        and config.moe_expert_capacity_factor is None
        and not config.moe_router_padding_for_quantization
        and not config.moe_permute_fusion
        and getattr(dispatcher, "shared_experts", None) is None
    )


def install(model) -> int:
    """Give every MoE layer of ``model`` whose dispatcher :func:`serves` a :class:`LocalTokenDispatcher`
    (the same object, its class changed: its state and megatron-core's other methods are kept);
    returns how many layers took it."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    done = 0
    for layer in model.modules():
        if isinstance(layer, MoELayer) and serves(layer.token_dispatcher):
            layer.token_dispatcher.__class__ = LocalTokenDispatcher
            done += 1
    return done
