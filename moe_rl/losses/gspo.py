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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.losses.core import aggregate_seqs, aggregate_tokens, clipped_surrogate, prepare, seq_mean_logratio
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss -J (+ beta k3) of one microbatch and its metrics.

    logp_BT, old_logp_BT, mask_BT, ref_logp_BT: [B, T]; adv: [B] only (per-token advantages
    are rejected: use gspo_token). num_sequences, num_tokens: global counts of the step.
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
    obj_B = clipped_surrogate(seq_mean_logratio(b), b.adv_B, cfg.clip_low, cfg.clip_high)
    return loss_and_metrics(aggregate_seqs(obj_B, b, cfg.aggregation), b, cfg, ref_logp_BT)


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token loss -J (+ beta k3) of one microbatch and its metrics.

    logp_BT, old_logp_BT, mask_BT, ref_logp_BT: [B, T]; adv: [B] or per-token [B, T].
    num_sequences, num_tokens: global counts of the step.
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
    obj_BT = clipped_surrogate(log_s_BT, b.adv_BT, cfg.clip_low, cfg.clip_high)
    return loss_and_metrics(aggregate_tokens(obj_BT, b, cfg.aggregation), b, cfg, ref_logp_BT)
