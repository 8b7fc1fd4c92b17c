"""Policy-gradient losses for RL of MoE language models: GRPO, GSPO, GSPO-token.

Every loss is a pure function of one value, the microbatch's :class:`LossBatch` of padded
[B, T] tensors (B sequences, T tokens), and the algorithm's config:

    batch = loss_batch(logp_BT, old_logp_BT, adv, mask_BT, num_sequences=..., num_tokens=...,
                       ref_logp_BT=None, is_weights=None)      # checked and upcast, once
    loss, metrics = LOSSES[cfg.name].fn(batch, cfg)

``adv`` is [B] or per-token [B, T] (not for gspo); ``is_weights`` are the train-inference
correction weights of :mod:`moe_rl.losses.corrections` ([B] or [B, T]; [B] only for gspo);
``num_sequences`` / ``num_tokens`` are the global counts of the optimizer step, so microbatch
losses, gradients and (with ``METRIC_REDUCTIONS``) metrics add up to the whole batch's. Only
torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from moe_rl.losses.advantages import group_advantages
from moe_rl.losses.core import AGGREGATIONS, LossBatch, loss_batch
from moe_rl.losses.grpo import grpo_loss
from moe_rl.losses.gspo import gspo_loss, gspo_token_loss
from moe_rl.losses.kl import ESTIMATORS as KL_ESTIMATORS
from moe_rl.losses.kl import k1, k2, k3, kl_estimator, sequence_kl
from moe_rl.losses.metrics import METRIC_REDUCTIONS, combine_metrics
from moe_rl.names import PAPER_CLIP, TOKEN_RATIO_LOSSES


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: the function, the paper's clip band, and the level of its ratio."""

    fn: Callable
    "The loss function, ``fn(batch: LossBatch, cfg: AlgoConfig) -> (loss, metrics)``."
    eps_low: float
    "Default algo.eps_low: the paper's lower clip (ratio >= 1 - eps_low)."
    eps_high: float
    "Default algo.eps_high: the paper's upper clip (ratio <= 1 + eps_high)."
    ratio_level: Literal["token", "sequence"]
    "Whether the clipped importance ratio is per token or per sequence (gspo)."


def _spec(name: str, fn: Callable) -> LossSpec:
    """``name``'s entry: the clip band and ratio level are data in moe_rl.names (config reads them there)."""
    level = "token" if name in TOKEN_RATIO_LOSSES else "sequence"
    return LossSpec(fn, *PAPER_CLIP[name], ratio_level=level)


LOSSES: dict[str, LossSpec] = {
    "grpo": _spec("grpo", grpo_loss),
    "gspo": _spec("gspo", gspo_loss),
    "gspo_token": _spec("gspo_token", gspo_token_loss),
}
"Losses by algo.name: GRPO's band is DAPO's clip-higher [0.2, 0.27]; GSPO's is the GSPO paper's."


def get_loss(name: str) -> Callable:
    """The loss function registered as ``name``; an unknown name lists the valid ones."""
    try:
        return LOSSES[name].fn
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(sorted(LOSSES))}") from None


__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "LossBatch",
    "LossSpec",
    "METRIC_REDUCTIONS",
    "combine_metrics",
    "get_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "KL_ESTIMATORS",
    "k1",
    "k2",
    "k3",
    "kl_estimator",
    "sequence_kl",
    "loss_batch",
]
