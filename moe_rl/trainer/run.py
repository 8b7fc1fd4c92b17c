"""Run a recipe on this process: check the output directory, build the run's context
(:class:`~moe_rl.trainer.context.Run`: parallel init, policy, ...), resume, and run the stages.

Every rank of a torchrun / Slurm job calls :func:`run` with the same recipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moe_rl.config import Recipe
from moe_rl.errors import PathError
from moe_rl.mainguard import check_main_guard
from moe_rl.outputs import enclosing_checkpoint_folder, run_markers
from moe_rl.tasks.base import make_rng
from moe_rl.trainer.context import Run, checkpoint_root
from moe_rl.trainer.hooks import OptimizerStep, StepHook
from moe_rl.trainer.loop import run_rl
from moe_rl.trainer.progress import Progress
from moe_rl.trainer.run_lock import hold_run_dir
from moe_rl.trainer.sft import run_sft
from moe_rl.trainer.state import Checkpointer, TrainingStopped

__all__ = ["STAGES", "Run", "check_out_dir", "checkpoint_root", "run"]  # Run: where callers found it

log = logging.getLogger(__name__)

STAGES = {"sft": run_sft, "rl": run_rl}
"The stages a recipe's ``train.stages`` names, in the order it names them."


def check_out_dir(recipe: Recipe, *, resume: bool, fresh: bool) -> None:
    """Refuse to train into a directory holding another run's checkpoints without ``--resume``
    (or ``--fresh``), and ``--resume`` with nothing to resume; before any process group starts."""
    if resume and fresh:
        raise PathError("--resume continues the run in train.out_dir and --fresh starts over: give one")
    out = Path(recipe.train.out_dir).resolve()
    own = checkpoint_root(recipe).resolve() == out  # checkpoint.dir = train.out_dir: its own checkpoints
    is_one = not own and any(m in ("meta.json", "latest") or "/" in m for m in run_markers(out))
    inside = out if is_one else enclosing_checkpoint_folder(out)
    if inside is not None:
        raise PathError(
            f"train.out_dir {recipe.train.out_dir} is or sits inside a run's checkpoint folder ({inside}): "
            "a run writes beside its checkpoints, never among another run's; give another train.out_dir"
        )
    root = checkpoint_root(recipe)
    probe = Checkpointer(root, None, keep=recipe.checkpoint.keep)
    found = probe.any_written()
    if resume and not found:
        raise PathError(
            f"nothing to resume in {root}: it holds no checkpoints; drop --resume to start the run "
            "(or point train.out_dir / checkpoint.dir at the run to continue)"
        )
    if not resume and not fresh and found:
        shown = ", ".join(found[-3:])
        raise PathError(
            f"{root} holds another run's checkpoints ({shown}): continue it with --resume, train "
            "into a new train.out_dir, or --fresh to start over beside them (they are kept)"
        )


def run(
    recipe: Recipe,
    *,
    resume: bool = False,
    fresh: bool = False,
    hooks: Iterable[StepHook | Callable[[OptimizerStep], object]] = (),
) -> dict[str, dict[str, float]]:
    """Run every stage of ``recipe``; return the last metrics of each.

    ``resume``: continue from the newest intact checkpoint of the run's directory (a finished
    stage with more steps configured continues to the new total). ``fresh``: start over in a
    directory holding an earlier run's checkpoints; they are left as they are (this run's
    retention removes only its own, numbered after them) and ``metrics.jsonl`` continues with
    the new run's rows. Without either, such a directory is refused (:func:`check_out_dir`).
    SIGTERM / SIGINT stop the run after the current step with a checkpoint
    (:class:`~moe_rl.trainer.signals.StopRequested`). ``hooks``: called after each optimizer step
    of every stage, after the flip probe (:meth:`Run.add_hook`, :mod:`moe_rl.trainer.hooks`).
    """
    check_main_guard("training")  # a checkpoint save starts a child process: the script needs its guard
    with hold_run_dirs(recipe):  # one run per folder (run_lock.py), before any write
        check_out_dir(recipe, resume=resume, fresh=fresh)
        rank0 = os.environ.get("RANK", "0") == "0"  # no process group yet: torchrun's RANK
        progress = Progress(recipe.train.out_dir, enabled=rank0)
        progress.phase("start", "process groups, the policy and its weights")
        try:
            return _run(recipe, resume, hooks)
        finally:
            progress.remove()  # progress.json says where a live run is: it goes with the run


def _run(recipe: Recipe, resume: bool, hooks) -> dict[str, dict[str, float]]:
    the_run = Run(recipe, write_recipe=False)  # written once the resume, if any, succeeded
    try:
        for hook in hooks:
            the_run.add_hook(hook)
        if resume:
            the_run.phases.phase("resume", "the newest intact checkpoint")
        resumed = resume and the_run.resume()
        the_run.write_recipe()
        if not resumed and recipe.checkpoint.load:
            the_run.checkpointer.load_weights(recipe.checkpoint.load)
        if not resumed and recipe.train.start_jitter:
            jitter_weights(the_run.policy, recipe.train.start_jitter, recipe.train.seed)
        check_start_finite(the_run, resumed)
        with the_run.signals:
            return _run_stages(the_run, resumed)
    finally:
        the_run.close()


@contextlib.contextmanager
def hold_run_dirs(recipe: Recipe):
    """Hold every folder the run writes for its life: ``train.out_dir`` and its checkpoint folder
    (``checkpoint.dir``, else ``<out_dir>/checkpoints``), so a second run sharing either with a
    live one is refused naming the holder (rank 0 takes them; :func:`hold_run_dir`)."""
    out, root = Path(recipe.train.out_dir), checkpoint_root(recipe)
    with contextlib.ExitStack() as held:
        held.enter_context(hold_run_dir(out))
        if root.resolve() != out.resolve():
            held.enter_context(hold_run_dir(root, what="checkpoint.dir"))
        yield


def _run_stages(run: Run, resumed: bool) -> dict[str, dict[str, float]]:
    cfg, results = run.recipe.train, {}
    for stage in cfg.stages:
        steps = {"sft": cfg.sft_steps, "rl": cfg.rl_steps}[stage]
        if stage in run.state.finished:
            done = run.state.completed.get(stage)
            if done is not None and done < steps and stage != run.state.stage:
                log.warning(
                    "%s ran %d steps and a later stage ran since: not continued to %d", stage, done, steps
                )
            if done is None or done >= steps or stage != run.state.stage:
                continue
            log.info("%s finished %d steps: continuing to train.%s_steps=%d", stage, done, stage, steps)
            run.state.finished.remove(stage)
            run.state.step = done
        elif not (resumed and run.state.stage == stage):
            run.make_optimizer(stage)
        results[stage] = STAGES[stage](run)
        run.state.finished.append(stage)
        run.state.completed[stage] = steps
        run.state.step = 0
        run.phases.phase("checkpoint", f"the finished {stage} stage")
        run.save()
    run.phases.phase("done")
    if resumed and not results:
        done = ", ".join(f"{s} {run.state.completed.get(s, '?')} steps" for s in run.state.finished)
        log.info(
            "%s: the run already finished (%s); nothing to do: raise train.*_steps to continue", run.out, done
        )
    return results


def check_start_finite(run: Run, resumed: bool) -> None:
    """The weights a run starts (or resumes) from are finite: else a :class:`TrainingStopped`
    naming them and where they came from, before a step (they would make every step's loss NaN,
    which the stop message would blame on the learning rate)."""
    from moe_rl.megatron.checkpoint import non_finite_names, weights_finite

    if weights_finite(run.policy.model):
        return
    r = run.recipe
    source = (
        f"the checkpoint resumed ({run.checkpointer.last_good})"
        if resumed
        else f"checkpoint.load={r.checkpoint.load}"
        if r.checkpoint.load
        else f"model.hf_path={r.model.hf_path}"
        if r.model.hf_path
        else "the initialisation"
    )
    if not resumed and r.train.start_jitter:
        source += f" with train.start_jitter={r.train.start_jitter}"
    bad = non_finite_names(run.policy.model)
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise TrainingStopped(
        f"the start weights hold NaN or infinite values ({', '.join(bad[:3]) or 'on another rank'}{more}), "
        f"from {source}: nothing trained; start from finite weights"
    )


@torch.no_grad()
def jitter_weights(policy, std: float, seed: int) -> None:
    """Add N(0, std^2) noise to every weight of ``policy`` (``train.start_jitter``), drawn on the
    host from ``seed`` in parameter order, so the perturbation is the same on every machine."""
    g = torch.Generator().manual_seed(make_rng("start_jitter", seed).randrange(2**63))
    for p in policy.model.parameters():
        p.add_((torch.randn(p.shape, generator=g) * std).to(p))
