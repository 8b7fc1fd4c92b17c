"""Clip, ratio, KL and advantage metrics, the same for every algorithm (docs/algorithms.md#clip-fractions, #ratio-health), and the
final assembly of a loss and its metrics.

Shape legend: B = sequences in this microbatch, T = padded tokens per sequence.

Every metric is a 0-dim float tensor (float32, float64 for float64 inputs), detached, and either *additive* (a sum divided by the
global ``num_sequences`` or ``num_tokens``, so the sum over microbatches and ranks is the
batch value) or a min / max (empty microbatches give +inf / -inf, the identities).
``METRIC_REDUCTIONS`` says which, for every key; :func:`combine_metrics` applies it, the one
reduction path for microbatches, minibatches and (through an all-reduce the caller passes in)
data-parallel ranks.

Metrics (w = token ratio exp(d), s = sequence ratio exp(mean_t d), A_i = sequence advantage,
the masked mean of per-token advantages when those are given):

- ``clip/token_frac``: tokens with w outside the band on the gradient-zeroing side / tokens.
- ``clip/seq_frac``: sequences with s outside the band on the gradient-zeroing side / sequences.
- ``clip/token_frac_of_clipped_seqs``: tokens of those sequences / tokens.
  The band is always the loss's cfg band (cfg.clip_low, cfg.clip_high), whatever the algorithm.
- ``ratio/token_min|max|mean``, ``ratio/token_frac_outside_0.5_2``: of w over valid tokens.
- ``ratio/seq_min|max|mean``: of s over non-empty sequences.
- ``ratio/seq_log_sum_min|max``: of sum_t d_{i,t}, the log of the unclipped product of token
  ratios, which token clipping does not bound.
- ``kl/old_k3``, ``kl/old_abs_log_ratio``: token means of k3(pi_theta || pi_old) and |d|, the
  policy (or train/rollout) mismatch against pi_old.
- ``adv/mean|abs_mean`` (over sequences), ``adv/min|max``.
- ``loss/pg``: this microbatch's -J. Only when the batch has ``ref_logp_BT`` (a reference policy):
  ``kl/ref_k1``, ``kl/ref_k2``, ``kl/ref_k3`` (token means of each estimator of KL(pi_theta || pi_ref),
  moe_rl.losses.kl) and ``loss/kl`` (algo.kl_coef times the aggregated ``algo.kl_estimator``: the
  loss's KL term, 0 when only measured).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from moe_rl.losses.core import (
    LossBatch,
    aggregate_seqs,
    aggregate_tokens,
    clipped_surrogate,
    dual_clip_frac,
    dual_clipped,
    is_clipped,
)
from moe_rl.losses.kl import ESTIMATORS, k3

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig

METRIC_REDUCTIONS: dict[str, str] = {
    "loss/pg": "sum",
    "loss/kl": "sum",
    "kl/ref_k1": "sum",
    "kl/ref_k2": "sum",
    "kl/ref_k3": "sum",
    "kl/old_k3": "sum",
    "kl/old_abs_log_ratio": "sum",
    "clip/token_frac": "sum",
    "clip/seq_frac": "sum",
    "clip/token_frac_of_clipped_seqs": "sum",
    "clip/dual_clip_frac": "sum",
    "ratio/token_min": "min",
    "ratio/token_max": "max",
    "ratio/token_mean": "sum",
    "ratio/token_frac_outside_0.5_2": "sum",
    "ratio/seq_min": "min",
    "ratio/seq_max": "max",
    "ratio/seq_mean": "sum",
    "ratio/seq_log_sum_min": "min",
    "ratio/seq_log_sum_max": "max",
    "adv/mean": "sum",
    "adv/abs_mean": "sum",
    "adv/min": "min",
    "adv/max": "max",
}
"How each metric combines across microbatches and ranks: sum, min or max."


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_tensor(float("inf"))
    return torch.where(mask, x, float("inf")).amin()


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_tensor(float("-inf"))
    return torch.where(mask, x, float("-inf")).amax()


@torch.no_grad()
def policy_metrics(b: LossBatch, eps_low: float, eps_high: float) -> dict[str, torch.Tensor]:
    """Clip, ratio, mismatch and advantage metrics of one microbatch (module docstring)."""
    m, valid = b.mask_BT, b.valid_B
    nt, ns = b.num_tokens, b.num_sequences
    d_BT = b.logratio_BT.detach()
    w_BT = d_BT.exp()
    log_sum_B = d_BT.sum(-1)
    s_B = (log_sum_B / b.len_B.clamp(min=1)).exp()
    tok_clipped = is_clipped(w_BT, b.adv_BT, eps_low, eps_high) & m
    seq_clipped = is_clipped(s_B, b.adv_B, eps_low, eps_high) & valid
    zero = torch.zeros_like(d_BT)
    tok_clipped, seq_clipped = tok_clipped.to(d_BT.dtype), seq_clipped.to(d_BT.dtype)
    outside = (((w_BT < 0.5) | (w_BT > 2.0)) & m).to(d_BT.dtype)
    return {
        "clip/token_frac": tok_clipped.sum() / nt,
        "clip/seq_frac": seq_clipped.sum() / ns,
        "clip/token_frac_of_clipped_seqs": (b.len_B * seq_clipped).sum() / nt,
        "ratio/token_min": _masked_min(w_BT, m),
        "ratio/token_max": _masked_max(w_BT, m),
        "ratio/token_mean": torch.where(m, w_BT, zero).sum() / nt,
        "ratio/token_frac_outside_0.5_2": outside.sum() / nt,
        "ratio/seq_min": _masked_min(s_B, valid),
        "ratio/seq_max": _masked_max(s_B, valid),
        "ratio/seq_mean": torch.where(valid, s_B, 0.0).sum() / ns,
        "ratio/seq_log_sum_min": _masked_min(log_sum_B, valid),
        "ratio/seq_log_sum_max": _masked_max(log_sum_B, valid),
        "kl/old_k3": torch.where(m, k3(d_BT, zero), zero).sum() / nt,
        "kl/old_abs_log_ratio": d_BT.abs().sum() / nt,
        "adv/mean": b.adv_B.sum() / ns,
        "adv/abs_mean": b.adv_B.abs().sum() / ns,
        "adv/min": _masked_min(b.adv_B, valid),
        "adv/max": _masked_max(b.adv_B, valid),
    }


def loss_and_metrics(
    objective: torch.Tensor, b: LossBatch, cfg: AlgoConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = -objective (+ kl_coef * the aggregated ``cfg.kl_estimator`` vs the batch's reference),
    plus every metric.

    ``objective`` is this microbatch's contribution to J. kl_coef > 0 without ``b.ref_logp_BT`` is an
    error; a reference with kl_coef = 0 is only measured. The KL term is aggregated as the policy
    loss (``cfg.aggregation``: seq_mean is verl's seq-mean-token-mean and TRL's loss_type=grpo,
    token_mean verl's token-mean and TRL's bnpo / dapo), so adding it per token, as TRL does, gives
    the same loss.
    """
    if cfg.kl_coef > 0 and b.ref_logp_BT is None:
        raise ValueError(
            f"algo.kl_coef={cfg.kl_coef} needs ref_logp_BT (reference log-probs); pass them or set kl_coef=0"
        )
    metrics = policy_metrics(b, cfg.clip_low, cfg.clip_high)
    loss = -objective
    metrics["loss/pg"] = loss.detach()
    if b.ref_logp_BT is not None:
        per_token = {name: fn(b.logp_BT, b.ref_logp_BT) for name, fn in ESTIMATORS.items()}
        kl_term = cfg.kl_coef * aggregate_tokens(per_token[cfg.kl_estimator], b, cfg.aggregation)
        if cfg.kl_coef > 0:
            loss = loss + kl_term
        metrics["loss/kl"] = kl_term.detach()
        for name, kl_BT in per_token.items():
            metrics[f"kl/ref_{name}"] = torch.where(b.mask_BT, kl_BT.detach(), 0.0).sum() / b.num_tokens
    return loss, metrics


def surrogate_loss(
    b: LossBatch, cfg: AlgoConfig, logratio: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics of the clipped surrogate of ``logratio`` and ``adv``, per token ([B, T]:
    grpo's d, gspo_token's log s_{i,t}) or per sequence ([B]: gspo's log s_i): each term times
    its correction weight (None: none; same shape), aggregated by cfg.aggregation.
    ``clip/dual_clip_frac`` counts the tokens the dual clip fixed (all tokens of such a sequence).
    """
    obj = clipped_surrogate(logratio, adv, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
    if weights is not None:
        obj = obj * weights
    aggregate = aggregate_tokens if obj.dim() == 2 else aggregate_seqs
    loss, metrics = loss_and_metrics(aggregate(obj, b, cfg.aggregation), b, cfg)
    dual = dual_clipped(logratio.detach().exp(), adv, cfg.clip_ratio_c)
    metrics["clip/dual_clip_frac"] = dual_clip_frac(dual if dual.dim() == 2 else dual[:, None] & b.mask_BT, b)
    return loss, metrics


def combine_metrics(
    parts: Iterable[dict[str, torch.Tensor]],
    *,
    mean: bool = False,
    all_reduce: Callable[[torch.Tensor, str], object] | None = None,
    reductions: Mapping[str, str] = METRIC_REDUCTIONS,
) -> dict[str, torch.Tensor]:
    """Combine the metrics of several microbatches, minibatches or ranks with ``METRIC_REDUCTIONS``.

    The one reduction path of the trainer's loss metrics:

    - microbatches of one minibatch: ``combine_metrics(per_micro)``; because every loss divides
      by global counts, the sum equals the whole minibatch's metrics;
    - the M minibatches of an RL step: ``mean=True`` averages the additive metrics (each part is
      already a whole-minibatch value) and keeps the min / max of the rest;
    - data-parallel ranks: ``all_reduce(t, op)`` (op ``"sum"``, ``"min"`` or ``"max"``) is called
      once per op on a stacked 1-D tensor, in place, after the local combination. The caller
      supplies it (the losses package never touches torch.distributed).

    ``reductions`` maps each key to its op (default ``METRIC_REDUCTIONS``, the loss metrics; the
    trainer passes ``moe_rl.losses.corrections.CORRECTION_METRIC_REDUCTIONS`` for the mismatch
    metrics). A key missing from it is an error: say there how it combines.
    """
    stacked: dict[str, list[torch.Tensor]] = {}
    for metrics in parts:
        for k, v in metrics.items():
            stacked.setdefault(k, []).append(v.detach().reshape(()))
    unknown = sorted(set(stacked) - set(reductions))
    if unknown:
        raise KeyError(
            f"metrics {unknown} have no entry in the reductions map (METRIC_REDUCTIONS by default): add sum, min or max"
        )
    ops = {"sum": torch.mean if mean else torch.sum, "min": torch.amin, "max": torch.amax}
    local = {k: ops[reductions[k]](torch.stack(v)) for k, v in stacked.items()}
    if all_reduce is None:
        return local
    out = {}
    for op in ("sum", "min", "max"):
        keys = [k for k in local if reductions[k] == op]
        if keys:
            v = torch.stack([local[k] for k in keys])
            all_reduce(v, op)
            out.update(zip(keys, v.unbind()))
    return {k: out[k] for k in local}
