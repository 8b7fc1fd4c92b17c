"""GRPO: token-level importance ratio with PPO clipping (docs/algorithms.md#grpo).

Shape legend: B = sequences in this microbatch, T = padded tokens per sequence.

    w_{i,t} = exp(d_{i,t}),  d = log pi_theta - log pi_old
    J = mean_i (1/|y_i|) sum_t min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)   (seq_mean)
    J = (1/num_tokens) sum_{i,t} min(...)                                       (token_mean)

Options: dual clip (cfg.clip_ratio_c = c: max(term, c A) where A < 0) and detached train-inference
correction weights (``is_weights``, [B] or [B, T]) multiplying each token's term before aggregation,
denominators unchanged (docs/algorithms.md, "Train-inference mismatch"). The KL term is not weighted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.losses.core import (
    aggregate_tokens,
    clipped_surrogate,
    dual_clip_frac,
    dual_clipped,
    prepare,
    token_weights,
)
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
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss -J (+ beta k3) of one microbatch and its metrics.

    logp_BT, old_logp_BT, mask_BT, ref_logp_BT: [B, T]; adv: [B] or per-token [B, T];
    is_weights: None (no correction) or detached [B] / [B, T] correction weights.
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
    w_BT = token_weights(is_weights, b, "grpo")
    obj_BT = clipped_surrogate(b.logratio_BT, b.adv_BT, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    if w_BT is not None:
        obj_BT = obj_BT * w_BT
    loss, metrics = loss_and_metrics(aggregate_tokens(obj_BT, b, cfg.aggregation), b, cfg, ref_logp_BT)
    dual_BT = dual_clipped(b.logratio_BT.detach().exp(), b.adv_BT, cfg.clip_ratio_c) & b.mask_BT
    metrics["clip/dual_clip_frac"] = dual_clip_frac(dual_BT, b)
    return loss, metrics
