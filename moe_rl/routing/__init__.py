"""Expert routing: router actions, natural top-k capture, flip metrics and route storage.

One vocabulary: a run's *routing mode* is the recipe field ``algo.routing``, a :class:`RoutingMode`
(``none``, ``r2``: replay the routes recorded while computing pi_old, ``r3``: replay the rollout
engine's routes; docs/algorithms.md, Routing Replay), parsed once by the recipe; its properties
answer what each part of the step asks of it. Each forward carries it out as a :class:`RouterAction`.

Torch-only; the megatron-core binding lives in :mod:`moe_rl.megatron.routing`.
"""

from __future__ import annotations

import enum
from typing import Any


class RouterAction(enum.Enum):
    """What the routers do in one forward."""

    NATURAL = "natural"
    "Route by the router's own top-k."
    RECORD = "record"
    "Route naturally and record the chosen experts (and gate weights)."
    REPLAY = "replay"
    "Use the given experts; gate weights from the live router scores (or replayed)."


class RoutingMode(str, enum.Enum):
    """A run's routing replay (``algo.routing``); a ``str``, so a recipe writes and compares it as text."""

    NONE = "none"
    "No replay: every forward routes by its routers' own top-k."
    R2 = "r2"
    "Replay the routes pi_old's forward chose (recorded in that pass) in training."
    R3 = "r3"
    "Replay the rollout engine's routes in pi_old's forward and in training."

    def __str__(self) -> str:
        return self.value

    @property
    def wants_engine_routes(self) -> bool:
        """Whether the rollout engine must return its routes (an SGLang server started with
        ``--enable-return-routed-experts``): R3 replays them."""
        return self is RoutingMode.R3

    @property
    def pi_old_action(self) -> RouterAction:
        """What the routers do in pi_old's forward: R2 records the natural routes, R3 replays the
        engine's, none routes naturally."""
        return _PI_OLD_ACTION[self]

    @property
    def needs_pi_old_pass(self) -> bool:
        """Whether pi_old's forward runs even when pi_old's log-probs are the engine's
        (``algo.old_logprobs=rollout``): R2's routes are recorded there."""
        return self.pi_old_action is RouterAction.RECORD

    @property
    def replays_in_training(self) -> bool:
        """Whether the training forwards (and the reference's) replay routes (R2, R3)."""
        return self is not RoutingMode.NONE

    def replayed(self, recorded: Any, engine: Any) -> Any:
        """The routes the training forwards replay, of the two a step has: pi_old's ``recorded``
        ones (R2) or the ``engine``'s (R3); None without replay. The one place that decides it."""
        if not self.replays_in_training:
            return None
        return recorded if self.pi_old_action is RouterAction.RECORD else engine


_PI_OLD_ACTION = {
    RoutingMode.NONE: RouterAction.NATURAL,
    RoutingMode.R2: RouterAction.RECORD,
    RoutingMode.R3: RouterAction.REPLAY,
}
