"""The RL step (DESIGN.md, "One RL step"): rollouts, rewards, advantages, pi_old, M updates.

Shape legend: B = sequences of this data-parallel rank, T = padded tokens, S = T - 1 model
input positions, L = MoE layers, K = top-k. Rows of one prompt's group are adjacent.

The three algorithms differ only in ``algo.name`` and ``algo.routing``; everything else,
including prompt order and sampling seeds, is shared, so A/B runs change one field.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from moe_rl.losses import METRIC_REDUCTIONS, get_loss, group_advantages, k3
from moe_rl.megatron.parallel import all_reduce
from moe_rl.megatron.routing import RoutingSession
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing import RouterAction
from moe_rl.routing.codec import decode_routes
from moe_rl.routing.flip import flip_counts, flip_metrics
from moe_rl.tasks.base import make_rng
from moe_rl.trainer.sft import encode_pair

log = logging.getLogger(__name__)


@dataclass
class RLBatch:
    """One rollout batch on this rank, ready for the minibatch updates."""

    tokens_BT: torch.Tensor
    mask_BT: torch.Tensor  # response tokens (the loss mask)
    valid_BS: torch.Tensor  # input positions that carry routes (t < total_len - 1)
    adv_B: torch.Tensor
    old_logp_BT: torch.Tensor
    replay_BSLK: torch.Tensor | None  # routes replayed in training (R2, R3)
    old_routes_BSLK: torch.Tensor | None  # pi_old's natural routes, for drift


def _flip(a, b, valid_BS, prefix):
    n = a.shape[0] * a.shape[1]
    c = flip_counts(a.reshape(n, *a.shape[2:]), b.reshape(n, *b.shape[2:]), valid_BS.reshape(n))
    return c, prefix


def _reduce_flip(parts, info) -> dict[str, float]:
    """Sum flip counts across pieces and data-parallel ranks, then turn them into rates."""
    out = {}
    for prefix in dict.fromkeys(p for _, p in parts):
        c = [cc for cc, p in parts if p == prefix]
        tot = {k: sum(x[k] for x in c).float().clone() for k in c[0]}
        for v in tot.values():
            all_reduce(v, info.dp_group)
        out.update(flip_metrics(tot, prefix))
    return out


def chunks(n: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` (all rows when size is 0)."""
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def sampling_for(r, step: int, *, greedy: bool = False, routes: bool = False) -> SamplingParams:
    cfg = r.recipe.train
    seed = make_rng("rollout", cfg.seed, step).randrange(2**31)
    return SamplingParams(
        temperature=0.0 if greedy else cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=(r.tok.eos_id,),
        seed=seed,
        return_routes=routes,
    )


def local_prompts(r, prompts: list) -> list:
    """This data-parallel rank's share of the step's prompts (all ranks draw the same list)."""
    per = len(prompts) // r.info.dp_size
    return prompts[r.info.dp_rank * per : (r.info.dp_rank + 1) * per]


def rewards_of(r, prompts, rollouts, group: int) -> torch.Tensor:
    out = []
    for i in range(rollouts.batch_size):
        p, t = int(rollouts.prompt_lens_B[i]), int(rollouts.total_lens_B[i])
        text = r.tok.decode(rollouts.tokens_BT[i, p:t].tolist())
        out.append(r.task.reward(prompts[i // group], text))
    return torch.tensor(out, dtype=torch.float32)


def collect(r, step: int, m: dict, timing: dict) -> RLBatch:
    """Rollouts, rewards, advantages and pi_old log-probs (+ routes) of one RL step."""
    cfg, algo = r.recipe.train, r.recipe.algo
    t0 = time.perf_counter()
    prompts = local_prompts(r, r.task.sample(step, cfg.prompts_per_step, r.recipe.task.seed))
    ids = [encode_pair(r.tok, p.text, None, r.recipe.model.max_seq_len)[0] for p in prompts]
    want_routes = algo.routing == "r3" or r.engine_returns_routes
    ro = r.engine.generate(ids, cfg.group_size, sampling_for(r, step, routes=want_routes))
    timing["rollout"] = time.perf_counter() - t0
    rewards = rewards_of(r, prompts, ro, cfg.group_size)
    adv, st = group_advantages(
        rewards,
        cfg.group_size,
        eps=algo.adv_eps,
        std_normalize=algo.adv_std_normalize,
        unbiased=algo.adv_std_unbiased,
    )
    m.update({k: float(v) for k, v in st.items()})
    m["reward/accuracy"] = float((rewards >= 1.0).float().mean())
    m["response/len_mean"] = float(ro.response_mask_BT.sum(1).mean())
    m["response/truncated"] = sum(f == "length" for f in ro.finish_reasons) / ro.batch_size
    tokens, mask = ro.tokens_BT, ro.response_mask_BT
    s = tokens.shape[1] - 1
    valid = (torch.arange(s)[None, :] < (ro.total_lens_B[:, None] - 1)).float()
    rollout_routes = decode_routes(ro.routes_BTLK[:, :s]) if ro.routes_BTLK is not None else None

    t0 = time.perf_counter()
    replay = old_routes = None
    old_logp = ro.logprobs_BT.to(r.info.device)
    if algo.old_logprobs == "recompute" or algo.routing == "r2":
        recomputed, old_routes, recorded = old_pass(r, tokens, rollout_routes)
        replay = recorded if algo.routing == "r2" else rollout_routes
        d = (recomputed - old_logp) * mask
        n = mask.sum().clamp(min=1)
        m["mismatch/abs_log_ratio"] = float(d.abs().sum() / n)
        m["mismatch/k3"] = float((k3(recomputed, old_logp) * mask).sum() / n)
        if algo.old_logprobs == "recompute":
            old_logp = recomputed
    else:
        replay, old_routes = rollout_routes, rollout_routes
    timing["old_logprob"] = time.perf_counter() - t0
    if rollout_routes is not None and old_routes is not None:
        m.update(_reduce_flip([_flip(rollout_routes, old_routes, valid, "flip/rollout_vs_trainer")], r.info))
    return RLBatch(tokens, mask, valid, adv, old_logp, replay, old_routes)


def old_pass(r, tokens_BT, rollout_routes):
    """pi_old log-probs, its natural routes and (R2) the recorded routes, micro-batch by micro-batch."""
    algo, s = r.recipe.algo, tokens_BT.shape[1] - 1
    action = {"r2": RouterAction.RECORD, "r3": RouterAction.REPLAY}.get(algo.routing, RouterAction.NATURAL)
    logps, naturals, recorded = [], [], []
    for sl in chunks(tokens_BT.shape[0], r.recipe.train.micro_batch_size):
        routes = rollout_routes[sl] if action is RouterAction.REPLAY else None
        with torch.no_grad(), RoutingSession(r.policy, action, routes_BSLK=routes) as rs:
            logps.append(r.policy.logprobs(tokens_BT[sl], temperature=r.recipe.train.temperature).logp_BT)
        b = sl.stop - sl.start
        naturals.append(rs.natural_BSLK(b, s))
        if action is RouterAction.RECORD:
            recorded.append(rs.recorded_BSLK(b, s))
    return torch.cat(logps), torch.cat(naturals), torch.cat(recorded) if recorded else None


def _natural(r, tokens_BT) -> torch.Tensor:
    out = []
    for sl in chunks(tokens_BT.shape[0], r.recipe.train.micro_batch_size):
        with torch.no_grad(), RoutingSession(r.policy, RouterAction.NATURAL) as rs:
            r.policy.logits(tokens_BT[sl, :-1])
        out.append(rs.natural_BSLK(sl.stop - sl.start, tokens_BT.shape[1] - 1))
    return torch.cat(out)


def _global_counts(r, mb_masks: list[torch.Tensor]) -> list[tuple[float, float]]:
    """(sequences, tokens) of every minibatch summed over data-parallel ranks: one all-reduce."""
    t = torch.tensor([[mk.shape[0], float(mk.sum())] for mk in mb_masks], dtype=torch.float64)
    all_reduce(t, r.info.dp_group)
    return [tuple(x) for x in t.tolist()]


def _reduce_loss_metrics(r, per_mb: list[dict]) -> dict[str, float]:
    """Average sum-type metrics over the M updates, min/max the rest; one all-reduce per op across DP."""
    ops = {
        "sum": torch.distributed.ReduceOp.SUM,
        "min": torch.distributed.ReduceOp.MIN,
        "max": torch.distributed.ReduceOp.MAX,
    }
    out = {}
    for op, reduce_op in ops.items():
        keys = [k for k in per_mb[0] if METRIC_REDUCTIONS.get(k, "sum") == op]
        if not keys:
            continue
        v = torch.stack([torch.stack([mb[k].detach().float().reshape(()) for k in keys]) for mb in per_mb])
        v = v.mean(0) if op == "sum" else (v.amin(0) if op == "min" else v.amax(0))
        all_reduce(v, r.info.dp_group, reduce_op)
        out.update(zip(keys, v.tolist()))
    return out


def _micro_step(r, batch: RLBatch, u: slice, count, loss_fn, entropies, flips) -> dict:
    """Forward and backward of one micro-batch (rows ``u``); gradients accumulate."""
    cfg, algo = r.recipe.train, r.recipe.algo
    replay = batch.replay_BSLK[u] if algo.routing != "none" else None
    action = RouterAction.REPLAY if replay is not None else RouterAction.NATURAL
    mask = batch.mask_BT[u].to(r.info.device)
    with RoutingSession(r.policy, action, routes_BSLK=replay) as rs:
        out = r.policy.logprobs(batch.tokens_BT[u], temperature=cfg.temperature, with_entropy=True)
        loss, metrics = loss_fn(
            out.logp_BT,
            batch.old_logp_BT[u],
            batch.adv_B[u],
            mask,
            cfg=algo,
            num_sequences=count[0],
            num_tokens=count[1],
        )
        rs.backward(loss)
    entropies.append(((out.entropy_BT.detach() * mask).sum(), mask.sum()))
    if batch.old_routes_BSLK is not None:
        nat = rs.natural_BSLK(u.stop - u.start, batch.tokens_BT.shape[1] - 1)
        flips.append(_flip(nat, batch.old_routes_BSLK[u], batch.valid_BS[u], "flip/drift"))
    return {k: v.detach() for k, v in metrics.items()}


def train_on(r, batch: RLBatch, m: dict, timing: dict) -> bool:
    """M minibatch updates with flip probes; returns False if any update was skipped."""
    cfg = r.recipe.train
    loss_fn = get_loss(r.recipe.algo.name)
    b = batch.tokens_BT.shape[0]
    per = b // cfg.minibatches
    slices = [slice(i * per, (i + 1) * per) for i in range(cfg.minibatches)]
    counts = _global_counts(r, [batch.mask_BT[sl] for sl in slices])
    probe = batch.tokens_BT[: min(cfg.flip_probe_sequences, b)]
    probe_valid = batch.valid_BS[: probe.shape[0]]
    t_probe = 0.0
    before = None
    if probe.shape[0]:
        t0 = time.perf_counter()
        before = _natural(r, probe)
        t_probe += time.perf_counter() - t0
    per_mb, flips, entropies, steps_ok = [], [], [], True
    t0 = time.perf_counter()
    for i, sl in enumerate(slices):
        micro = [slice(sl.start + c.start, sl.start + c.stop) for c in chunks(per, cfg.micro_batch_size)]
        metrics = [_micro_step(r, batch, u, counts[i], loss_fn, entropies, flips) for u in micro]
        stats = r.optimizer.step()
        steps_ok &= stats["skipped"] == 0.0
        per_mb.append(
            {
                **{
                    k: sum(mt[k] for mt in metrics)
                    if METRIC_REDUCTIONS[k] == "sum"
                    else (min if METRIC_REDUCTIONS[k] == "min" else max)(mt[k] for mt in metrics)
                    for k in metrics[0]
                },
                "grad_norm": torch.tensor(stats["grad_norm"]),
            }
        )
        if before is not None and (r.optimizer.step_count % cfg.flip_probe_every == 0):
            tp = time.perf_counter()
            after = _natural(r, probe)
            flips.append(_flip(before, after, probe_valid, "flip/step"))
            before = after
            t_probe += time.perf_counter() - tp
    timing["train"] = time.perf_counter() - t0 - t_probe
    timing["probe"] = t_probe
    m.update(_reduce_loss_metrics(r, per_mb))
    m["grad_norm"] = max(float(mb["grad_norm"]) for mb in per_mb)
    ent = torch.stack([torch.stack(e) for e in entropies]).sum(0)
    all_reduce(ent, r.info.dp_group)
    m["entropy/mean"] = float(ent[0] / ent[1].clamp(min=1))
    if flips:
        m.update(_reduce_flip(flips, r.info))
    m["lr"] = stats["lr"]
    return steps_ok
