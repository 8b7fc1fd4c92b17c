"""Where a run stands (:class:`RunState`) and the one object that saves, resumes and rolls back
its checkpoints (:class:`Checkpointer`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from moe_rl.megatron.optim import Optimizer

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """The run's position, written into every checkpoint's meta and read back on resume.

    The counters, and the ones kept elsewhere:

    - ``step``: the next step of ``stage`` to run. In SFT one step is one optimizer step; in RL
      one step (an *RL step*) is one rollout batch: generate, score, pi_old, then
      ``train.minibatches`` optimizer steps, then a weight sync. Reset to 0 when a stage finishes.
    - ``checkpoint_seq``: the number of the newest checkpoint written (``checkpoints/step-N``),
      increasing across stages and rollbacks; it counts saves, not training.
    - the *optimizer step* is ``Optimizer.step_count`` (saved with the optimizer, not here): it
      counts every applied update of every stage and drives the LR schedule.
    - the *weight version* the rollout engine reports is ``str(optimizer step)`` at the last sync.
    """

    stage: str | None = None
    "The stage running or last run (sft | rl); None before the first."
    step: int = 0
    "The next step of ``stage`` (see above)."
    checkpoint_seq: int = 0
    "Number of the newest checkpoint of this run (0: none yet)."
    sentinel: dict | None = None
    "The collapse sentinel's state (its running best, counters, rollbacks)."
    lr_scale: float = 1.0
    "Multiplier on the scheduled learning rate (each sentinel rollback lowers it)."
    finished: list[str] = field(default_factory=list)
    "Stages that ran to the end, in order."

    def to_meta(self) -> dict:
        """JSON-able form, with the key names older checkpoints used (``ckpt_seq``, ``done``)."""
        return {
            "stage": self.stage,
            "step": self.step,
            "ckpt_seq": self.checkpoint_seq,
            "sentinel": self.sentinel,
            "lr_scale": self.lr_scale,
            "done": list(self.finished),
        }

    @classmethod
    def from_meta(cls, meta: dict) -> RunState:
        """Inverse of :meth:`to_meta`; keys an older checkpoint lacks take their defaults."""
        return cls(
            stage=meta.get("stage"),
            step=int(meta.get("step", 0)),
            checkpoint_seq=int(meta.get("ckpt_seq", 0)),
            sentinel=meta.get("sentinel"),
            lr_scale=float(meta.get("lr_scale", 1.0)),
            finished=list(meta.get("done", [])),
        )

    def step_of(self, stage: str) -> int:
        """Where ``stage`` starts: the saved step if the run stopped inside it, else 0."""
        return self.step if self.stage == stage else 0


class Checkpointer:
    """Save, resume and roll back one run's checkpoints (policy, optimizer, RNG and RunState), and
    warm-start the policy from another run's."""

    def __init__(self, root: str | Path, model: torch.nn.Module, *, keep: int):
        self.root = Path(root)
        "Directory of ``step-N`` checkpoints and the ``latest`` pointer."
        self.model = model
        "The policy's module (its sharded state is saved)."
        self.keep = keep
        "How many checkpoints to keep."

    def exists(self) -> bool:
        from moe_rl.megatron.checkpoint import latest_checkpoint

        return latest_checkpoint(self.root) is not None

    def save(self, optimizer: Optimizer | None, state: RunState) -> None:
        """Write the next checkpoint (``state.checkpoint_seq`` + 1) with ``state`` in its meta."""
        from moe_rl.megatron.checkpoint import save_checkpoint

        state.checkpoint_seq += 1
        save_checkpoint(
            self.root, state.checkpoint_seq, self.model, optimizer, extra=state.to_meta(), keep=self.keep
        )

    def saved_state(self) -> RunState | None:
        """The RunState of the newest checkpoint, read from its meta only (no tensors loaded)."""
        from moe_rl.megatron.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.root)
        if ckpt is None:
            return None
        return RunState.from_meta(json.loads((ckpt / "meta.json").read_text())["extra"])

    def load(self, optimizer: Optimizer | None) -> RunState:
        """Load the newest checkpoint into the policy and ``optimizer``; its RunState."""
        from moe_rl.megatron.checkpoint import load_checkpoint

        state = RunState.from_meta(load_checkpoint(self.root, self.model, optimizer)["extra"])
        log.info("resumed from %s at %s step %d", self.root, state.stage, state.step)
        return state

    def load_weights(self, path: str | Path) -> None:
        """Start the policy from another run's checkpoint (``checkpoint.load``): weights only."""
        from moe_rl.megatron.checkpoint import load_checkpoint

        load_checkpoint(path, self.model, load_rng=False)
        log.info("policy weights from %s", path)

    def rollback(self, optimizer: Optimizer, live: RunState, lr_factor: float) -> RunState:
        """Reload the newest (last good) checkpoint and lower the LR by ``lr_factor``.

        The sentinel's state is the live one (its rollback count must survive the reload); the
        returned state is in the RL stage, at the RL step to continue from.
        """
        from moe_rl.megatron.checkpoint import load_checkpoint

        state = RunState.from_meta(load_checkpoint(self.root, self.model, optimizer)["extra"])
        state.sentinel = live.sentinel
        state.step, state.stage = state.step_of("rl"), "rl"
        state.lr_scale *= lr_factor
        optimizer.lr_scale = state.lr_scale
        log.warning(
            "rolled back to %s (RL step %d), lr scale now %.3g", self.root, state.step, state.lr_scale
        )
        return state
