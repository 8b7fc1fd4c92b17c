"""Expert routing: router actions, natural top-k capture, flip metrics and route storage.

One vocabulary: a run's *routing mode* is the recipe field ``algo.routing`` (``none``, ``r2``:
replay the routes recorded while computing pi_old, ``r3``: replay the rollout engine's routes;
docs/algorithms.md, Routing Replay). Each forward carries it out as a :class:`RouterAction`.

Torch-only; the megatron-core binding lives in :mod:`moe_rl.megatron.routing`.
"""

from __future__ import annotations

import enum


class RouterAction(enum.Enum):
    """What the routers do in one forward."""

    NATURAL = "natural"
    "Route by the router's own top-k."
    RECORD = "record"
    "Route naturally and record the chosen experts (and gate weights)."
    REPLAY = "replay"
    "Use the given experts; gate weights from the live router scores (or replayed)."
