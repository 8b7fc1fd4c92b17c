"""Pieces shared by every policy-gradient loss: their one input (:class:`LossBatch`, built and
checked once by :func:`loss_batch`), the masked log-ratio, the clipped surrogate and the two
aggregations (docs/algorithms.md#clipped-surrogate).

Shape legend: B = sequences in this microbatch, T = padded tokens per sequence.

Every loss sees one microbatch but divides by GLOBAL denominators (``num_sequences``,
``num_tokens``: all microbatches and data-parallel ranks of one optimizer step), so the
microbatch losses, and their gradients, add up to the loss of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("seq_mean", "token_mean")


@dataclass(frozen=True, kw_only=True)
class LossBatch:
    """The one input of every loss: one microbatch, checked, upcast to at least float32 and zeroed
    on padding. Build it with :func:`loss_batch`; the losses only read it."""

    mask_BT: torch.Tensor
    "bool, True on response tokens."
    logp_BT: torch.Tensor
    "log pi_theta (carries the gradient), 0 on padding."
    logratio_BT: torch.Tensor
    "d = log pi_theta - log pi_old (carries the gradient), 0 on padding."
    adv_BT: torch.Tensor
    "Advantage of every token (per-sequence advantages broadcast), 0 on padding; no gradient."
    adv_B: torch.Tensor
    "Advantage of every sequence (masked mean of adv_BT when per-token), 0 for empty rows."
    token_adv: bool
    "Whether the advantages were given per token ([B, T]); gspo refuses them."
    len_B: torch.Tensor
    "|y_i|: valid tokens per sequence (float)."
    valid_B: torch.Tensor
    "bool, the sequence has at least one valid token."
    num_sequences: float
    "Global sequence count of the optimizer step."
    num_tokens: float
    "Global valid-token count of the optimizer step."
    ref_logp_BT: torch.Tensor | None
    "log pi_ref of the KL term (detached, 0 on padding), or None."
    is_weights: torch.Tensor | None
    "Detached train-inference correction weights, [B] or [B, T] (raw: padding not yet zeroed), or None."


def _check_count(name: str, value: float) -> None:
    if isinstance(value, (int, float)) and not value > 0:
        raise ValueError(f"{name} must be a positive global count, got {value}")


def _check_shape(name: str, t: torch.Tensor | None, shape: tuple[int, int], per_seq_ok: bool) -> None:
    """``t`` is None, [B, T] = ``shape`` or, when ``per_seq_ok``, [B]."""
    if t is None or tuple(t.shape) == shape or (per_seq_ok and tuple(t.shape) == shape[:1]):
        return
    if per_seq_ok:
        raise ValueError(
            f"loss inputs: {name} must be [B]={shape[0]} or [B, T]={shape}, got {tuple(t.shape)}"
        )
    raise ValueError(f"loss inputs: {name} has shape {tuple(t.shape)}, logp has {shape}")


def loss_batch(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    num_sequences: float,
    num_tokens: float,
    ref_logp_BT: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossBatch:
    """Check shapes and build the :class:`LossBatch` every loss takes, once per microbatch.

    logp_BT (pi_theta, carries the gradient), old_logp_BT (pi_old), mask_BT: [B, T]; adv: [B] or
    per-token [B, T]; ref_logp_BT: [B, T] reference log-probs of the KL term, or None; is_weights:
    None or the train-inference correction weights of ``moe_rl.losses.corrections``, [B] or
    [B, T]. num_sequences, num_tokens: the global counts of the optimizer step.
    Values at padded positions are ignored (they may be anything, even inf or nan).
    The math runs in float32 (bf16 / fp16 inputs are upcast) or in float64 for float64 inputs.
    """
    if logp_BT.dim() != 2:
        raise ValueError(f"loss inputs: logp must be [B, T], got shape {tuple(logp_BT.shape)}")
    shape = tuple(logp_BT.shape)
    for name, t in (("old_logp", old_logp_BT), ("mask", mask_BT), ("ref_logp", ref_logp_BT)):
        _check_shape(name, t, shape, per_seq_ok=False)
    _check_shape("adv", adv, shape, per_seq_ok=True)
    _check_shape("is_weights", is_weights, shape, per_seq_ok=True)
    _check_count("num_sequences", num_sequences)
    _check_count("num_tokens", num_tokens)

    mask = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    dtype = torch.promote_types(logp_BT.dtype, torch.float32)
    zero = logp_BT.new_zeros((), dtype=dtype)
    logp = torch.where(mask, logp_BT.to(dtype), zero)
    old = torch.where(mask, old_logp_BT.detach().to(dtype), zero)
    adv = adv.detach().to(dtype)
    len_B = mask.sum(-1).float()
    valid_B = len_B > 0
    if adv.dim() == 1:
        adv_BT = torch.where(mask, adv[:, None], zero)
        adv_B = torch.where(valid_B, adv, zero)
    else:
        adv_BT = torch.where(mask, adv, zero)
        adv_B = adv_BT.sum(-1) / len_B.clamp(min=1)
    return LossBatch(
        mask_BT=mask,
        logp_BT=logp,
        logratio_BT=logp - old,
        adv_BT=adv_BT,
        adv_B=adv_B,
        token_adv=adv.dim() == 2,
        len_B=len_B,
        valid_B=valid_B,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        ref_logp_BT=None if ref_logp_BT is None else torch.where(mask, ref_logp_BT.detach().to(dtype), 0.0),
        is_weights=None if is_weights is None else is_weights.detach().to(dtype),
    )


def is_clipped(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """True where the ratio is outside [1 - eps_low, 1 + eps_high] on the side that zeroes the
    gradient of min(ratio A, clip(ratio) A): A > 0 and ratio > 1 + eps_high, or A < 0 and
    ratio < 1 - eps_low. ``ratio`` and ``adv`` broadcast ([B] or [B, T])."""
    return ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))


def dual_clipped(ratio: torch.Tensor, adv: torch.Tensor, clip_c: float | None) -> torch.Tensor:
    """True where the dual clip binds: A < 0 and ratio > c (all False when ``clip_c`` is None).

    For A < 0, max(min(r A, clip(r) A), c A) equals c A exactly when r > c (c > 1 >= 1 - eps_low).
    ``ratio`` and ``adv`` broadcast ([B] or [B, T]).
    """
    if clip_c is None:
        return torch.zeros(
            torch.broadcast_shapes(ratio.shape, adv.shape), dtype=torch.bool, device=ratio.device
        )
    if not clip_c > 1.0:
        raise ValueError(
            f"dual-clip constant clip_ratio_c must be > 1, got {clip_c}; set it above 1 or to None"
        )
    return (adv < 0) & (ratio > clip_c)


@torch.no_grad()
def dual_clip_frac(dual_BT: torch.Tensor, b: LossBatch) -> torch.Tensor:
    """``clip/dual_clip_frac``: valid tokens whose term the dual clip fixed at c A, over the step's
    ``num_tokens`` (additive across microbatches and ranks). dual_BT: bool [B, T]."""
    return (dual_BT & b.mask_BT).to(b.logp_BT.dtype).sum() / b.num_tokens


def clipped_surrogate(
    logratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_c: float | None = None,
) -> torch.Tensor:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with r = exp(logratio), elementwise; with a
    dual-clip constant c (``clip_c``, None = off), max(that, c A) where A < 0.

    Dual clip is the semantics of verl's ``clip_ratio_c`` (vanilla loss; verl's GSPO loss ignores
    it) and slime's ``eps_clip_c``: for A < 0 and r > c the term is the constant c A, with no
    gradient; elsewhere nothing changes. TRL's ``delta`` (r clamped at delta before the min) is
    the same only for delta >= 1 + eps_high; below, it lowers the upper clip to delta for A > 0
    and holds A < 0 terms at (1 + eps_high) A (docs/algorithms.md#dual-clip).

    Written as "frozen ? bound * A : r A" (the same function, value and gradient), so that a
    clipped element has exactly zero gradient and the ratio is never exponentiated there: a huge
    clipped log-ratio cannot turn into inf * 0 = nan in the backward pass.
    """
    ratio_d = logratio.detach().exp()
    clipped = is_clipped(ratio_d, adv, eps_low, eps_high)
    dual = dual_clipped(ratio_d, adv, clip_c)  # disjoint from clipped: A < 0 there needs r < 1 - eps_low
    frozen = clipped | dual
    ratio = torch.exp(torch.where(frozen, torch.zeros_like(logratio), logratio))
    bound_adv = torch.where(adv > 0, (1.0 + eps_high) * adv, (1.0 - eps_low) * adv)
    if clip_c is not None:
        bound_adv = torch.where(dual, clip_c * adv, bound_adv)
    return torch.where(frozen, bound_adv, ratio * adv)


def seq_mean_logratio(b: LossBatch) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t d_{i,t}: [B], 0 for empty rows, carries the gradient."""
    return b.logratio_BT.sum(-1) / b.len_B.clamp(min=1)


def aggregate_tokens(x_BT: torch.Tensor, b: LossBatch, aggregation: str) -> torch.Tensor:
    """Scalar contribution of per-token values [B, T] to the batch mean.

    seq_mean: sum_i (1/|y_i|) sum_t x / num_sequences; token_mean: sum_{i,t} x / num_tokens.
    """
    x_BT = torch.where(b.mask_BT, x_BT, torch.zeros_like(x_BT))
    if aggregation == "seq_mean":
        return (x_BT.sum(-1) / b.len_B.clamp(min=1)).sum() / b.num_sequences
    if aggregation == "token_mean":
        return x_BT.sum() / b.num_tokens
    raise ValueError(f"aggregation={aggregation!r}: use one of {AGGREGATIONS}")


def aggregate_seqs(x_B: torch.Tensor, b: LossBatch, aggregation: str) -> torch.Tensor:
    """Scalar contribution of per-sequence values [B] to the batch mean.

    seq_mean: sum_i x_i / num_sequences; token_mean: sum_i |y_i| x_i / num_tokens (each sequence
    weighted by its length, which is what token_mean of x_i broadcast to every token gives).
    """
    x_B = torch.where(b.valid_B, x_B, torch.zeros_like(x_B))
    if aggregation == "seq_mean":
        return x_B.sum() / b.num_sequences
    if aggregation == "token_mean":
        return (x_B * b.len_B).sum() / b.num_tokens
    raise ValueError(f"aggregation={aggregation!r}: use one of {AGGREGATIONS}")


def token_weights(b: LossBatch) -> torch.Tensor | None:
    """The batch's correction weights as [B, T], 0 on padding ([B] weights broadcast over tokens),
    or None. The weights multiply each token's term before aggregation; denominators do not change.
    """
    if b.is_weights is None:
        return None
    w = b.is_weights
    w_BT = w[:, None].expand(b.mask_BT.shape) if w.dim() == 1 else w
    return torch.where(b.mask_BT, w_BT, torch.zeros_like(w_BT))


def sequence_weights(b: LossBatch, loss_name: str) -> torch.Tensor | None:
    """The batch's correction weights [B] for a one-term-per-sequence loss, 0 for empty rows, or None.

    Token-level [B, T] weights are refused: such a loss has no per-token term to weight.
    """
    if b.is_weights is None:
        return None
    w = b.is_weights
    if w.dim() == 2:
        raise ValueError(
            f"{loss_name} has one term per sequence and takes sequence-level is_weights [B] "
            f"(seq_tis, geo_mask), got token-level {tuple(w.shape)}; use gspo_token for token-level "
            "corrections (tis, icepop, icepop_mask)"
        )
    return torch.where(b.valid_B, w, torch.zeros_like(w))
