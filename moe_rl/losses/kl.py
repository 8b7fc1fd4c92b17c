"""The k3 estimator of KL(pi_theta || pi_ref) (Schulman, "Approximating KL divergence").

Shape legend: B = sequences, T = padded tokens per sequence.
"""

from __future__ import annotations

import torch


def k3(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, an unbiased estimate of
    KL(pi_theta || pi_ref) for tokens sampled from pi_theta. [B, T] -> [B, T].

    Computed as expm1(r) - r, exact for small r. Gradient flows through both arguments.
    """
    r = ref_logp_BT - logp_BT
    return torch.expm1(r) - r
