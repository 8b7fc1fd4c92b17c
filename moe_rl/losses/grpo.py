"""GRPO: token-level importance ratio with PPO clipping (REFERENCE.md "GRPO").

Shape legend: B = sequences in this microbatch, T = padded tokens per sequence.

    w_{i,t} = exp(d_{i,t}),  d = log pi_theta - log pi_old
    J = mean_i (1/|y_i|) sum_t min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)   (seq_mean)
    J = (1/num_tokens) sum_{i,t} min(...)                                       (token_mean)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.losses.core import aggregate_tokens, clipped_surrogate, prepare
from moe_rl.losses.metrics import loss_and_metrics

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig


def grpo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    cfg: AlgoConfig,
    num_sequences: float,
    num_tokens: float,
    ref_logp_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss -J (+ beta k3) of one microbatch and its metrics.

    logp_BT, old_logp_BT, mask_BT, ref_logp_BT: [B, T]; adv: [B] or per-token [B, T].
    num_sequences, num_tokens: global counts of the optimizer step (see moe_rl.losses.core).
    """
    b = prepare(
        logp_BT,
        old_logp_BT,
        adv,
        mask_BT,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        loss_name="grpo",
        token_adv_ok=True,
    )
    obj_BT = clipped_surrogate(b.logratio_BT, b.adv_BT, cfg.clip_low, cfg.clip_high)
    return loss_and_metrics(aggregate_tokens(obj_BT, b, cfg.aggregation), b, cfg, ref_logp_BT)
