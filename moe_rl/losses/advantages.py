"""Group-relative advantages (docs/algorithms.md#group-advantage), shared by every algorithm.

Shape legend: B = sequences (= groups x group_size, the rows of a group adjacent),
G = groups, N = group_size.

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)      (std_normalize=True)
    A_i =  r_i - mean_j r_j                            (std_normalize=False, Dr.GRPO)

std is the unbiased sample std by default (torch.std, Bessel's correction), as verl's
GRPO does: for rewards (1, 0, 1, 0) it is 1/sqrt(3), so A = +-sqrt(3)/2 = +-0.866.
``unbiased=False`` gives the population std (0.5 there, A = +-1 up to eps).
A group whose rewards are all equal gets exactly A = 0 and is counted.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards_B: torch.Tensor,
    group_size: int,
    *,
    eps: float,
    std_normalize: bool = True,
    unbiased: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages [B] (float32, or float64 for float64 rewards) of rewards [B] and their statistics.

    stats (0-dim tensors): ``adv/zero_std_groups`` (groups with all rewards equal),
    ``adv/zero_std_frac``, ``reward/mean``, ``reward/std`` (over the batch, same std
    convention), ``reward/group_std_mean`` (mean of the per-group stds).
    """
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards_B.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: group advantages need at least 2 responses per prompt")
    num = rewards_B.shape[0]
    if num == 0 or num % group_size:
        raise ValueError(
            f"{num} rewards is not a positive multiple of group_size={group_size}: "
            "pass whole groups, the group_size responses of a prompt in adjacent rows"
        )
    correction = 1 if unbiased else 0
    r_GN = rewards_B.detach().to(torch.promote_types(rewards_B.dtype, torch.float32)).view(-1, group_size)
    mean_G1 = r_GN.mean(-1, keepdim=True)
    std_G1 = r_GN.std(-1, keepdim=True, correction=correction)
    adv_GN = r_GN - mean_G1
    if std_normalize:
        adv_GN = adv_GN / (std_G1 + eps)
    zero_std_G = r_GN.amax(-1) == r_GN.amin(-1)
    adv_GN = torch.where(zero_std_G[:, None], 0.0, adv_GN)  # exact 0 despite rounding in mean
    r_B = r_GN.reshape(-1)
    stats = {
        "adv/zero_std_groups": zero_std_G.sum(),
        "adv/zero_std_frac": zero_std_G.float().mean(),
        "reward/mean": r_B.mean(),
        "reward/std": r_B.std(correction=correction),
        "reward/group_std_mean": torch.where(zero_std_G[:, None], 0.0, std_G1).mean(),
    }
    return adv_GN.reshape(-1), stats
