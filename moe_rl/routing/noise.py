"""Routing noise: emulated numerical nondeterminism in the routers' top-k choice
(docs/algorithms.md#routing-noise).

Real trainers and engines route with numerical noise: two passes of one Megatron model at the
same weights, or SGLang against Megatron, choose different experts for some tokens (the R3
paper measures about 10% of routers differing between SGLang and Megatron). On one CPU in fp32
the policy is exactly deterministic, so nothing separates the algorithms that exist to handle
that noise. :class:`RouteNoise` adds it back, under control:

- the *selection* only: the top-k is taken of ``key + sigma * N(0, 1)``, where ``key`` is the
  router logit (or, for pre-softmax routers, the log of the softmax score: the same ordering);
  the gate weights are then computed from the clean scores of the chosen experts, exactly as
  megatron-core computes them for replayed experts;
- drawn fresh in every forward, from a generator that :meth:`RouteNoise.reseed` sets per RL step
  (so a resumed run draws what the uninterrupted run drew);
- never on replayed routes: a replayed selection is exact whatever the noise.

One knob for the trainer's forwards (``train.route_noise``: pi_old, training, probes) and one
for the engine's (``rollout.route_noise``), so pass-to-pass nondeterminism and engine-trainer
disagreement turn separately.

Shape legend: N = router rows (tokens), E = experts, K = top-k.
"""

from __future__ import annotations

import math

import torch


def selection_key(scores_NE: torch.Tensor, *, pre_softmax: bool) -> torch.Tensor:
    """The logit-scale key whose top-k is the router's choice (float32): ``scores`` themselves
    when they are logits, their log when they are pre-softmax probabilities (softmax is monotonic
    within a row, so the ordering, and the effect of additive noise, is that of the logits)."""
    key = scores_NE.float()
    return key.clamp_min(torch.finfo(torch.float32).tiny).log() if pre_softmax else key


class RouteNoise:
    """Gaussian selection noise of standard deviation ``sigma`` (logits); off at 0."""

    def __init__(self, sigma: float = 0.0, seed: int = 0):
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"route noise sigma must be a finite number >= 0, got {sigma}")
        self.sigma = float(sigma)
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def active(self) -> bool:
        return self.sigma > 0

    def reseed(self, seed: int) -> None:
        """Start the draws over from ``seed`` (on every device)."""
        self.seed = int(seed)
        self._generators.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[device] = g
        return g

    def topk(self, key_NE: torch.Tensor, k: int) -> torch.Tensor:
        """Indices ``[N, K]`` of the top-k of ``key + sigma * N(0, 1)`` (one fresh draw)."""
        noise = torch.randn(key_NE.shape, generator=self._generator(key_NE.device), device=key_NE.device)
        return torch.topk(key_NE.float() + self.sigma * noise, k, dim=-1).indices

    def __repr__(self) -> str:
        return f"RouteNoise(sigma={self.sigma}, seed={self.seed})"
