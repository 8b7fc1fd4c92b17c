"""Rollout engines: the protocol and batch type (types), and a registry of engines.

``ROLLOUT_ENGINES`` maps a recipe's engine name to ``"module:Class"``; the module is
imported only by :func:`get_engine_class`, so ``import moe_rl.rollout`` needs neither
megatron-core (embedded) nor SGLang's client stack.
"""

from __future__ import annotations

import importlib

from moe_rl.rollout.types import RolloutEngine, Rollouts, SamplingParams

ROLLOUT_ENGINES: dict[str, str] = {
    "embedded": "moe_rl.rollout.embedded:EmbeddedEngine",
    "sglang": "moe_rl.rollout.sglang_engine:SGLangEngine",
}


def get_engine_class(name: str) -> type:
    """The engine class registered as ``name``; unknown names fail with the valid ones."""
    try:
        target = ROLLOUT_ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout engine {name!r}; valid: {', '.join(sorted(ROLLOUT_ENGINES))}"
        ) from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "Rollouts", "SamplingParams", "get_engine_class"]
