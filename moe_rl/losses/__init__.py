"""Policy-gradient losses for RL of MoE language models: GRPO, GSPO, GSPO-token.

Every loss is a pure function of padded [B, T] tensors (B sequences, T tokens):

    loss, metrics = loss_fn(logp_BT, old_logp_BT, adv, mask_BT, *, cfg, num_sequences,
                            num_tokens, ref_logp_BT=None)

``adv`` is [B] or per-token [B, T] (not for gspo); ``num_sequences`` / ``num_tokens`` are the
global counts of the optimizer step, so microbatch losses, gradients and (with
``METRIC_REDUCTIONS``) metrics add up to the whole batch's. Only torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_rl.losses.advantages import group_advantages
from moe_rl.losses.core import AGGREGATIONS
from moe_rl.losses.grpo import grpo_loss
from moe_rl.losses.gspo import gspo_loss, gspo_token_loss
from moe_rl.losses.kl import k3
from moe_rl.losses.metrics import METRIC_REDUCTIONS, combine_metrics

LOSSES: dict[str, Callable] = {
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
}
"Loss functions by algo.name."


def get_loss(name: str) -> Callable:
    """The loss registered as ``name``; an unknown name lists the valid ones."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(sorted(LOSSES))}") from None


__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "METRIC_REDUCTIONS",
    "combine_metrics",
    "get_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "k3",
]
