"""Train-inference mismatch: correction weights and mismatch metrics (docs/algorithms.md,
"Train-inference mismatch and its corrections").

Shape legend: B = sequences, T = padded tokens per sequence.

Three policies: pi_roll sampled the tokens (the rollout engine's own copy of the weights, in its
own precision and kernels), pi_old is the trainer's recompute at the same weights, pi_theta is
being updated. Per response token, log rho_t = log pi_old(y_t) - log pi_roll(y_t).

Corrections (detached weights; the losses multiply each token's, or each sequence's, term by them
before aggregation and leave the denominators alone):

- ``tis``:         w_t = min(rho_t, C)                                       [B, T], 0 on padding
- ``seq_tis``:     w_i = exp(min(sum_t log rho_t, log C))                    [B], 0 for empty rows
- ``icepop``:      w_t = rho_t if low <= rho_t <= high else 0                [B, T], 0 on padding
- ``icepop_mask``: w_t = 1 if low <= rho_t <= high else 0                    [B, T], 0 on padding
- ``geo_mask``:    w_i = 1 if low <= exp(mean_t log rho_t) <= high else 0    [B], 0 for empty rows

``icepop`` is IcePop's masked importance weight M(rho_t) = rho_t * 1[low <= rho_t <= high] (the
IcePop / Ring-1T write-up, bounds [0.5, 5]): a kept token is weighted by its ratio, as slime and
TRL do. slime: ``slime/backends/megatron_utils/loss.py``, ``icepop_function`` (the ratio where
tis_clip_low <= ratio <= tis_clip, else 0, times ``pg_loss``; read at commit 624b824a). TRL:
``trl/trainer/grpo_trainer.py``, ``vllm_importance_sampling_mode="token_mask"`` (the ratio set to 0
outside [clip_min, clip_max], then times ``per_token_loss``; read at commit f2cd5771).
``icepop_mask`` keeps the same tokens with weight 1: a rejection mask alone, without the ratio
(what ``icepop`` was here before).

Bounds are compared in log space (log low <= log rho <= log high, inclusive) and the truncation
as min(log rho, log C) before one exp, so nothing overflows. verl (rollout_corr_helper.py) also
clamps log rho to [-20, 20] before exp; the weights differ only below exp(-20) ~ 2e-9.

Every metric is a detached 0-dim tensor, either additive (a sum over this piece divided by the
global count passed in, so pieces and data-parallel ranks add up) or a max (-inf when empty);
``CORRECTION_METRIC_REDUCTIONS`` says which.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from moe_rl.losses.kl import k3
from moe_rl.names import CORRECTIONS, DEFAULT_BOUNDS  # data, defined there so config reads it without torch

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig

EXTREME_LOG_RATIO = math.log(2.0)
"|log rho| above which a token counts in ``mismatch/extreme_frac`` (rho outside [1/2, 2])."

CORRECTION_METRIC_REDUCTIONS: dict[str, str] = {
    "mismatch/abs_log_ratio": "sum",
    "mismatch/k3": "sum",
    "mismatch/extreme_frac": "sum",
    "mismatch/seq_log_ratio_abs_max": "max",
    "correction/weight_mean": "sum",
    "correction/masked_frac": "sum",
}
"""How each mismatch / correction metric combines across pieces and ranks. Kept apart from
METRIC_REDUCTIONS, whose keys are exactly the loss metrics (tests/unit/test_losses.py checks it)."""


def log_rho(
    old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log rho [B, T] = old - rollout, 0 on padding, detached, at least float32; bool mask [B, T]).

    Values at padded positions are ignored (they may be anything, even inf or nan).
    """
    if (
        old_logp_BT.dim() != 2
        or old_logp_BT.shape != rollout_logp_BT.shape
        or old_logp_BT.shape != mask_BT.shape
    ):
        raise ValueError(
            f"old_logp, rollout_logp and mask must all be [B, T]: got {tuple(old_logp_BT.shape)}, "
            f"{tuple(rollout_logp_BT.shape)}, {tuple(mask_BT.shape)}"
        )
    mask = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    dtype = torch.promote_types(torch.promote_types(old_logp_BT.dtype, rollout_logp_BT.dtype), torch.float32)
    diff = old_logp_BT.detach().to(dtype) - rollout_logp_BT.detach().to(dtype)
    return torch.where(mask, diff, torch.zeros_like(diff)), mask


def _check_args(method: str, c: float, low: float, high: float) -> None:
    if method not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {method!r}; valid: {', '.join(CORRECTIONS)}")
    if not c > 0:
        raise ValueError(f"correction C must be > 0, got {c}")
    if not 0 < low < high:
        raise ValueError(f"correction bounds need 0 < low < high, got low={low}, high={high}")


@torch.no_grad()
def correction_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    method: str,
    c: float = 2.0,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor | None:
    """Detached correction weights of ``method`` (module docstring): [B, T] for tis / icepop /
    icepop_mask, [B] for seq_tis / geo_mask, None for none. ``c`` is the truncation C of tis /
    seq_tis; ``low`` / ``high`` the bounds on rho of icepop / icepop_mask / geo_mask (None:
    :data:`DEFAULT_BOUNDS`).

    old_logp_BT (pi_old recompute), rollout_logp_BT (pi_roll), mask_BT: [B, T].
    """
    dlow, dhigh = DEFAULT_BOUNDS.get(method, DEFAULT_BOUNDS["icepop"])
    low = dlow if low is None else low
    high = dhigh if high is None else high
    _check_args(method, c, low, high)
    if method == "none":
        return None
    lr_BT, mask = log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    zero = torch.zeros_like(lr_BT)
    if method == "tis":
        return torch.where(mask, lr_BT.clamp(max=math.log(c)).exp(), zero)
    if method in ("icepop", "icepop_mask"):
        keep = mask & (lr_BT >= math.log(low)) & (lr_BT <= math.log(high))
        if method == "icepop_mask":
            return keep.to(lr_BT.dtype)
        # rho where kept (log rho <= log high there: no overflow), 0 elsewhere; as slime's icepop_function
        return torch.where(keep, lr_BT.exp(), zero)
    len_B = mask.sum(-1)
    valid_B = len_B > 0
    sum_B = lr_BT.sum(-1)
    if method == "seq_tis":
        return torch.where(valid_B, sum_B.clamp(max=math.log(c)).exp(), zero[:, 0])
    mean_B = sum_B / len_B.clamp(min=1)  # geo_mask: log of the geometric mean of rho
    keep = valid_B & (mean_B >= math.log(low)) & (mean_B <= math.log(high))
    return keep.to(lr_BT.dtype)


def correction_weights_for(
    cfg: AlgoConfig, old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor | None:
    """:func:`correction_weights` with the method and constants of ``cfg`` (algo.rollout_correction,
    correction_c, correction_low, correction_high)."""
    return correction_weights(
        old_logp_BT,
        rollout_logp_BT,
        mask_BT,
        method=cfg.rollout_correction,
        c=cfg.correction_c,
        low=cfg.correction_bounds[0],
        high=cfg.correction_bounds[1],
    )


@torch.no_grad()
def correction_metrics(
    weights: torch.Tensor | None, mask_BT: torch.Tensor, *, num_sequences: float, num_tokens: float
) -> dict[str, torch.Tensor]:
    """``correction/weight_mean`` and ``correction/masked_frac`` (share with weight 0) of weights
    from :func:`correction_weights`; {} for None.

    Token-level weights [B, T]: over valid tokens, divided by ``num_tokens``. Sequence-level
    weights [B]: over non-empty sequences, divided by ``num_sequences``. Both are global counts.
    """
    if weights is None:
        return {}
    mask = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    if weights.dim() == 2:
        valid, count = mask, num_tokens
    else:
        valid, count = mask.any(-1), num_sequences
    if weights.shape != valid.shape:
        raise ValueError(f"weights of shape {tuple(weights.shape)} do not match mask {tuple(mask.shape)}")
    w = torch.where(valid, weights, torch.zeros_like(weights))
    return {
        "correction/weight_mean": w.sum() / count,
        "correction/masked_frac": ((w == 0) & valid).to(w.dtype).sum() / count,
    }


@torch.no_grad()
def mismatch_metrics(
    old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *, num_tokens: float
) -> dict[str, torch.Tensor]:
    """Train-inference mismatch of pi_old (trainer) against pi_roll (engine) on valid tokens.

    - ``mismatch/abs_log_ratio``: sum |log rho| / num_tokens.
    - ``mismatch/k3``: k3 estimate of KL(pi_roll || pi_old), sum (rho - 1 - log rho) / num_tokens.
      The samples come from pi_roll, so this is k3(logp=rollout, ref=old), unbiased for that KL.
    - ``mismatch/extreme_frac``: tokens with |log rho| > ln 2 / num_tokens.
    - ``mismatch/seq_log_ratio_abs_max``: max over non-empty sequences of |sum_t log rho_t| (max
      reduction; -inf when there is none).
    old_logp_BT, rollout_logp_BT, mask_BT: [B, T]; num_tokens: global valid-token count.
    """
    lr_BT, mask = log_rho(old_logp_BT, rollout_logp_BT, mask_BT)
    zero = torch.zeros_like(lr_BT)
    valid_B = mask.any(-1)
    seq_abs_B = lr_BT.sum(-1).abs()
    seq_max = (
        torch.where(valid_B, seq_abs_B, float("-inf")).amax()
        if seq_abs_B.numel()
        else lr_BT.new_tensor(-math.inf)
    )
    return {
        "mismatch/abs_log_ratio": lr_BT.abs().sum() / num_tokens,
        # k3(logp=rollout, ref=old) depends only on old - rollout = log rho: rho - 1 - log rho
        "mismatch/k3": torch.where(mask, k3(zero, lr_BT), zero).sum() / num_tokens,
        "mismatch/extreme_frac": ((lr_BT.abs() > EXTREME_LOG_RATIO) & mask).to(lr_BT.dtype).sum()
        / num_tokens,
        "mismatch/seq_log_ratio_abs_max": seq_max,
    }
