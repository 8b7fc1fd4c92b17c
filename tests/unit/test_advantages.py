"""Group-relative advantages: the seed's G = 4 example, zero-std groups, layout, errors."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.losses import group_advantages


def test_seed_example_g4_binary_rewards():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    # Default, as verl: unbiased std = sqrt(1/3), so A = +-0.5 / sqrt(1/3) = +-sqrt(3)/2.
    adv, stats = group_advantages(rewards, 4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]) * math.sqrt(3) / 2)
    # The seed's numbers (std 0.5, A = +-1) are the population std.
    adv, _ = group_advantages(rewards, 4, eps=0.0, unbiased=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    adv, _ = group_advantages(rewards, 4, eps=1e-6, unbiased=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.5 / (0.5 + 1e-6))
    assert float(stats["reward/mean"]) == 0.5 and int(stats["adv/zero_std_groups"]) == 0


def test_zero_std_groups_are_counted_and_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 0.7, 0.7, 0.7], dtype=torch.float64)
    adv, stats = group_advantages(rewards, 3, eps=0.0)  # eps = 0: rounding in the mean must not leak
    assert int(stats["adv/zero_std_groups"]) == 2
    assert float(stats["adv/zero_std_frac"]) == pytest.approx(2 / 3)
    assert torch.count_nonzero(adv[:3]) == 0 and torch.count_nonzero(adv[6:]) == 0
    torch.testing.assert_close(adv[3:6], torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))


def test_groups_are_adjacent_rows():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    adv2, stats2 = group_advantages(rewards, 2, eps=1e-6)
    adv4, stats4 = group_advantages(rewards, 4, eps=1e-6)
    assert torch.count_nonzero(adv2) == 0 and int(stats2["adv/zero_std_groups"]) == 2
    assert torch.all(adv4[:2] > 0) and torch.all(adv4[2:] < 0) and int(stats4["adv/zero_std_groups"]) == 0


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_matches_per_group_loop(seed, std_normalize):
    g = torch.Generator().manual_seed(seed)
    G, N, eps = 5, 8, 1e-4
    rewards = torch.randint(0, 3, (G * N,), generator=g).double() / 2
    adv, stats = group_advantages(rewards, N, eps=eps, std_normalize=std_normalize)
    expected, stds = [], []
    for j in range(G):
        r = rewards[j * N : (j + 1) * N].tolist()
        mean = sum(r) / N
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (N - 1))
        stds.append(std)
        expected += [(x - mean) / (std + eps) if std_normalize else x - mean for x in r]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert float(stats["reward/mean"]) == pytest.approx(float(rewards.mean()), rel=1e-12)
    assert float(stats["reward/std"]) == pytest.approx(float(torch.std(rewards)))
    assert float(stats["reward/group_std_mean"]) == pytest.approx(sum(stds) / G, rel=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4, eps=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(4), 1, eps=1e-6)
    with pytest.raises(ValueError, match=r"\[B\]"):
        group_advantages(torch.zeros(2, 4), 4, eps=1e-6)
