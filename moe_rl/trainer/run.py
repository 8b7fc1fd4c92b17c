"""Run a recipe on this process: parallel init, policy, optimizer, resume, stages.

Every rank of a torchrun / Slurm job calls :func:`run` with the same recipe.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import yaml

from moe_rl.config import ConfigError, Recipe, to_dict

log = logging.getLogger(__name__)


class Run:
    """The objects one run holds, built in dependency order."""

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
        self.owns_dist = not torch.distributed.is_initialized()
        self.info = init_parallel(recipe.parallel, seed=recipe.train.seed)
        self.policy = build_policy(recipe.model, recipe.parallel, self.info)
        self.optimizer = None
        self.out = Path(recipe.train.out_dir)
        self.sink = MetricsSink(self.out, enabled=self.info.rank == 0)
        self.state = {"stage": None, "step": 0, "done": []}
        self.engine = None
        self.engine_returns_routes = False
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
        self.optimizer = Optimizer(self.policy.parameters(), cfg, self.info)

    def ckpt_root(self) -> str:
        return self.recipe.checkpoint.dir or str(self.out / "checkpoints")

    def has_checkpoint(self) -> bool:
        from moe_rl.megatron.checkpoint import latest_checkpoint

        return latest_checkpoint(self.ckpt_root()) is not None

    def save(self) -> None:
        """Checkpoint policy, optimizer, RNG and run state; names increase across stages."""
        from moe_rl.megatron.checkpoint import save_checkpoint

        root = self.ckpt_root()
        self.state["ckpt_seq"] = self.state.get("ckpt_seq", 0) + 1
        save_checkpoint(
            root,
            self.state["ckpt_seq"],
            self.policy.model,
            self.optimizer,
            extra=self.state,
            keep=self.recipe.checkpoint.keep,
        )

    def close(self) -> None:
        """Flush metrics, stop the engine, and end the process groups this run started."""
        self.sink.close()
        if self._bar is not None:
            self._bar.close()
        if self.engine is not None:
            self.engine.close()
        if self.owns_dist and torch.distributed.is_initialized():
            from moe_rl.megatron.parallel import destroy_parallel

            destroy_parallel()

    def ensure_engine(self) -> None:
        """Build the rollout engine the recipe names (once)."""
        if self.engine is not None:
            return
        from moe_rl.rollout import get_engine_class

        ro = self.recipe.rollout
        if ro.engine == "embedded":
            self.engine = get_engine_class("embedded")(
                self.policy, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id, decoder=ro.embedded_decoder
            )
            self.engine_returns_routes = True  # free: captured during generation
        else:
            from moe_rl.rollout.factory import build_sglang_engine

            self.engine = build_sglang_engine(self)
            self.engine_returns_routes = self.recipe.algo.routing == "r3"

    def weight_source(self):
        """What the engine reads new weights from (the policy, in HF names)."""
        if self.recipe.rollout.engine == "embedded":
            return None  # shares the policy's weights in process
        from moe_rl.megatron.hf import PolicyHFSource

        return PolicyHFSource(self.policy)

    def progress(self, step: int, total: int, m: dict) -> None:
        """A progress bar with reward and step time on rank 0's terminal."""
        if self.info.rank != 0:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=step, desc="rl", dynamic_ncols=True)
        self._bar.update(1)
        self._bar.set_postfix(
            reward=f"{m.get('reward/mean', 0):.3f}",
            acc=f"{m.get('reward/accuracy', 0):.2f}",
            flip=f"{m.get('flip/step/rate', float('nan')):.3f}",
            step_s=f"{m.get('time/step', 0):.1f}",
        )

    def rollback(self, lr_factor: float) -> int:
        """Reload the last good checkpoint, lower the LR; return the RL step to continue from."""
        from moe_rl.megatron.checkpoint import load_checkpoint

        root = self.ckpt_root()
        keep_sentinel = self.state.get("sentinel")
        meta = load_checkpoint(root, self.policy.model, self.optimizer)
        self.state = {**meta["extra"], "sentinel": keep_sentinel}
        self.optimizer.lr_scale = self.state.get("lr_scale", 1.0) * lr_factor
        self.state["lr_scale"] = self.optimizer.lr_scale
        step = self.state["step"] if self.state.get("stage") == "rl" else 0
        self.state.update(stage="rl", step=step)
        log.warning("rolled back to %s (RL step %d), lr scale now %.3g", root, step, self.optimizer.lr_scale)
        return step

    def resume(self) -> bool:
        """Load the newest checkpoint of this run's directory, if any."""
        from moe_rl.megatron.checkpoint import latest_checkpoint, load_checkpoint

        root = self.ckpt_root()
        ckpt = latest_checkpoint(root)
        if ckpt is None:
            return False
        import json

        extra = json.loads((ckpt / "meta.json").read_text())["extra"]
        self.make_optimizer(extra.get("stage") or "sft")
        meta = load_checkpoint(root, self.policy.model, self.optimizer)
        self.state = meta["extra"]
        log.info("resumed from %s at %s step %s", root, self.state["stage"], self.state["step"])
        return True


def run_sft(r: Run) -> dict:
    """The SFT stage; resumable at any checkpoint."""
    from moe_rl.trainer.sft import sft_batch, sft_step

    cfg = r.recipe.train
    start = r.state["step"] if r.state.get("stage") == "sft" else 0
    r.state["stage"] = "sft"
    last = {}
    for step in range(start, cfg.sft_steps):
        t0 = time.perf_counter()
        tokens, mask = sft_batch(
            r.task,
            r.tok,
            step=step,
            batch_size=cfg.sft_batch_size,
            seed=cfg.seed,
            max_len=r.recipe.model.max_seq_len,
        )
        last = sft_step(r.policy, r.optimizer, tokens, mask, r.info)
        last["step_s"] = time.perf_counter() - t0
        r.sink.log(step, "sft", last)
        if r.info.rank == 0 and (step % cfg.log_every == 0 or step == cfg.sft_steps - 1):
            log.info(
                "sft step %d/%d loss %.4f grad_norm %.3f %.3fs",
                step + 1,
                cfg.sft_steps,
                last["loss"],
                last["grad_norm"],
                last["step_s"],
            )
        r.state["step"] = step + 1
        every = r.recipe.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < cfg.sft_steps:
            r.save()
    return last


def _run_rl(r: Run) -> dict:
    from moe_rl.trainer.loop import run_rl

    return run_rl(r)


STAGES = {"sft": run_sft, "rl": _run_rl}


def run(recipe: Recipe, *, resume: bool = False) -> dict:
    """Run every stage of ``recipe``; return the last metrics of each."""
    r = Run(recipe)
    resumed = resume and r.resume()
    if not resumed and recipe.checkpoint.load:
        from moe_rl.megatron.checkpoint import load_checkpoint

        load_checkpoint(recipe.checkpoint.load, r.policy.model, load_rng=False)
    results = {}
    try:
        results = _run_stages(r, resumed)
    finally:
        r.close()
    return results


def _run_stages(r: Run, resumed: bool) -> dict:
    results = {}
    for stage in r.recipe.train.stages:
        if stage in r.state.get("done", []):
            continue
        if not (resumed and r.state.get("stage") == stage):
            r.make_optimizer(stage)
        results[stage] = STAGES[stage](r)
        r.state["done"] = [*r.state.get("done", []), stage]
        r.state["step"] = 0
        r.save()
    return results
