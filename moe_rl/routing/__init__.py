"""Expert routing: replay modes, natural top-k capture, flip metrics and route storage.

Torch-only; the megatron-core binding lives in :mod:`moe_rl.megatron.routing`.
"""

from __future__ import annotations

import enum


class ReplayMode(enum.Enum):
    """Which routes the training forwards of a batch use (REFERENCE.md, Routing Replay)."""

    NONE = "none"
    "The router's own top-k every forward."
    R2 = "r2"
    "Replay the top-k the trainer recorded while computing pi_old log-probs."
    R3 = "r3"
    "Replay the top-k the rollout engine returned (SGLang return_routed_experts)."


class RouterAction(enum.Enum):
    """What the routers do in one forward."""

    NATURAL = "natural"
    "Route by the router's own top-k."
    RECORD = "record"
    "Route naturally and record the chosen experts (and gate weights)."
    REPLAY = "replay"
    "Use the given experts; gate weights from the live router scores (or replayed)."
