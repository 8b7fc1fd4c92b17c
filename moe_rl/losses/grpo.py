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

from moe_rl.losses.core import LossBatch, token_weights
from moe_rl.losses.metrics import surrogate_loss

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig


def grpo_loss(b: LossBatch, cfg: AlgoConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss -J (+ beta k3) of one microbatch ``b`` (:func:`moe_rl.losses.loss_batch`) and its
    metrics. Takes advantages [B] or per-token [B, T] and correction weights [B] or [B, T]."""
    return surrogate_loss(b, cfg, b.logratio_BT, b.adv_BT, token_weights(b))
