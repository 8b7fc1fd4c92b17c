"""PyTorch reference: per-token log-probs and entropy from (vocab-parallel) logits.

Shape legend: N = tokens, V = local vocabulary shard (the whole vocabulary when tp=1).

``logprobs_entropy(logits_NV, target_N, temperature, group, vocab_start)`` returns
log softmax(logits / temperature)[target] and the entropy of that distribution, in fp32,
with the max, sum-exp, target logit and expected logit reduced across the tensor-parallel
``group`` (explicit; ``None`` or a group of one means no communication). The backward is
analytic and needs no communication: every rank gets the gradient of its own shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_rl.dist import all_reduce


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over the tensor-parallel ``group``; None means no tensor parallelism (no-op)."""
    return t if group is None else all_reduce(t, group, op)


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_N, temperature, group, vocab_start, with_entropy):
        z = logits_NV.float() / temperature
        m = z.max(dim=-1).values
        _all_reduce(m, group, dist.ReduceOp.MAX)
        e = torch.exp(z - m[:, None])
        s = _all_reduce(e.sum(dim=-1), group)
        lse = m + torch.log(s)
        local = target_N - vocab_start
        in_shard = (local >= 0) & (local < z.shape[-1])
        idx = local.clamp(0, z.shape[-1] - 1)
        tgt = torch.where(in_shard, z.gather(-1, idx[:, None]).squeeze(-1), torch.zeros_like(m))
        tgt = _all_reduce(tgt, group)
        logp = tgt - lse
        if with_entropy:
            p = e / s[:, None]
            ez = _all_reduce((p * z).sum(dim=-1), group)
            entropy = lse - ez
        else:
            ez = torch.zeros_like(m)
            entropy = torch.zeros_like(m)
        ctx.save_for_backward(logits_NV, lse, ez, idx, in_shard)
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        logits_NV, lse, ez, idx, in_shard = ctx.saved_tensors
        t = ctx.temperature
        z = logits_NV.float() / t
        p = torch.exp(z - lse[:, None])
        # d logp / dz_j = 1[j = target] - p_j ;  d H / dz_j = -p_j (z_j - E_p[z])
        grad = -p * g_logp[:, None]
        grad.scatter_add_(-1, idx[:, None], (g_logp * in_shard.float())[:, None])
        if ctx.with_entropy:
            grad = grad - p * (z - ez[:, None]) * g_entropy[:, None]
        return (grad / t).to(logits_NV.dtype), None, None, None, None, None


def logprobs_entropy(
    logits_NV: torch.Tensor,
    target_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    vocab_start: int = 0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-prob of ``target_N`` and entropy (zeros unless asked) per token; see module doc."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive for log-probs, got {temperature}")
    return _VocabParallelLogProb.apply(
        logits_NV, target_N, float(temperature), group, int(vocab_start), bool(with_entropy)
    )
