"""Where a run stands (:class:`RunState`), the one object that saves, resumes and rolls back its
checkpoints (:class:`Checkpointer`), and the run's policy of when it saves and how it resumes
(:class:`SaveResume`)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.errors import PathError, UserError, disk_full_at, is_disk_full
from moe_rl.files import write_text
from moe_rl.trainer.signals import StopRequested, StopSignals

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.policy import Policy
    from moe_rl.tasks.tokenizer import Tokenizer
    from moe_rl.trainer.metrics import MetricsSink

log = logging.getLogger(__name__)


class TrainingStopped(UserError, RuntimeError):
    """The run stopped on purpose (sentinel, repeated non-finite steps, non-finite or dead weights);
    no bad weights were saved. ``moe-rl train`` shows it as one line (exit 2)."""

    kind = "training stopped"


@dataclass
class RunState:
    """The run's position, written into every checkpoint's meta and read back on resume.

    The counters, and the ones kept elsewhere:

    - ``step``: the next step of ``stage`` to run. In SFT one step is one optimizer step; in RL
      one step (an *RL step*) is one rollout batch: generate, score, pi_old, then
      ``train.minibatches`` optimizer steps, then a weight sync. Reset to 0 when a stage finishes.
    - ``checkpoint_seq``: the number of the newest checkpoint written, increasing across stages
      and rollbacks; it counts saves, not training. The checkpoint's name carries both:
      ``checkpoints/<checkpoint_seq>-<stage>-step-<steps of the stage done>``
      (:meth:`checkpoint_label`), e.g. ``0003-sft-step-000060``.
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
    "Multiplier on the scheduled learning rate (each sentinel rollback multiplies it down)."
    finished: list[str] = field(default_factory=list)
    "Stages that ran to the end, in order."
    completed: dict[str, int] = field(default_factory=dict)
    "Steps each finished stage ran (a resume with more steps configured continues it)."
    run_id: str | None = None
    "This run's id: its checkpoints carry it, and retention removes only those."
    metrics_offset: int | None = None
    "Bytes of ``metrics.jsonl`` at the save: a resume cuts the rows written after it (None: unknown)."
    attempt: int = 0
    "Times this run continued from a checkpoint (resume or sentinel rollback): its rows' ``attempt``."

    def to_meta(self) -> dict:
        """JSON-able form, with the key names older checkpoints used (``ckpt_seq``, ``done``)."""
        return {
            "stage": self.stage,
            "step": self.step,
            "ckpt_seq": self.checkpoint_seq,
            "sentinel": self.sentinel,
            "lr_scale": self.lr_scale,
            "done": list(self.finished),
            "completed": dict(self.completed),
            "run_id": self.run_id,
            "metrics_offset": self.metrics_offset,
            "attempt": self.attempt,
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
            completed={k: int(v) for k, v in (meta.get("completed") or {}).items()},
            run_id=meta.get("run_id"),
            metrics_offset=meta.get("metrics_offset"),
            attempt=int(meta.get("attempt", 0)),
        )

    def checkpoint_label(self) -> str:
        """What a checkpoint saved now holds: ``<stage>-step-<steps of the stage done>``
        (``sft-step-000060``; ``init-step-000000`` before any stage). At the end of a stage,
        where ``step`` is back to 0, the steps it ran (``completed``)."""
        stage = self.stage or "init"
        done = self.step
        if stage in self.finished and done == 0:
            done = self.completed.get(stage, 0)
        return f"{stage}-step-{done:06d}"

    def position(self) -> str:
        """Where the run stands, for a log line: ``rl step 4 (the stage finished)``, ``rl step 2``
        (steps of the stage done), ``the start`` before any stage."""
        if self.stage is None:
            return "the start (before any stage)"
        if self.stage in self.finished and self.step == 0:
            return f"{self.stage} step {self.completed.get(self.stage, 0)} (the stage finished)"
        return f"{self.stage} step {self.step}"

    def step_of(self, stage: str) -> int:
        """Where ``stage`` starts: the saved step if the run stopped inside it, else 0."""
        return self.step if self.stage == stage else 0


RUN_FILE = "run.json"
"""Written into ``train.out_dir`` when a run starts (or resumes): its run id and checkpoint folder.
``--resume`` continues only a checkpoint of that run (:func:`resume_conflict`)."""


def read_run_file(out_dir: str | Path) -> dict:
    """``out_dir``'s :data:`RUN_FILE` (``{}`` when there is none or it cannot be read: an older run)."""
    try:
        doc = json.loads((Path(out_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_run_file(out_dir: str | Path, run_id: str | None, root: Path) -> None:
    """Record the run ``out_dir`` holds (atomically)."""
    doc = {"run_id": run_id, "checkpoint_dir": str(root)}
    write_text(Path(out_dir) / RUN_FILE, json.dumps(doc) + "\n")


def resume_conflict(out_dir: str | Path, root: str | Path) -> str | None:
    """Why ``--resume`` of the run in ``out_dir`` must not load the newest intact checkpoint of
    ``root`` (it belongs to another run, e.g. one that wrote into a shared ``checkpoint.dir``), or
    None. Folders of runs older than :data:`RUN_FILE`, and checkpoints without a run id, pass."""
    from moe_rl.megatron.checkpoint import META, latest_checkpoint

    own = read_run_file(out_dir).get("run_id")
    ckpt = latest_checkpoint(root)  # a collective: every rank asks
    if ckpt is None or not own:
        return None
    try:
        theirs = json.loads((Path(ckpt) / META).read_text())["extra"].get("run_id")
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    if theirs is None or theirs == own:
        return None
    return (
        f"--resume: the newest checkpoint in {root} ({Path(ckpt).name}) is run {theirs}'s, but "
        f"{out_dir} holds run {own} ({RUN_FILE}): another run wrote into this checkpoint folder; "
        f"give each run its own checkpoint.dir, or drop --resume (--fresh starts over beside them)"
    )


class Checkpointer:
    """Save, resume and roll back one run's checkpoints (policy, optimizer, RNG and RunState), and
    warm-start the policy from another run's.

    Every checkpoint it writes has a number above every checkpoint already in the directory
    (either naming scheme, :mod:`moe_rl.megatron.checkpoint`), so the newest is the one written last; retention removes only this run's (``RunState.run_id``).
    """

    def __init__(self, root: str | Path, model: torch.nn.Module, *, keep: int):
        self.root = Path(root)
        "Directory of the checkpoints (``0003-sft-step-000060``, ...) and the ``latest`` pointer."
        self.model = model
        "The policy's module (its sharded state is saved)."
        self.keep = keep
        "How many checkpoints of this run to keep."
        self.last_good: Path | None = None
        "The newest checkpoint of this run that passed the checks (saved or loaded), if any."

    def exists(self) -> bool:
        """Whether the directory holds an intact checkpoint."""
        from moe_rl.megatron.checkpoint import latest_checkpoint

        return latest_checkpoint(self.root) is not None

    def any_written(self) -> list[str]:
        """Names of every checkpoint entry in the directory, intact or not (checkpoints, ``latest``)."""
        from moe_rl.megatron.checkpoint import checkpoint_dirs

        if not self.root.is_dir():
            return []
        names = [p.name for p in checkpoint_dirs(self.root)]
        return names + (["latest"] if (self.root / "latest").exists() else [])

    def save(self, optimizer: Optimizer | None, state: RunState) -> Path:
        """Write the next checkpoint with ``state`` in its meta; :class:`NonFiniteWeights` (nothing
        written, ``state`` unchanged) when the policy has a non-finite weight."""
        from moe_rl.megatron.checkpoint import checkpoint_dirs, checkpoint_name, save_checkpoint, step_number

        highest = max((step_number(p) for p in checkpoint_dirs(self.root)), default=0)
        seq = max(state.checkpoint_seq, highest) + 1
        previous, state.checkpoint_seq = state.checkpoint_seq, seq
        try:
            self.last_good = save_checkpoint(
                self.root,
                seq,
                self.model,
                optimizer,
                extra=state.to_meta(),
                keep=self.keep,
                owner=state.run_id,
                label=state.checkpoint_label(),
            )
        except BaseException as e:
            state.checkpoint_seq = previous
            self._drop_staging(seq, state)
            if is_disk_full(e):  # however megatron-core wrapped it (a CheckpointException of workers')
                raise disk_full_at(self.root / checkpoint_name(seq, state.checkpoint_label())) from e
            raise
        return self.last_good

    def _drop_staging(self, seq: int, state: RunState) -> None:
        """Remove the half-written staging folder of checkpoint ``seq`` (rank 0), if it is there."""
        from moe_rl.megatron.checkpoint import checkpoint_name

        if dist.rank() == 0:
            shutil.rmtree(
                self.root / f".tmp-{checkpoint_name(seq, state.checkpoint_label())}", ignore_errors=True
            )

    def saved_state(self) -> RunState | None:
        """The RunState of the newest intact checkpoint, read from its meta only (no tensors loaded)."""
        from moe_rl.megatron.checkpoint import META, latest_checkpoint

        ckpt = latest_checkpoint(self.root)
        if ckpt is None:
            return None
        return RunState.from_meta(json.loads((ckpt / META).read_text())["extra"])

    def load(self, optimizer: Optimizer | None) -> RunState:
        """Load the newest intact checkpoint into the policy and ``optimizer``; its RunState."""
        from moe_rl.megatron.checkpoint import load_checkpoint

        meta = load_checkpoint(self.root, self.model, optimizer)
        self.last_good = Path(meta["path"])
        state = RunState.from_meta(meta["extra"])
        log.info("resumed from %s after %s", self.last_good, state.position())
        return state

    def load_weights(self, path: str | Path) -> None:
        """Start the policy from another run's checkpoint (``checkpoint.load``): weights only."""
        from moe_rl.megatron.checkpoint import load_checkpoint

        load_checkpoint(path, self.model, load_rng=False)
        log.info("policy weights from %s", path)

    def rollback(self, optimizer: Optimizer, live: RunState, lr_factor: float) -> RunState:
        """Reload the newest (last good) checkpoint and lower the LR by ``lr_factor``.

        The sentinel's state, the run id and the LR scale are the live ones: the rollback count
        must survive the reload, and each rollback multiplies the scale down again (a checkpoint
        saved before an earlier rollback holds a higher one). The returned state is in the RL
        stage, at the RL step to continue from.
        """
        state = self.load(optimizer)
        state.sentinel, state.run_id, state.attempt = live.sentinel, live.run_id, live.attempt + 1
        state.checkpoint_seq = max(state.checkpoint_seq, live.checkpoint_seq)
        state.step, state.stage = state.step_of("rl"), "rl"
        state.lr_scale = live.lr_scale * lr_factor
        optimizer.lr_scale = state.lr_scale
        log.warning(
            "rolled back to %s (RL step %d), lr scale now %.3g", self.last_good, state.step, state.lr_scale
        )
        return state


class SaveResume:
    """The run's save and resume policy beside its :class:`Checkpointer`: a policy whose weights
    are non-finite or whose output is dead is never saved; a stop signal saves and stops; a resume
    loads the newest intact checkpoint and cuts the metrics back to it.
    :class:`~moe_rl.trainer.context.Run` is one (it holds the parts named below)."""

    recipe: Recipe
    "The resolved recipe."
    tok: Tokenizer
    "The tokenizer (the dead-output probe's token ids)."
    policy: Policy
    "The policy saved."
    optimizer: Optimizer | None
    "The optimizer saved with it."
    sink: MetricsSink
    "``metrics.jsonl``, cut back at a resume."
    state: RunState
    "The run's position, saved in every checkpoint."
    checkpointer: Checkpointer
    "Writes, finds and loads the checkpoints."
    out: Path
    "``train.out_dir``."
    signals: StopSignals
    "SIGTERM / SIGINT seen."
    make_optimizer: Callable[[str], None]
    "A fresh optimizer for a stage (:meth:`moe_rl.trainer.context.Run.make_optimizer`)."

    def save(self) -> Path:
        """Checkpoint policy, optimizer, RNG and run state (with the metrics written so far).

        A policy with a non-finite weight or a uniform output (:meth:`dead_output`) is never
        saved: :class:`TrainingStopped`, naming the last good checkpoint.
        """
        from moe_rl.megatron.checkpoint import NonFiniteWeights

        self.state.metrics_offset = self.sink.offset()
        dead = self.dead_output()
        if dead is not None:
            raise TrainingStopped(
                f"{self.state.stage} step {self.state.step}: the policy is dead ({dead}): not saved; "
                f"{self.last_good_text()}: lower optim.lr"
            )
        try:
            return self.checkpointer.save(self.optimizer, self.state)
        except NonFiniteWeights as e:
            raise TrainingStopped(
                f"{self.state.stage} step {self.state.step}: {e}; {self.last_good_text()}: "
                "lower optim.lr or check the data"
            ) from None

    @torch.no_grad()
    def dead_output(self) -> str | None:
        """Why the policy's output is dead (uniform over the vocabulary on a probe of token ids:
        entropy within ``DEAD_ENTROPY_TOL`` of ln V), or None. A forward of one short row on
        every rank (a collective under TP / EP)."""
        from moe_rl.trainer.sentinel import DEAD_ENTROPY_TOL

        v = self.recipe.model.vocab_size
        n = min(16, self.recipe.model.max_seq_len)
        probe_BT = (torch.arange(n, dtype=torch.int64) * 7 % self.tok.vocab_size)[None, :]
        entropy = self.policy.logprobs(probe_BT, with_entropy=True).entropy_BT[:, 1:].mean()
        if float(entropy) >= math.log(v) - DEAD_ENTROPY_TOL:
            return f"output uniform: entropy {float(entropy):.5f} = ln({v})"
        return None

    def last_good_text(self) -> str:
        """Where the last good checkpoint is, for a stop message (only one that passed the checks)."""
        good = self.checkpointer.last_good
        if good is None:
            return "no good checkpoint of this run was written"
        return f"the last good checkpoint is {good} (--resume continues from it)"

    def stop_if_signalled(self, where: str, *, can_save: bool = True) -> None:
        """After a step: when a rank got SIGTERM / SIGINT, save (if ``can_save`` and the weights
        pass the checks), log one line and raise :class:`StopRequested`."""
        signum = self.signals.requested()
        if not signum:
            return

        name, saved = signal.Signals(signum).name, None
        if can_save:
            try:
                saved = self.save()
            except TrainingStopped as e:
                log.warning("%s", e)
        if saved is not None:
            msg = f"{name}: stopped after {where}, checkpoint {saved} written; continue with --resume"
        else:
            msg = f"{name}: stopped after {where} without a checkpoint; {self.last_good_text()}"
        log.warning("%s", msg)
        self.signals.acted = True  # acted on: not handed on again when the run's signals are restored
        raise StopRequested(signum, msg)

    def resume(self) -> bool:
        """Load the newest intact checkpoint of this run's directory (with its stage's optimizer),
        and cut ``metrics.jsonl`` back to what was written when it was saved; True."""
        from moe_rl.megatron.checkpoint import NoCheckpoint

        conflict = resume_conflict(self.out, self.checkpointer.root)
        if conflict is not None:
            raise PathError(conflict)
        saved = self.checkpointer.saved_state()
        try:
            if saved is None:
                self.checkpointer.load(None)  # raises, naming what it skipped
            self.make_optimizer(saved.stage or "sft")
            self.state = self.checkpointer.load(self.optimizer)
        except NoCheckpoint as e:
            raise NoCheckpoint(f"nothing to resume: {e}") from None
        self.state.attempt += 1
        self.cut_rows()
        return True

    def tag_rows(self) -> None:
        """Tag the rows the sink writes from now on with this run's id and attempt."""
        self.sink.tags = {"run": self.state.run_id, "attempt": self.state.attempt}

    def cut_rows(self) -> None:
        """After a resume or a rollback: cut ``metrics.jsonl`` back to what was written when the
        checkpoint now loaded was saved (those steps run again), and tag the rows to come."""
        if self.state.metrics_offset is not None:
            removed = self.sink.truncate(self.state.metrics_offset)
            if removed:
                log.info("metrics.jsonl: removed %d rows written after the checkpoint (run again)", removed)
        self.tag_rows()
