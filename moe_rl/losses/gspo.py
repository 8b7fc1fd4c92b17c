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
c > 1, so for A < 0 nothing else bounds a sequence whose geometric-mean ratio ran away. slime's GSPO
applies its eps_clip_c the same way; verl's GSPO loss ignores clip_ratio_c (docs/algorithms.md#dual-clip).

Correction weights (the batch's ``is_weights``, detached): gspo takes sequence-level [B] weights
(seq_tis, geo_mask) multiplying each sequence's term; gspo_token also takes token-level [B, T]
weights (tis, icepop, icepop_mask) multiplying each token's term. Denominators do not change; the KL term is not weighted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.losses.core import LossBatch, seq_mean_logratio, sequence_weights, token_weights
from moe_rl.losses.metrics import surrogate_loss

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig


def gspo_loss(b: LossBatch, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss -J (+ beta k3) of one microbatch ``b`` (:func:`moe_rl.losses.loss_batch`) and its
    metrics. Advantages [B] only (per-token ones are refused: use gspo_token); correction weights
    sequence-level [B] only ([B, T] is refused: use gspo_token)."""
    if b.token_adv:
        raise ValueError(
            f"gspo takes one advantage per sequence (adv of shape [B]), got {tuple(b.adv_BT.shape)}; "
            "use gspo_token (or grpo) for per-token advantages"
        )
    return surrogate_loss(b, cfg, seq_mean_logratio(b), b.adv_B, sequence_weights(b, "gspo"))


def gspo_token_loss(b: LossBatch, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token loss -J (+ beta k3) of one microbatch ``b`` (:func:`moe_rl.losses.loss_batch`) and
    its metrics. Takes advantages [B] or per-token [B, T] and correction weights [B] or [B, T]."""
    # log s_{i,t} = sg(log s_i) + log pi_t - sg(log pi_t): value log s_i, gradient 1 wrt log pi_t.
    log_s_BT = seq_mean_logratio(b).detach()[:, None] + (b.logp_BT - b.logp_BT.detach())
    return surrogate_loss(b, cfg, log_s_BT, b.adv_BT, token_weights(b))
