"""Run a recipe on this process: parallel init, policy, optimizer, resume, stages.

Every rank of a torchrun / Slurm job calls :func:`run` with the same recipe.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from moe_rl.config import ConfigError, Recipe, to_dict
from moe_rl.trainer.state import Checkpointer, RunState
from moe_rl.trainer.timer import StepTimer

if TYPE_CHECKING:
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import ParallelInfo
    from moe_rl.megatron.policy import Policy
    from moe_rl.rollout.types import HFStateSource, RolloutEngine
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

    def __init__(self, recipe: Recipe):
        from moe_rl.megatron.parallel import init_parallel
        from moe_rl.megatron.policy import build_policy
        from moe_rl.tasks import build_task, load_tokenizer
        from moe_rl.trainer.metrics import MetricsSink

        self.recipe = recipe
        self.tok = load_tokenizer(recipe.model.tokenizer)
        if recipe.model.vocab_size < self.tok.vocab_size:
            raise ConfigError(
                f"model.vocab_size={recipe.model.vocab_size} is smaller than the "
                f"tokenizer's {self.tok.vocab_size} ids: set model.vocab_size="
                f"{self.tok.vocab_size} (rounded up to a multiple of tensor_parallel)"
            )
        self.task = build_task(recipe.task)
        self._owns_dist = not torch.distributed.is_initialized()
        self.info = init_parallel(recipe.parallel, seed=recipe.train.seed)
        self.policy = build_policy(recipe.model, recipe.parallel, self.info)
        self.optimizer = None
        self.engine = None
        self.engine_gives_routes = False
        self.out = Path(recipe.train.out_dir)
        self.sink = MetricsSink(self.out, enabled=self.info.rank == 0)
        self.state = RunState()
        root = recipe.checkpoint.dir or str(self.out / "checkpoints")
        self.checkpointer = Checkpointer(root, self.policy.model, keep=recipe.checkpoint.keep)
        self._bar = None
        if self.info.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.yaml").write_text(yaml.safe_dump(to_dict(recipe), sort_keys=False))

    def make_optimizer(self, stage: str) -> None:
        """A fresh optimizer for ``stage``: RL does not inherit the SFT stage's Adam moments."""
        from dataclasses import replace

        from moe_rl.megatron.optim import Optimizer

        cfg = self.recipe.optim
        lr = self.recipe.train.sft_lr
        if stage == "sft" and lr is not None:
            cfg = replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr))
        self.optimizer = Optimizer(self.policy.model, cfg, self.info)

    def save(self) -> None:
        """Checkpoint policy, optimizer, RNG and run state."""
        self.checkpointer.save(self.optimizer, self.state)

    def resume(self) -> bool:
        """Load the newest checkpoint of this run's directory, if any (with its stage's optimizer)."""
        saved = self.checkpointer.saved_state()
        if saved is None:
            return False
        self.make_optimizer(saved.stage or "sft")
        self.state = self.checkpointer.load(self.optimizer)
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
                dtype=rollout_cfg.dtype,
                router_dtype=rollout_cfg.router_dtype,
            )
            self.engine_gives_routes = True  # free: captured during generation
        else:
            from moe_rl.rollout.factory import build_sglang_engine

            self.engine = build_sglang_engine(self)
            self.engine_gives_routes = self.recipe.algo.routing == "r3"

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
    """The SFT stage; resumable at any checkpoint."""
    from moe_rl.trainer.sft import sft_batch, sft_step

    cfg = run.recipe.train
    start = run.state.step_of("sft")
    run.state.stage = "sft"
    metrics: dict[str, float] = {}
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
        run.state.step = step + 1
        every = run.recipe.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < cfg.sft_steps:
            run.save()
    return metrics


def _run_rl(run: Run) -> dict[str, float]:
    from moe_rl.trainer.loop import run_rl

    return run_rl(run)


STAGES = {"sft": run_sft, "rl": _run_rl}


def run(recipe: Recipe, *, resume: bool = False) -> dict[str, dict[str, float]]:
    """Run every stage of ``recipe``; return the last metrics of each."""
    the_run = Run(recipe)
    resumed = resume and the_run.resume()
    if not resumed and recipe.checkpoint.load:
        the_run.checkpointer.load_weights(recipe.checkpoint.load)
    try:
        return _run_stages(the_run, resumed)
    finally:
        the_run.close()


def _run_stages(run: Run, resumed: bool) -> dict[str, dict[str, float]]:
    results = {}
    for stage in run.recipe.train.stages:
        if stage in run.state.finished:
            continue
        if not (resumed and run.state.stage == stage):
            run.make_optimizer(stage)
        results[stage] = STAGES[stage](run)
        run.state.finished.append(stage)
        run.state.step = 0
        run.save()
    return results
