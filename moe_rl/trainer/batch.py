"""One rollout batch on this rank as the RL step's updates, probes and hooks read it (:class:`RLBatch`).

Shape legend: B = sequences of this data-parallel rank, T = padded tokens, S = T - 1 model
input positions, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RLBatch:
    """One rollout batch on this rank, ready for the minibatch updates."""

    tokens_BT: torch.Tensor
    mask_BT: torch.Tensor  # response tokens (the loss mask)
    valid_BS: torch.Tensor  # input positions that carry routes (t < total_len - 1)
    adv_B: torch.Tensor
    old_logp_BT: torch.Tensor
    replay_BSLK: torch.Tensor | None  # routes replayed in training (R2, R3)
    old_routes_BSLK: torch.Tensor | None  # pi_old's natural routes, for drift
    is_weights: torch.Tensor | None = None  # train-inference correction, [B, T] or [B] (detached)
    probe_before_BSLK: torch.Tensor | None = None  # the probe rows' natural routes under pi_old
    # (optimizer step count, the probe rows' natural routes after that step): a probe's natural
    # forward of them (the routing share's), which the flip probe takes instead of running its own
    probe_after: tuple[int, torch.Tensor] | None = None
    # the engine's gate weights, replayed with replay_BSLK (R3 with algo.replay_gate_weights)
    replay_gates_BSLK: torch.Tensor | None = None
    ref_logp_BT: torch.Tensor | None = None  # log pi_ref of the KL term (trainer/reference.py), or None

    @property
    def lens_B(self) -> torch.Tensor:
        """Input positions of every row (``total_len - 1``): what a packed forward computes."""
        return self.valid_BS.sum(1).to(torch.int64)
