"""Colocated phases: the trainer and the SGLang engines take turns on the same GPUs, every rank in step.

With ``rollout.sglang.colocate`` the engines run on the trainer's own GPUs. Each engine phase
(:data:`moe_rl.rollout.sglang_engine.PHASE_TAGS`) runs inside :func:`engine_phase`, which orders
four things across every trainer rank:

1. every rank moves its trainer state to host memory (``rollout.sglang.offload_trainer``): the
   gradients and Adam state, and for a rollout or a launch the weights too (a push reads them);
2. barrier; trainer rank 0 has the engines resume what the phase needs (a push: the weights
   alone; a rollout: the weights, KV cache and CUDA graphs); barrier;
3. the phase's work (generate, push, launch) on every rank;
4. barrier; rank 0 has the engines release everything; barrier; every rank takes its state back.

So no engine holds memory while any rank's trainer state is on its GPU, and the reverse (a push
holds the engines' weights beside the trainer's). Without the first barrier rank 0 resumed the
engines while a slower rank was still copying its state out; without the last, a rank reloaded
its state while the engines still held theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from moe_rl import dist

TRAINER_KEEPS_WEIGHTS = {"rollout": False, "push": True, "launch": False}
"Whether the trainer's weights stay on the GPU in each engine phase (a push reads them)."


@contextlib.contextmanager
def engine_phase(trainer: Any, engine: Callable[[], Any], phase: str, group: Any = None) -> Iterator[None]:
    """Run the block as engine phase ``phase`` (module docstring) on every rank of ``group``.

    ``trainer``: what moves the trainer's state (``release_memory(weights=)`` /
    ``resume_memory()``: :class:`moe_rl.megatron.optim.Optimizer`), or None to leave it in place.
    ``engine``: returns the engine at the time of each call (None while it is being built, as in
    ``launch``); one without ``resume_memory`` (the embedded engine) is left alone."""
    if trainer is not None:
        trainer.release_memory(weights=not TRAINER_KEEPS_WEIGHTS[phase])
    dist.barrier(group)  # every rank's trainer state has left its GPU
    _call(engine(), "resume_memory", phase)
    dist.barrier(group)  # the engines hold what the phase needs before any rank uses them
    try:
        yield
    finally:
        dist.barrier(group)  # every rank's work on the engines is done
        _call(engine(), "release_memory")
        dist.barrier(group)  # the engines' memory is free before any rank takes its state back
        if trainer is not None:
            trainer.resume_memory()


def _call(engine: Any, method: str, *args: Any) -> None:
    fn = getattr(engine, method, None)
    if fn is not None:
        fn(*args)
