"""Run a recipe on this process: parallel init, policy, optimizer, resume, stages.

Every rank of a torchrun / Slurm job calls :func:`run` with the same recipe.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from moe_rl.config import Recipe, to_dict
from moe_rl.trainer.signals import StopRequested, StopSignals
from moe_rl.trainer.state import Checkpointer, RunState, TrainingStopped
from moe_rl.trainer.timer import StepTimer

if TYPE_CHECKING:
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import ParallelInfo
    from moe_rl.megatron.policy import Policy
    from moe_rl.rollout.types import HFStateSource, RolloutEngine, Rollouts, SamplingParams
    from moe_rl.tasks.base import Task
    from moe_rl.tasks.tokenizer import Tokenizer
    from moe_rl.trainer.metrics import MetricsSink

log = logging.getLogger(__name__)


class Run:
    """The objects one run holds, built in dependency order; every trainer function takes it."""

    recipe: Recipe
    "The resolved recipe (benchmarks swap its algo / optim / train sections between steps)."
    tok: Tokenizer
    "The tokenizer."
    task: Task
    "The verifiable task: prompts, rewards, demonstrations."
    info: ParallelInfo
    "This process's ranks and process groups."
    policy: Policy
    "The megatron-core policy being trained."
    optimizer: Optimizer | None
    "The optimizer of the current stage (None until :meth:`make_optimizer`)."
    engine: RolloutEngine | None
    "The rollout engine (None until :meth:`ensure_engine`)."
    engine_gives_routes: bool
    "Ask the engine for every token's routed experts (free on the embedded engine; SGLang: R3 only)."
    sink: MetricsSink
    "Where metrics go (JSONL + TensorBoard, rank 0)."
    state: RunState
    "The run's position (stage, step, counters); saved in every checkpoint."
    checkpointer: Checkpointer
    "Saves, resumes and rolls back this run's checkpoints."
    out: Path
    "``train.out_dir``."
    signals: StopSignals
    "SIGTERM / SIGINT seen while :func:`run` runs the stages (installed there)."

    def __init__(self, recipe: Recipe, *, write_recipe: bool = True):
        from moe_rl.megatron.parallel import init_parallel
        from moe_rl.megatron.policy import build_policy
        from moe_rl.preflight import check_vocab
        from moe_rl.tasks import build_task, load_tokenizer
        from moe_rl.trainer.metrics import MetricsSink

        self.recipe = recipe
        self.tok = load_tokenizer(recipe.model.tokenizer)
        check_vocab(recipe, self.tok)  # `moe-rl train` runs all of preflight before this
        self.task = build_task(recipe.task)
        self._owns_dist = not torch.distributed.is_initialized()
        if recipe.rollout.engine == "sglang":  # before NCCL starts: it reads its interface once
            from moe_rl.megatron.parallel import backend_for
            from moe_rl.rollout.factory import pin_nccl_for_engines

            pin_nccl_for_engines(recipe, nccl=backend_for(recipe.parallel) == "nccl")
        self.info = init_parallel(recipe.parallel, seed=recipe.train.seed)
        self.policy = build_policy(recipe.model, recipe.parallel, self.info)
        self.optimizer = None
        self.engine = None
        self.engine_gives_routes = False
        self.out = Path(recipe.train.out_dir)
        self.sink = MetricsSink(self.out, enabled=self.info.rank == 0)
        self.state = RunState(run_id=uuid.uuid4().hex[:12])
        self.checkpointer = Checkpointer(
            checkpoint_root(recipe), self.policy.model, keep=recipe.checkpoint.keep
        )
        self.signals = StopSignals()
        self._bar = None
        if write_recipe:
            self.write_recipe()

    def write_recipe(self) -> None:
        """``<out_dir>/recipe.yaml``: the resolved recipe (rank 0)."""
        if self.info.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))

    def make_optimizer(self, stage: str) -> None:
        """A fresh optimizer for ``stage``: RL does not inherit the SFT stage's Adam moments."""
        from dataclasses import replace

        from moe_rl.megatron.optim import Optimizer

        cfg = self.recipe.optim
        lr = self.recipe.train.sft_lr
        if stage == "sft" and lr is not None:
            cfg = replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr))
        self.optimizer = Optimizer(self.policy.model, cfg, self.info)

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
        import signal

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
        raise StopRequested(signum, msg)

    def resume(self) -> bool:
        """Load the newest intact checkpoint of this run's directory (with its stage's optimizer),
        and cut ``metrics.jsonl`` back to what was written when it was saved; True."""
        from moe_rl.megatron.checkpoint import NoCheckpoint

        saved = self.checkpointer.saved_state()
        try:
            if saved is None:
                self.checkpointer.load(None)  # raises, naming what it skipped
            self.make_optimizer(saved.stage or "sft")
            self.state = self.checkpointer.load(self.optimizer)
        except NoCheckpoint as e:
            raise NoCheckpoint(f"nothing to resume: {e}") from None
        if self.state.metrics_offset is not None:
            removed = self.sink.truncate(self.state.metrics_offset)
            if removed:
                log.info("metrics.jsonl: removed %d rows written after the checkpoint (run again)", removed)
        return True

    def ensure_engine(self) -> None:
        """Build the rollout engine the recipe names (once)."""
        if self.engine is not None:
            return
        from moe_rl.rollout import get_engine_class

        rollout_cfg = self.recipe.rollout
        if rollout_cfg.engine == "embedded":
            self.engine = get_engine_class("embedded")(
                self.policy,
                pad_id=self.tok.pad_id,
                eos_id=self.tok.eos_id,
                decoder=rollout_cfg.embedded_decoder,
                dtype=self.recipe.rollout_dtype,
                router_dtype=rollout_cfg.router_dtype,
            )
            self.engine_gives_routes = True  # free: captured during generation
        else:
            from moe_rl.rollout.factory import build_sglang_engine

            self.engine = build_sglang_engine(
                self.recipe, policy=self.policy, tokenizer=self.tok, out=self.out, rank=self.info.rank
            )
            self.engine_gives_routes = self.recipe.algo.routing == "r3"

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """The engine's ``n`` rollouts of each prompt, on the policy's device: the trainer's one
        device boundary (engines return host tensors; everything the step computes from the batch
        lives on the policy's device, as NCCL's collectives need). The engine works with the
        trainer's memory on the host where it shares the GPUs (:meth:`memory_for_engine`)."""
        with self.memory_for_engine(weights=True):  # a rollout reads no trainer tensor
            rollouts = self.engine.generate(prompt_ids, n, sampling)
        return rollouts.to(self.info.device)

    def push_weights(self) -> None:
        """The policy's weights to the engine, which then serves version ``optimizer.step_count``."""
        with self.memory_for_engine(weights=False):  # a push reads the weights
            self.engine.update_weights(self.weights_for_engine(), str(self.optimizer.step_count))

    @contextlib.contextmanager
    def memory_for_engine(self, *, weights: bool) -> Iterator[None]:
        """Around an engine's work on the trainer's own GPUs (``rollout.colocated`` with
        ``rollout.sglang.offload_trainer``): the trainer's gradients and Adam state (and, with
        ``weights``, its weights) wait in host memory; a no-op elsewhere. Every tensor is back, as
        it was, when the block ends."""
        cfg = self.recipe.rollout
        if not (cfg.colocated and cfg.sglang.offload_trainer and self.optimizer):
            yield
            return
        self.optimizer.release_memory(weights=weights)
        try:
            yield
        finally:
            self.optimizer.resume_memory()

    def weights_for_engine(self) -> HFStateSource | None:
        """What ``engine.update_weights`` reads: None for the embedded engine (it shares the
        policy's weights in process), else the policy's weights under HF names."""
        if self.recipe.rollout.engine == "embedded":
            return None
        from moe_rl.megatron.hf import PolicyHFSource

        return PolicyHFSource(self.policy)

    def progress(self, step: int, total: int, metrics: dict[str, float]) -> None:
        """A progress bar with reward and step time on rank 0's terminal."""
        if self.info.rank != 0:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=step, desc="rl", dynamic_ncols=True)
        self._bar.update(1)
        self._bar.set_postfix(
            reward=f"{metrics.get('reward/mean', 0):.3f}",
            acc=f"{metrics.get('reward/accuracy', 0):.2f}",
            flip=f"{metrics.get('flip/step/rate', float('nan')):.3f}",
            step_s=f"{metrics.get('time/step', 0):.1f}",
        )

    def close(self) -> None:
        """Flush metrics, stop the engine, and end the process groups this run started."""
        self.sink.close()
        if self._bar is not None:
            self._bar.close()
        if self.engine is not None:
            self.engine.close()
        if self._owns_dist and torch.distributed.is_initialized():
            from moe_rl.megatron.parallel import destroy_parallel

            destroy_parallel()


def run_sft(run: Run) -> dict[str, float]:
    """The SFT stage; resumable at any checkpoint.

    Guards as in RL: a step with a non-finite loss or gradient is skipped (the optimizer applies
    nothing) and counted; ``train.max_bad_steps`` in a row stop the run, and no periodic
    checkpoint is written inside such a streak. A step with a gradient norm of exactly 0 means a
    dead policy (uniform output): the run stops, nothing saved. A signal stops it after the step.
    """
    from moe_rl.trainer.sft import sft_batch, sft_step

    cfg = run.recipe.train
    start = run.state.step_of("sft")
    run.state.stage = "sft"
    metrics: dict[str, float] = {}
    bad_steps = 0
    for step in range(start, cfg.sft_steps):
        timer = StepTimer()
        with timer.record("step"):
            tokens_BT, mask_BT = sft_batch(
                run.task,
                run.tok,
                step=step,
                batch_size=cfg.sft_batch_size,
                seed=cfg.seed,
                max_len=run.recipe.model.max_seq_len,
            )
            metrics = sft_step(run.policy, run.optimizer, tokens_BT, mask_BT, run.info)
        metrics["step_s"] = timer.total()
        run.sink.log(step, "sft", metrics)
        if run.info.rank == 0 and (step % cfg.log_every == 0 or step == cfg.sft_steps - 1):
            log.info(
                "sft step %d/%d loss %.4f grad_norm %.3f %.3fs",
                step + 1,
                cfg.sft_steps,
                metrics["loss"],
                metrics["grad_norm"],
                metrics["step_s"],
            )
        bad_steps = _sft_guard(run, metrics, bad_steps, step)
        run.state.step = step + 1
        run.stop_if_signalled(f"sft step {step + 1}", can_save=bad_steps == 0)
        every = run.recipe.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < cfg.sft_steps:
            if bad_steps:
                log.warning("sft step %d: no checkpoint inside a streak of skipped steps", step + 1)
            else:
                run.save()
    return metrics


def _sft_guard(run: Run, metrics: dict[str, float], bad_steps: int, step: int) -> int:
    """Consecutive skipped (non-finite) SFT steps; stop at ``train.max_bad_steps`` or a dead policy."""
    skipped = bool(metrics.get("skipped")) or not math.isfinite(metrics["loss"])
    bad_steps = bad_steps + 1 if skipped else 0
    if bad_steps >= run.recipe.train.max_bad_steps:
        raise TrainingStopped(
            f"{bad_steps} consecutive SFT steps had non-finite loss or gradients (each skipped); "
            f"stopping at sft step {step + 1}, nothing saved; {run.last_good_text()}: "
            "lower optim.lr (or train.sft_lr) or check the data"
        )
    if not skipped and metrics["grad_norm"] == 0.0:
        raise TrainingStopped(
            f"the policy is dead at sft step {step + 1} (gradient norm exactly 0: uniform output), "
            f"nothing saved; {run.last_good_text()}: lower optim.lr (or train.sft_lr)"
        )
    return bad_steps


def _run_rl(run: Run) -> dict[str, float]:
    from moe_rl.trainer.loop import run_rl

    return run_rl(run)


STAGES = {"sft": run_sft, "rl": _run_rl}


def check_out_dir(recipe: Recipe, *, resume: bool, fresh: bool) -> None:
    """Refuse to train into a directory holding another run's checkpoints without ``--resume``
    (or ``--fresh``), and ``--resume`` with nothing to resume; before any process group starts."""
    from moe_rl.errors import PathError

    if resume and fresh:
        raise PathError("--resume continues the run in train.out_dir and --fresh starts over: give one")
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


def checkpoint_root(recipe: Recipe) -> Path:
    """Where a recipe's run keeps its checkpoints: ``checkpoint.dir``, else ``<out_dir>/checkpoints``."""
    return Path(recipe.checkpoint.dir or Path(recipe.train.out_dir) / "checkpoints")


def run(recipe: Recipe, *, resume: bool = False, fresh: bool = False) -> dict[str, dict[str, float]]:
    """Run every stage of ``recipe``; return the last metrics of each.

    ``resume``: continue from the newest intact checkpoint of the run's directory (a finished
    stage with more steps configured continues to the new total). ``fresh``: start over in a
    directory holding an earlier run's checkpoints; they are left as they are (this run's
    retention removes only its own, numbered after them) and ``metrics.jsonl`` continues with
    the new run's rows. Without either, such a directory is refused (:func:`check_out_dir`).
    SIGTERM / SIGINT stop the run after the current step with a checkpoint
    (:class:`~moe_rl.trainer.signals.StopRequested`).
    """
    check_out_dir(recipe, resume=resume, fresh=fresh)
    the_run = Run(recipe, write_recipe=False)  # written once the resume, if any, succeeded
    try:
        resumed = resume and the_run.resume()
        the_run.write_recipe()
        if not resumed and recipe.checkpoint.load:
            the_run.checkpointer.load_weights(recipe.checkpoint.load)
        with the_run.signals:
            return _run_stages(the_run, resumed)
    finally:
        the_run.close()


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
        run.save()
    if resumed and not results:
        done = ", ".join(f"{s} {run.state.completed.get(s, '?')} steps" for s in run.state.finished)
        log.info(
            "%s: the run already finished (%s); nothing to do: raise train.*_steps to continue", run.out, done
        )
    return results
