"""SFT warm start: teacher-forced training on a task's demonstrations; the SFT stage (:func:`run_sft`).

Shape legend: B = demonstrations, T = padded prompt + response tokens.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from moe_rl.dist import all_reduce
from moe_rl.tasks.base import make_rng
from moe_rl.trainer.hooks import OptimizerStep
from moe_rl.trainer.stage import Stage, run_stage
from moe_rl.trainer.state import TrainingStopped
from moe_rl.trainer.timer import StepTimer

if TYPE_CHECKING:
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import ParallelInfo
    from moe_rl.megatron.policy import Policy
    from moe_rl.tasks.base import Task
    from moe_rl.tasks.tokenizer import Tokenizer
    from moe_rl.trainer.context import Run

log = logging.getLogger(__name__)


def encode_pair(tok: Tokenizer, prompt: str, response: str | None, max_len: int) -> tuple[list[int], int]:
    """``<bos> prompt`` (+ ``response <eos>``) ids truncated to ``max_len``, and the prompt length."""
    bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
    prompt_ids = bos + tok.encode(prompt)
    response_ids = [] if response is None else tok.encode(response) + [tok.eos_id]
    ids = (prompt_ids + response_ids)[:max_len]
    return ids, min(len(prompt_ids), max_len)


def pad_batch(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Right-pad id lists to ``[B, T]`` int64."""
    t = max(len(row) for row in rows)
    out = torch.full((len(rows), t), pad_id, dtype=torch.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def sft_batch(task: Task, tok: Tokenizer, *, step: int, batch_size: int, seed: int, max_len: int):
    """Demonstrations of SFT step ``step`` as ``tokens_BT`` and a response ``mask_BT``."""
    demo_seed = make_rng("sft", seed, step).randrange(2**31)
    rows, plens = [], []
    for prompt, response in task.demonstrations(batch_size, demo_seed):
        ids, plen = encode_pair(tok, prompt, response, max_len)
        rows.append(ids)
        plens.append(plen)
    tokens = pad_batch(rows, tok.pad_id)
    pos = torch.arange(tokens.shape[1])[None, :]
    lens = torch.tensor([len(row) for row in rows])[:, None]
    mask = ((pos >= torch.tensor(plens)[:, None]) & (pos < lens)).float()
    return tokens, mask


def sft_step(
    policy: Policy, optimizer: Optimizer, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, info: ParallelInfo
) -> dict[str, float]:
    """One optimizer step of token-mean NLL on this rank's data-parallel share of the batch."""
    rows = tokens_BT.shape[0] // info.dp_size
    sl = slice(info.dp_rank * rows, (info.dp_rank + 1) * rows)
    tokens, mask = tokens_BT[sl], mask_BT[sl].to(info.device)
    n_tokens = float(mask_BT.sum())
    out = policy.logprobs(tokens)
    loss = -(out.logp_BT * mask).sum() / n_tokens
    loss.backward()
    stats = optimizer.step()
    nll = loss.detach().clone()
    all_reduce(nll, info.dp_group)
    return {"loss": float(nll), "tokens": n_tokens, **stats}


def run_sft(run: Run) -> dict[str, float]:
    """The SFT stage; resumable at any checkpoint. Its loop (:func:`moe_rl.trainer.stage.run_stage`)
    skips and counts steps with a non-finite loss or gradient (the optimizer applies nothing),
    stops after ``train.max_bad_steps`` of them in a row, writes no periodic checkpoint inside such
    a streak, and stops after the step on a signal. A gradient norm of exactly 0 means a dead policy
    (uniform output): the run stops, nothing saved. The run's hooks see every optimizer step.

    SFT routes without ``train.route_noise`` (RL's pi_old, training and probe forwards, seeded per
    RL step): its forwards run in no routing session, so with no selection noise
    (:func:`moe_rl.megatron.routing.routed_with`). An SFT start is shared by runs of any noise (its
    signature leaves the knob out), and a resumed SFT trains as the uninterrupted one did."""
    run.state.step, run.state.stage = run.state.step_of("sft"), "sft"
    return run_stage(run, SFTStage(run, run.recipe.train.sft_steps))


class SFTStage(Stage):
    """SFT's steps for :func:`run_stage`: one optimizer step of token-mean NLL on demonstrations."""

    name = "sft"
    advice = "lower optim.lr (or train.sft_lr) or check the data"

    def step(self, step: int) -> tuple[dict[str, float], bool]:
        run, cfg, timer = self.run, self.run.recipe.train, StepTimer()
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
        event = OptimizerStep(run, "sft", step, 0, 1, dict(metrics))
        for hook in run.hooks:  # after the timed step: measurements do not count in step_s
            hook(event)
        metrics["step_s"] = timer.total()
        run.sink.log(step, "sft", metrics)
        run.progress("sft", step, self.steps, metrics)
        return metrics, bool(metrics.get("skipped")) or not math.isfinite(metrics["loss"])

    def finish(self, step: int, metrics: dict[str, float], skipped: bool) -> bool:
        if not skipped and metrics["grad_norm"] == 0.0:
            raise TrainingStopped(
                f"the policy is dead at sft step {step + 1} (gradient norm exactly 0: uniform output), "
                f"nothing saved; {self.run.last_good_text()}: lower optim.lr (or train.sft_lr)"
            )
        return False
