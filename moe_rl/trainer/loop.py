"""The RL stage driver: the whole loop on one screen (the step itself is in rl.py)."""

from __future__ import annotations

import logging
import time

import torch

from moe_rl.megatron.parallel import all_reduce
from moe_rl.trainer.rl import collect, encode_pair, local_prompts, rewards_of, sampling_for, train_on
from moe_rl.trainer.sentinel import Sentinel

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (sentinel or repeated non-finite steps); the checkpoint is intact."""


def evaluate(r, step: int) -> dict[str, float]:
    """Greedy accuracy on held-out prompts (each rank its share; summed across DP)."""
    prompts = local_prompts(r, r.task.heldout(r.recipe.train.eval_prompts))
    ids = [encode_pair(r.tok, p.text, None, r.recipe.model.max_seq_len)[0] for p in prompts]
    ro = r.engine.generate(ids, 1, sampling_for(r, step, greedy=True))
    acc = torch.tensor([float((rewards_of(r, prompts, ro, 1) >= 1.0).sum()), float(len(prompts))])
    all_reduce(acc, r.info.dp_group)
    return {"eval/accuracy": float(acc[0] / acc[1])}


def run_rl(r) -> dict:
    """RL steps with weight sync, metrics, checkpoints, NaN guard, sentinel and evaluation."""
    cfg = r.recipe.train
    r.ensure_engine()
    start = r.state["step"] if r.state.get("stage") == "rl" else 0
    r.state.update(stage="rl", step=start)
    sentinel = Sentinel(r.recipe.sentinel, r.state.get("sentinel"))
    r.optimizer.lr_scale = r.state.get("lr_scale", 1.0)
    bad, m, step = 0, {}, start
    if start == 0:
        if not r.has_checkpoint():  # the start is the first "last good" state to roll back to
            r.save()
        r.sink.log(0, "rl_eval", evaluate(r, 0))
    while step < cfg.rl_steps:
        m, timing, t0 = {}, {}, time.perf_counter()
        batch = collect(r, step, m, timing)
        ok = train_on(r, batch, m, timing)
        ts = time.perf_counter()
        r.engine.update_weights(r.weight_source(), str(r.optimizer.step_count))
        timing["sync"] = time.perf_counter() - ts
        m.update({f"time/{k}": v for k, v in timing.items()})
        m["time/step"] = time.perf_counter() - t0
        m["tokens_per_s"] = float(batch.mask_BT.sum()) * r.info.dp_size / m["time/step"]
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            m.update(evaluate(r, step + 1))
        bad = 0 if ok else bad + 1
        if bad >= cfg.max_bad_steps:
            raise TrainingStopped(
                f"{bad} consecutive RL steps had non-finite loss or gradients "
                f"(each skipped); stopping at step {step} with the last good "
                "checkpoint intact: lower optim.lr or check the data"
            )
        verdict = sentinel.check(m)
        m["sentinel/fired"] = float(len(verdict.fired))
        r.sink.log(step, "rl", m)
        r.progress(step, cfg.rl_steps, m)
        if verdict.fired:
            log.warning("sentinel (%s): %s", verdict.action, "; ".join(verdict.reasons))
        if verdict.action == "stop":
            raise TrainingStopped("collapse sentinel: " + "; ".join(verdict.reasons))
        if verdict.action == "rollback":
            step = r.rollback(r.recipe.sentinel.rollback_lr_factor)
            continue
        step += 1
        r.state.update(step=step, sentinel=sentinel.state, lr_scale=r.optimizer.lr_scale)
        every = r.recipe.checkpoint.every
        if every and step % every == 0 and step < cfg.rl_steps:
            r.save()
    final = evaluate(r, cfg.rl_steps)
    r.sink.log(cfg.rl_steps, "rl_eval", final)
    return {**m, **final}
