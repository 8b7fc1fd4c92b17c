"""Routing instruments on the tiny policy (issue 3's figures), from a warm-started policy.

One real rollout batch (arithmetic task, rewards, group advantages) from the SFT start,
then, each from the same start:
- one optimizer step at lr 1e-4 and at 1e-3: per-step flip rate, per-layer profile and
  token any-flip rate on the batch's tokens;
- GRPO and GSPO clip fractions (token, sequence, tokens of clipped sequences) on the same
  batch after that update (ratios of the updated policy against pi_old);
- R2 replay overhead (training forward+backward with replayed routes vs natural routing)
  and flip-probe overhead (the two probe forwards), as ratios of the training time.

    python benchmarks/routing_instruments.py [--preset smoke|cpu] [--sft runs/demo/sft/checkpoints]

Writes benchmarks/results/routing_instruments-<machine>-<preset>-<commit>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch

from benchmarks.common import SMOKE_BASE, result_path
from moe_rl.lab.results import write_json

warnings.filterwarnings("ignore")

PRESETS = {
    "smoke": {
        "model": SMOKE_BASE["model"],
        "train": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 16},
        "repeats": 1,
    },
    "cpu": {
        "model": {},
        "train": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 48},
        "repeats": 9,
    },
}


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median time of each function, run round-robin so that load drift hits all of them alike."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> dict:
    from moe_rl.config import load_recipe, recipe_from_dict, to_dict
    from moe_rl.losses import LossBatch, get_loss, loss_batch
    from moe_rl.megatron.checkpoint import latest_checkpoint, load_checkpoint
    from moe_rl.megatron.routing import RoutingSession
    from moe_rl.routing import RouterAction
    from moe_rl.routing.flip import flip_rate
    from moe_rl.trainer.context import Run
    from moe_rl.trainer.rl import collect

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="cpu", choices=PRESETS)
    ap.add_argument("--sft", default="runs/demo/sft/checkpoints")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    data = to_dict(load_recipe("recipes/demo/base.yaml"))
    data["model"].update(p["model"])
    data["train"].update(p["train"], stages=["rl"], out_dir="/tmp/routing_instruments", minibatches=1)
    recipe = recipe_from_dict(data)
    run = Run(recipe)
    sft = latest_checkpoint(args.sft) if args.preset == "cpu" else None
    if sft is not None:
        load_checkpoint(sft, run.policy.model, load_rng=False)
    run.make_optimizer("rl")
    run.ensure_engine()
    batch, metrics = collect(run, 0)
    start = copy.deepcopy(run.policy.model.state_dict())
    b, s = batch.tokens_BT.shape[0], batch.tokens_BT.shape[1] - 1
    valid = batch.valid_BS.reshape(-1)

    def natural():
        with torch.no_grad(), RoutingSession(run.policy, RouterAction.NATURAL) as rs:
            run.policy.logits(batch.tokens_BT[:, :-1])
        return rs.natural_BSLK(b, s).reshape(b * s, -1, recipe.model.moe_router_topk)

    def inputs(logp_BT: torch.Tensor) -> LossBatch:
        n = float(batch.mask_BT.sum())
        return loss_batch(
            logp_BT, batch.old_logp_BT, batch.adv_B, batch.mask_BT, num_sequences=b, num_tokens=n
        )

    def update(routing: str):
        replay = batch.replay_BSLK if routing == "r2" else None
        action = RouterAction.REPLAY if replay is not None else RouterAction.NATURAL
        with RoutingSession(run.policy, action, routes_BSLK=replay) as rs:
            out = run.policy.logprobs(batch.tokens_BT, temperature=recipe.train.temperature)
            loss, _ = get_loss("grpo")(inputs(out.logp_BT), recipe.algo)
            rs.backward(loss)

    res = {
        "preset": args.preset,
        "warm_start": str(sft) if sft else None,
        "batch_sequences": b,
        "response_tokens": float(batch.mask_BT.sum()),
        "reward_mean": metrics["reward/mean"],
        "per_lr": {},
    }
    before = natural()
    for lr in (1e-4, 1e-3):
        run.policy.model.load_state_dict(start)
        from dataclasses import replace

        tuned = run.derive(optim=replace(recipe.optim, lr=lr, grad_clip=1.0), new_optimizer=True)
        update("none")
        tuned.optimizer.step()
        after = natural()
        flips = flip_rate(before, after, valid)
        with torch.no_grad():
            new = run.policy.logprobs(batch.tokens_BT, temperature=recipe.train.temperature).logp_BT
        clips = {}
        for algo in ("grpo", "gspo"):
            cfg = replace(recipe.algo, name=algo, eps_low=None, eps_high=None)
            _, mt = get_loss(algo)(inputs(new), cfg)
            clips[algo] = {k: float(v) for k, v in mt.items() if k.startswith(("clip/", "ratio/seq_log"))}
        res["per_lr"][str(lr)] = {"flip": flips, "clip": clips}
    run.policy.model.load_state_dict(start)
    t = _interleaved(
        {
            "natural": lambda: (update("none"), tuned.optimizer.zero_grad()),
            "r2": lambda: (update("r2"), tuned.optimizer.zero_grad()),
            "probe": lambda: (natural(), natural()),
        },
        p["repeats"],
    )
    t_nat, t_r2, t_probe = t["natural"], t["r2"], t["probe"]
    res["timing_s"] = {
        "train_fwd_bwd_natural": t_nat,
        "train_fwd_bwd_r2": t_r2,
        "flip_probe_pair_full_batch": t_probe,
    }
    res["r2_overhead_ratio"] = t_r2 / t_nat
    res["probe_overhead_ratio_full_batch"] = t_probe / t_nat
    probe_frac = recipe.train.flip_probe_sequences / b
    res["probe_overhead_ratio_default_probe"] = t_probe * probe_frac / t_nat
    run.close()
    path = result_path("routing_instruments", args.preset, args.out)
    write_json(path, res)
    print(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
