"""PyTorch reference: per-token log-probs and entropy from hidden states, chunked over vocab.

Shape legend: N = tokens, H = hidden size, V = local vocabulary shard (the whole vocabulary
when tp=1), C = vocab chunk width, P = partials (vocab chunks or kernel splits).

``hidden_logprobs_entropy(hidden_NH, weight_VH, target_N, ...)`` has the semantics of
``logprob_reference.logprobs_entropy(hidden_NH @ weight_VH.T, target_N, ...)`` but never
holds more than a ``[N, C]`` slice of the logits: the forward keeps, per vocab chunk, the
partials (max m, sum-exp s, target logit t, sum exp(z - m) z) of z = logits / temperature,
which combine exactly across chunks and across tensor-parallel ranks (all-reduce of the max,
then of the rescaled sums, on the explicit ``group``). The backward recomputes each chunk's
logits and multiplies its logit gradient ``G_NC`` into dH and into that chunk's rows of dW.
Logits are fp32 dot products of the inputs, not rounded to bf16 as megatron's output layer
rounds them, so for bf16 inputs this path is more accurate than logits -> logprobs_entropy;
``G_NC`` is rounded to the input dtype before the two GEMMs, and dH accumulates in fp32.

The same driver (``VocabChunkedLogProb``) runs the Triton kernels of ``fused_logprob.py``:
the reference and the kernel differ only in how the partials and ``G_NC`` are computed.
As with a column-parallel output layer, the gradient of ``hidden_NH`` is this shard's
contribution: under TP the caller all-reduces it over the group (megatron-core's
``copy_to_tensor_model_parallel_region`` does), and every rank gets the gradient of its own
weight rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_rl.kernels.logprob_reference import _all_reduce

DEFAULT_CHUNK_ELEMENTS = 1 << 24
"Default cap on N * C, the elements of one logits / gradient chunk (64 MiB in fp32)."


def _empty(shape, dtype, device) -> torch.Tensor:
    """Allocation of every output the kernels or chunk loops write (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def vocab_chunk_width(
    n: int, v: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, multiple: int = 256
) -> int:
    """Vocab chunk width C <= v with n * C <= chunk_elements (at least ``multiple`` columns)."""
    c = max(multiple, (chunk_elements // max(n, 1)) // multiple * multiple)
    return min(c, v)


def check_inputs(hidden_NH, weight_VH, target_N, temperature: float) -> None:
    """Shape, dtype and temperature checks shared by the reference and the kernel."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive for log-probs, got {temperature}")
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or hidden_NH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"need hidden [N, H] and weight [V, H], got {tuple(hidden_NH.shape)} and {tuple(weight_VH.shape)}"
        )
    if target_N.shape != hidden_NH.shape[:1]:
        raise ValueError(f"target must be [N={hidden_NH.shape[0]}], got {tuple(target_N.shape)}")
    if hidden_NH.dtype != weight_VH.dtype:
        raise ValueError(f"hidden ({hidden_NH.dtype}) and weight ({weight_VH.dtype}) must share a dtype")


def local_targets(target_N: torch.Tensor, vocab_start: int, v: int) -> torch.Tensor:
    """int32 target ids relative to this shard; -1 where the target is in another shard."""
    local = target_N.long() - vocab_start
    return torch.where((local >= 0) & (local < v), local, -1).to(torch.int32)


def _logits(hidden_NH, weight_CH) -> torch.Tensor:
    """fp32 logits [N, C] of a chunk, never rounded to the input dtype (as in the kernel)."""
    return hidden_NH.float() @ weight_CH.float().T


def chunk_partials(hidden_NH, weight_CH, tgt_local_N, inv_t: float, with_entropy: bool) -> torch.Tensor:
    """[4, N] fp32 partials (m, s, t, a) of one vocab chunk; tgt_local_N relative to the chunk."""
    z = _logits(hidden_NH, weight_CH) * inv_t
    m = z.max(dim=-1).values
    e = torch.exp(z - m[:, None])
    c = z.shape[1]
    hit = (tgt_local_N >= 0) & (tgt_local_N < c)
    t = torch.where(hit, z.gather(-1, tgt_local_N.long().clamp(0, c - 1)[:, None]).squeeze(-1), 0.0)
    a = (e * z).sum(-1) if with_entropy else torch.zeros_like(m)
    return torch.stack([m, e.sum(-1), t, a])


def reference_partials(
    hidden_NH, weight_VH, tgt_local_N, inv_t: float, with_entropy: bool, chunk: int
) -> torch.Tensor:
    """[4, P, N] partials, one per vocab chunk of width ``chunk``."""
    parts = [
        chunk_partials(hidden_NH, weight_VH[v0 : v0 + chunk], tgt_local_N - v0, inv_t, with_entropy)
        for v0 in range(0, weight_VH.shape[0], chunk)
    ]
    return torch.stack(parts, dim=1)


def combine_partials(part_4PN: torch.Tensor, group, with_entropy: bool):
    """Exact reduction of partials over P and over the TP group: (logp, entropy, lse, ez), [N] each.

    m = max_i m_i; s = sum_i s_i exp(m_i - m) (likewise a); lse = m + log s; E_p[z] = a / s.
    Two all-reduces: MAX of m, then SUM of the stacked rescaled (s, t, a).
    """
    m_p, s_p, t_p, a_p = part_4PN.unbind(0)
    m = m_p.max(dim=0).values
    _all_reduce(m, group, dist.ReduceOp.MAX)
    w = torch.exp(m_p - m)  # an empty split has m_i = -inf, s_i = a_i = 0: weight 0
    sums = torch.stack([(s_p * w).sum(0), t_p.sum(0), (a_p * w).sum(0)])
    _all_reduce(sums, group)
    s, t, a = sums.unbind(0)
    lse = m + torch.log(s)
    logp = t - lse
    if with_entropy:
        ez = a / s
        return logp, lse - ez, lse, ez
    zero = torch.zeros_like(m)
    return logp, zero, lse, zero


def chunk_grad(
    hidden_NH, weight_CH, tgt_local_N, lse_N, ez_N, g_logp_N, g_ent_N, inv_t: float, with_entropy: bool
) -> torch.Tensor:
    """Logit gradient G_NC of one vocab chunk, in the input dtype; tgt_local_N relative to the chunk.

    G = (g_logp (onehot - p) - g_ent p (z - E_p[z])) / T with p = exp(z - lse).
    """
    z = _logits(hidden_NH, weight_CH) * inv_t
    p = torch.exp(z - lse_N[:, None])
    c = z.shape[1]
    cols = torch.arange(c, device=z.device)
    g = (cols[None, :] == tgt_local_N.long()[:, None]).float() * g_logp_N[:, None] - p * g_logp_N[:, None]
    if with_entropy:
        g = g - p * (z - ez_N[:, None]) * g_ent_N[:, None]
    return (g * inv_t).to(hidden_NH.dtype)


class VocabChunkedLogProb(torch.autograd.Function):
    """Forward from partials, backward from per-chunk logit gradients; backends pluggable."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH,
        weight_VH,
        target_N,
        temperature,
        group,
        vocab_start,
        with_entropy,
        partials_fn: Callable,
        grad_fn: Callable,
        chunk: int,
    ):
        inv_t = 1.0 / temperature
        h, w = hidden_NH.contiguous(), weight_VH.contiguous()
        tgt = local_targets(target_N, vocab_start, w.shape[0])
        part = partials_fn(h, w, tgt, inv_t, with_entropy)
        logp, ent, lse, ez = combine_partials(part, group, with_entropy)
        ctx.save_for_backward(h, w, tgt, lse, ez)
        ctx.cfg = (inv_t, with_entropy, grad_fn, chunk)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, tgt, lse, ez = ctx.saved_tensors
        inv_t, with_entropy, grad_fn, chunk = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[:2]
        g_logp = g_logp.float().contiguous()
        g_ent = g_ent.float().contiguous()
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        dw = _empty(w.shape, w.dtype, w.device) if need_w else None
        for v0 in range(0, w.shape[0], chunk):
            w_c = w[v0 : v0 + chunk]
            g_nc = grad_fn(h, w_c, tgt, v0, lse, ez, g_logp, g_ent, inv_t, with_entropy)
            if need_h:
                dh.add_(g_nc @ w_c)
            if need_w:
                torch.mm(g_nc.T, h, out=dw[v0 : v0 + chunk])
        dh = dh.to(h.dtype) if need_h else None
        return dh, dw, None, None, None, None, None, None, None, None


def _torch_grad(h, w_c, tgt, v0, lse, ez, g_logp, g_ent, inv_t, with_entropy):
    return chunk_grad(h, w_c, tgt - v0, lse, ez, g_logp, g_ent, inv_t, with_entropy)


def hidden_logprobs_entropy(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    vocab_start: int = 0,
    with_entropy: bool = False,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-prob of ``target_N`` and entropy (zeros unless asked) per token, [N] each.

    hidden_NH [N, H] and weight_VH [V, H] (this rank's vocab rows, starting at global id
    ``vocab_start``) share a dtype; target_N [N] holds global ids. ``vocab_chunk``: columns
    per chunk (default: N * C <= 2**24). See the module doc for TP and gradients.
    """
    check_inputs(hidden_NH, weight_VH, target_N, temperature)
    n, v = hidden_NH.shape[0], weight_VH.shape[0]
    chunk = vocab_chunk or vocab_chunk_width(n, v)

    def partials(h, w, tgt, inv_t, with_ent):
        return reference_partials(h, w, tgt, inv_t, with_ent, chunk)

    return VocabChunkedLogProb.apply(
        hidden_NH,
        weight_VH,
        target_N,
        float(temperature),
        group,
        int(vocab_start),
        bool(with_entropy),
        partials,
        _torch_grad,
        chunk,
    )
