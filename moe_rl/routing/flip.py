"""Expert flip metrics (docs/algorithms.md#expert-flip-rate).

Shape legend: N = tokens, L = MoE layers, K = experts per token.

Flip rate between routes a and b of the same tokens: 1 - |R^a intersect R^b| / K per
(token, layer), averaged over valid tokens and layers (per slot, the share of the K activated
experts that changed). The per-router rate is the share of (token, layer) decisions whose expert
set changed at all (the R3 paper's unit: for top-K up to K times the per-slot rate). Rows hold K distinct experts in
any order. ``flip_counts`` returns additive sums (so counts from microbatches or
data-parallel ranks can be summed before ``flip_metrics`` divides them).
"""

from __future__ import annotations

import torch


def overlap_NL(a_NLK: torch.Tensor, b_NLK: torch.Tensor) -> torch.Tensor:
    """|R^a intersect R^b| per token and layer (int64 [N, L])."""
    if a_NLK.shape != b_NLK.shape:
        raise ValueError(f"route shapes differ: {tuple(a_NLK.shape)} vs {tuple(b_NLK.shape)}")
    a = a_NLK.to(torch.int64)
    b = b_NLK.to(torch.int64)
    return (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)


def flip_counts(a_NLK: torch.Tensor, b_NLK: torch.Tensor, mask_N: torch.Tensor | None = None) -> dict:
    """Additive flip sums: per-layer changed-expert share, changed routers, any-flip tokens and
    valid tokens."""
    k = a_NLK.shape[-1]
    ov = overlap_NL(a_NLK, b_NLK)
    if mask_N is None:
        mask_N = torch.ones(ov.shape[0], dtype=torch.float32, device=ov.device)
    m = mask_N.to(torch.float32).reshape(-1, 1)
    flip_NL = (1.0 - ov.to(torch.float32) / k) * m
    return {
        "flip_sum_L": flip_NL.sum(0),
        "router_sum": ((ov < k).to(torch.float32) * m).sum(),
        "any_sum": ((ov < k).any(-1).to(torch.float32) * m[:, 0]).sum(),
        "tokens": m.sum(),
    }


def flip_metrics(counts: dict, prefix: str = "flip") -> dict[str, float]:
    """Rates from (summed) :func:`flip_counts`: per slot (``rate``, per layer), per router
    (``router_rate``) and per token (``token_any``: the expert set changed in any layer)."""
    n = float(counts["tokens"])
    if n == 0:
        return {}
    per_layer = counts["flip_sum_L"] / n
    out = {f"{prefix}/rate": float(per_layer.mean()), f"{prefix}/token_any": float(counts["any_sum"]) / n}
    if "router_sum" in counts:
        out[f"{prefix}/router_rate"] = float(counts["router_sum"]) / (n * per_layer.numel())
    for i, v in enumerate(per_layer.tolist()):
        out[f"{prefix}/layer_{i}"] = v
    return out


def flip_rate(
    a_NLK: torch.Tensor, b_NLK: torch.Tensor, mask_N: torch.Tensor | None = None, prefix: str = "flip"
) -> dict[str, float]:
    """Flip metrics of one pair of route sets (see module doc)."""
    return flip_metrics(flip_counts(a_NLK, b_NLK, mask_N), prefix)
