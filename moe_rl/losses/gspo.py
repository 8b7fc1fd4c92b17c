"""GSPO and GSPO-token: sequence-level importance ratio (Zheng et al. 2025, arXiv:2507.18071).

Shape legend: B = sequences in this microbatch, T = padded tokens per sequence.

    s_i = exp((1/|y_i|) sum_t d_{i,t})            (geometric mean, computed in log space)
    J   = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    GSPO-token: s_{i,t} = sg(s_i) exp(log pi_t - sg(log pi_t)), clipped like s_i, with
    per-token advantages A_{i,t}; with A_{i,t} = A_i its value and gradient are GSPO's.

Aggregation. ``seq_mean`` is the paper's objective. ``token_mean`` weights each sequence's
term by its length, J = sum_i |y_i| J_i / num_tokens: the token mean of J_i broadcast to
every token (what verl's GSPO gives with token-mean aggregation). It keeps gspo == gspo_token
under both aggregations, but reintroduces the length bias that seq_mean avoids.

Dual clip (cfg.clip_ratio_c = c). GSPO has one term per sequence, s_i A_i, and the dual clip applies
to that term as it does to a token's: for A_i < 0 and s_i > c it becomes the constant c A_i (no
gradient for the sequence). GSPO-token applies it per token to s_{i,t}, whose value is s_i, so the
two stay equal in value and gradient with A_{i,t} = A_i. GSPO's band (1 + 4e-4) is far below any
c > 1, so for A < 0 nothing else bounds a sequence whose geometric-mean ratio ran away.

Correction weights (``is_weights``, detached): gspo takes sequence-level [B] weights (seq_tis,
geo_mask) multiplying each sequence's term; gspo_token also takes token-level [B, T] weights (tis,
icepop) multiplying each token's term. Denominators do not change; the KL term is not weighted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.losses.core import (
    aggregate_seqs,
    aggregate_tokens,
    clipped_surrogate,
    dual_clip_frac,
    dual_clipped,
    prepare,
    seq_mean_logratio,
    sequence_weights,
    token_weights,
)
from moe_rl.losses.metrics import loss_and_metrics

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig


def gspo_loss(
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
    """GSPO loss -J (+ beta k3) of one microbatch and its metrics.

    logp_BT, old_logp_BT, mask_BT, ref_logp_BT: [B, T]; adv: [B] only (per-token advantages
    are rejected: use gspo_token); is_weights: None or detached sequence-level [B] weights ([B, T]
    is refused: use gspo_token). num_sequences, num_tokens: global counts of the step.
    """
    b = prepare(
        logp_BT,
        old_logp_BT,
        adv,
        mask_BT,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        loss_name="gspo",
        token_adv_ok=False,
    )
    w_B = sequence_weights(is_weights, b, "gspo")
    log_s_B = seq_mean_logratio(b)
    obj_B = clipped_surrogate(log_s_B, b.adv_B, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    if w_B is not None:
        obj_B = obj_B * w_B
    loss, metrics = loss_and_metrics(aggregate_seqs(obj_B, b, cfg.aggregation), b, cfg, ref_logp_BT)
    # every token of a dual-clipped sequence counts
    dual_B = dual_clipped(log_s_B.detach().exp(), b.adv_B, cfg.clip_ratio_c) & b.valid_B
    metrics["clip/dual_clip_frac"] = dual_clip_frac(dual_B[:, None] & b.mask_BT, b)
    return loss, metrics


def gspo_token_loss(
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
    """GSPO-token loss -J (+ beta k3) of one microbatch and its metrics.

    logp_BT, old_logp_BT, mask_BT, ref_logp_BT: [B, T]; adv: [B] or per-token [B, T];
    is_weights: None or detached [B] / [B, T] weights. num_sequences, num_tokens: global counts.
    """
    b = prepare(
        logp_BT,
        old_logp_BT,
        adv,
        mask_BT,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        loss_name="gspo_token",
        token_adv_ok=True,
    )
    # log s_{i,t} = sg(log s_i) + log pi_t - sg(log pi_t): value log s_i, gradient 1 wrt log pi_t.
    log_s_BT = seq_mean_logratio(b).detach()[:, None] + (b.logp_BT - b.logp_BT.detach())
    w_BT = token_weights(is_weights, b, "gspo_token")
    obj_BT = clipped_surrogate(log_s_BT, b.adv_BT, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    if w_BT is not None:
        obj_BT = obj_BT * w_BT
    loss, metrics = loss_and_metrics(aggregate_tokens(obj_BT, b, cfg.aggregation), b, cfg, ref_logp_BT)
    dual_BT = dual_clipped(log_s_BT.detach().exp(), b.adv_BT, cfg.clip_ratio_c) & b.mask_BT
    metrics["clip/dual_clip_frac"] = dual_clip_frac(dual_BT, b)
    return loss, metrics
