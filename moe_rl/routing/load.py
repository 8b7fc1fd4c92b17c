"""Expert load metrics (docs/algorithms.md#expert-load).

Shape legend: N = tokens, L = MoE layers, K = experts per token, E = experts.

The load of expert e in layer l is the number of (token, slot) assignments its router made to it:
each token counts once for each of its K experts. From the loads of one layer,

    load_imbalance = max_e load / mean_e load          (1: every expert got the same share)

(prime-rl logs ``max_vio`` = this - 1 per layer), ``dead_frac`` is the share of (layer, expert)
pairs that got no token, and the router entropy is the entropy of a router's softmax over all E
experts, averaged over valid tokens and layers. :func:`expert_load_counts` returns additive sums,
so counts of micro-batches and data-parallel ranks are summed before :func:`expert_load_metrics`
divides them.
"""

from __future__ import annotations

import torch


def expert_load_counts(
    routes_NLK: torch.Tensor,
    num_experts: int,
    mask_N: torch.Tensor | None = None,
    entropy_NL: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Additive sums of the valid tokens (``mask_N``): assignments per layer and expert
    (``load_LE``, float64), tokens (``tokens``) and, given each token's router entropy per layer,
    its sum per layer (``entropy_sum_L``)."""
    n, num_layers, _ = routes_NLK.shape
    device = routes_NLK.device
    mask_N = torch.ones(n, device=device) if mask_N is None else mask_N.reshape(n)
    keep_N = mask_N.to(torch.bool)
    routes = routes_NLK[keep_N].to(torch.int64)  # [n', L, K]
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"routes name experts outside 0..{num_experts - 1}")
    layer_offset = torch.arange(num_layers, device=device).reshape(1, -1, 1) * num_experts
    flat = (routes + layer_offset).reshape(-1)
    load = torch.bincount(flat, minlength=num_layers * num_experts).to(torch.float64)
    out = {"load_LE": load.reshape(num_layers, num_experts), "tokens": keep_N.sum().to(torch.float64)}
    if entropy_NL is not None:
        out["entropy_sum_L"] = entropy_NL.reshape(n, num_layers)[keep_N].to(torch.float64).sum(0)
    return out


def expert_load_metrics(counts: dict, prefix: str = "experts") -> dict[str, float]:
    """Metrics of (summed) :func:`expert_load_counts`: ``load_imbalance/layer_<l>``, their mean
    ``load_imbalance``, ``dead_frac`` and, when entropies were counted, ``router_entropy``."""
    tokens = float(counts["tokens"])
    if tokens == 0:
        return {}
    load_LE = counts["load_LE"].to(torch.float64)
    imbalance_L = load_LE.max(1).values / load_LE.mean(1)
    out = {f"{prefix}/load_imbalance": float(imbalance_L.mean())}
    out[f"{prefix}/dead_frac"] = float((load_LE == 0).to(torch.float64).mean())
    if "entropy_sum_L" in counts:
        out[f"{prefix}/router_entropy"] = float(counts["entropy_sum_L"].sum()) / (tokens * load_LE.shape[0])
    for i, v in enumerate(imbalance_L.tolist()):
        out[f"{prefix}/load_imbalance/layer_{i}"] = v
    return out


def router_entropy_N(scores_NE: torch.Tensor, *, probabilities: bool) -> torch.Tensor:
    """Entropy (nats) of each row's distribution over experts, float32 ``[N]``: of the softmax of
    ``scores_NE`` (router logits), or of the rows themselves when they are ``probabilities``."""
    if probabilities:
        return torch.special.entr(scores_NE.float()).sum(-1)
    logp = torch.log_softmax(scores_NE.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
