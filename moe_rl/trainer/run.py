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
        from moe_rl.megatron.optim import Optimizer
        from moe_rl.megatron.parallel import init_parallel
        from moe_rl.megatron.policy import build_policy
        from moe_rl.tasks import build_task, load_tokenizer
        from moe_rl.trainer.metrics import MetricsSink

        self.recipe = recipe
        self.tok = load_tokenizer(recipe.model.tokenizer)
        if recipe.model.vocab_size < self.tok.vocab_size:
            raise ConfigError(f"model.vocab_size={recipe.model.vocab_size} is smaller than the "
                              f"tokenizer's {self.tok.vocab_size} ids: set model.vocab_size="
                              f"{self.tok.vocab_size} (rounded up to a multiple of tensor_parallel)")
        self.task = build_task(recipe.task)
        self.info = init_parallel(recipe.parallel, seed=recipe.train.seed)
        self.policy = build_policy(recipe.model, recipe.parallel, self.info)
        self.optimizer = Optimizer(self.policy.parameters(), recipe.optim, self.info)
        self.out = Path(recipe.train.out_dir)
        self.sink = MetricsSink(self.out, enabled=self.info.rank == 0)
        self.state = {"stage": None, "step": 0, "done": []}
        if self.info.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "recipe.yaml").write_text(yaml.safe_dump(to_dict(recipe), sort_keys=False))

    def save(self, step: int) -> None:
        from moe_rl.megatron.checkpoint import save_checkpoint

        root = self.recipe.checkpoint.dir or str(self.out / "checkpoints")
        save_checkpoint(root, step, self.policy.model, self.optimizer, extra=self.state,
                        keep=self.recipe.checkpoint.keep)

    def resume(self) -> bool:
        """Load the newest checkpoint of this run's directory, if any."""
        from moe_rl.megatron.checkpoint import latest_checkpoint, load_checkpoint

        root = self.recipe.checkpoint.dir or str(self.out / "checkpoints")
        if latest_checkpoint(root) is None:
            return False
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
        tokens, mask = sft_batch(r.task, r.tok, step=step, batch_size=cfg.sft_batch_size,
                                 seed=cfg.seed, max_len=r.recipe.model.max_seq_len)
        last = sft_step(r.policy, r.optimizer, tokens, mask, r.info)
        last["step_s"] = time.perf_counter() - t0
        r.sink.log(step, "sft", last)
        if r.info.rank == 0 and (step % cfg.log_every == 0 or step == cfg.sft_steps - 1):
            log.info("sft step %d/%d loss %.4f grad_norm %.3f %.3fs", step + 1, cfg.sft_steps,
                     last["loss"], last["grad_norm"], last["step_s"])
        r.state["step"] = step + 1
        every = r.recipe.checkpoint.every
        if every and (step + 1) % every == 0 and step + 1 < cfg.sft_steps:
            r.save(step + 1)
    return last


STAGES = {"sft": run_sft}


def run(recipe: Recipe, *, resume: bool = False) -> dict:
    """Run every stage of ``recipe``; return the last metrics of each."""
    r = Run(recipe)
    if resume:
        r.resume()
    elif recipe.checkpoint.load:
        from moe_rl.megatron.checkpoint import load_checkpoint

        load_checkpoint(recipe.checkpoint.load, r.policy.model)
    results = {}
    for stage in recipe.train.stages:
        if stage in r.state.get("done", []):
            continue
        if stage not in STAGES:
            raise ConfigError(f"train.stages has {stage!r}, which this version cannot run; "
                              f"available: {', '.join(STAGES)}")
        results[stage] = STAGES[stage](r)
        r.state["done"] = [*r.state.get("done", []), stage]
        r.state["step"] = 0
        r.save(r.optimizer.step_count)
    r.sink.close()
    if torch.distributed.is_initialized():
        from moe_rl.megatron.parallel import destroy_parallel

        destroy_parallel()
    return results
