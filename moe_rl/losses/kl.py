"""Estimators of KL(pi_theta || pi_ref) from the sampled tokens' log-probs (Schulman, "Approximating
KL divergence", 2020), as verl and TRL name them (docs/algorithms.md#kl-to-a-reference).

Shape legend: B = sequences, T = padded tokens per sequence.

With d = log pi_ref - log pi_theta per token (docs/algorithms.md, "KL to a reference"):

- ``k1`` = -d = log pi_theta - log pi_ref (verl's ``kl`` / ``k1``): unbiased, can be negative;
- ``k2`` = d^2 / 2 (verl's ``mse`` / ``k2``): biased, non-negative;
- ``k3`` = e^d - 1 - d (verl's ``low_var_kl`` / ``k3``, TRL's ``beta`` term): unbiased,
  non-negative, low variance. verl clamps d to [-20, 20] and k3 to [-10, 10]; here, as in TRL,
  nothing is clamped (the two agree wherever verl's clamps do not bind).

A loss term (``algo.kl_coef``) is ``kl_coef`` times the estimator aggregated like the policy
loss; in the reward (``algo.kl_reward_coef``, verl's ``use_kl_in_reward``) each sequence's reward
loses ``kl_reward_coef`` times the sum over its tokens of the estimator of pi_old against pi_ref
(:func:`sequence_kl`), before the group advantages. Only torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def k1(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k1 = log pi_theta - log pi_ref. [B, T] -> [B, T]."""
    return logp_BT - ref_logp_BT


def k2(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k2 = (log pi_ref - log pi_theta)^2 / 2 >= 0. [B, T] -> [B, T]."""
    return 0.5 * (ref_logp_BT - logp_BT).square()


def k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, an unbiased estimate of
    KL(pi_theta || pi_ref) for tokens sampled from pi_theta. [B, T] -> [B, T].

    Computed as expm1(r) - r, exact for small r. Gradient flows through both arguments.
    """
    r = ref_logp_BT - logp_BT
    return torch.expm1(r) - r


ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": k1, "k2": k2, "k3": k3}
"""``algo.kl_estimator`` -> per-token estimator ``(logp_BT, ref_logp_BT) -> [B, T]``; its keys are
moe_rl.names.KL_ESTIMATORS (tests/unit/test_names.py holds them equal)."""


def kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The estimator ``name`` (k1 | k2 | k3); an unknown name lists the valid ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown KL estimator {name!r}: use one of {', '.join(ESTIMATORS)}") from None


def sequence_kl(
    logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Sum over each sequence's response tokens of the ``estimator`` of ``logp`` (pi_old, no
    gradient) against ``ref_logp``: the KL penalty a reward pays (verl's ``apply_kl_penalty``, whose
    per-token penalties GRPO's outcome advantage sums). [B, T] -> [B]; padding (anything, even inf)
    contributes nothing."""
    mask = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    dtype = torch.promote_types(logp_BT.dtype, torch.float32)
    zero = logp_BT.new_zeros((), dtype=dtype)
    logp = torch.where(mask, logp_BT.detach().to(dtype), zero)
    ref = torch.where(mask, ref_logp_BT.detach().to(dtype), zero)
    return torch.where(mask, kl_estimator(estimator)(logp, ref), zero).sum(-1)
