"""RoPE for packed (``thd``) rows in one pass, in place of megatron-core's loop over sequences.

megatron-core's unfused ``thd`` RoPE (``rope_utils._apply_rotary_pos_emb_thd``) handles a pack
sequence by sequence: 0.19 applies the whole rotation to each sequence on its own (about a dozen
kernels per sequence, per query and key, per layer, and as many again in the backward), 0.16
slices the table once per sequence. On the lent H100 a 64-row training pass of the 1B policy
launched ~35,000 kernels and kept the GPU busy 8% of the time, most of them these
(``benchmarks/results/gpu_profile-nvidia-h100-80gb-hbm3-1b-train-pass-77ae9ae.json``).

:func:`apply_rotary_pos_emb` computes the same thing in one pass: each packed position's index
within its own sequence (a ``searchsorted`` over the boundaries, on the device, no host sync),
one gather of the RoPE table, one rotation of the whole pack; the table's cosine and sine are taken
once per forward (every layer's query and key share them), not twice per layer. It stands in for
megatron-core's function where that one's attention module calls it (:func:`install`) and hands
every case it does not cover back to megatron-core unchanged: fused RoPE (transformer-engine),
context parallelism, multi-latent attention, ``bshd`` (no ``cu_seqlens``). For the cases it covers its
values are megatron-core's own (``tests/unit/test_packed_rope.py`` holds it to the stock function
of the installed megatron-core, values and gradients, and holds its op count independent of the
number of sequences).
"""

from __future__ import annotations

import torch

#: megatron-core's own function, as its attention module imported it (set by :func:`install`).
_STOCK = None
#: per-forward values every layer's query and key share, each kept for the last tensors it was
#: computed from (:func:`_last`): ``"freqs"``, the pack's per-position table (one gather for the
#: forward); ``"trig"``, that table's cosine and sine (one of each for the forward).
_LAST: dict[str, tuple] = {}


def _last(slot: str, owners: tuple[torch.Tensor, ...], key: tuple, compute):
    """``compute()``, or its value for the same ``owners`` (by identity, each at the same
    ``_version``) and ``key`` when ``slot`` last computed it."""
    key = (*(t._version for t in owners), *key)
    hit = _LAST.get(slot)
    if hit is not None and hit[1] == key and all(a is b for a, b in zip(hit[0], owners)):
        return hit[2]
    out = compute()
    _LAST[slot] = (owners, key, out)
    return out


def packed_positions(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """Each of the ``n`` packed positions' index within its own sequence, int64 ``[n]``, on
    ``cu_seqlens``'s device (boundaries ``cu_seqlens[i] .. cu_seqlens[i + 1]``)."""
    cu = cu_seqlens.to(torch.int64)
    idx = torch.arange(n, device=cu.device)
    seg = torch.searchsorted(cu[1:].contiguous(), idx, right=True)
    return idx - cu[seg]


def packed_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """The RoPE table ``freqs [max_s, 1, 1, d]`` at every packed position: ``[n, 1, 1, d]``, each
    sequence's positions from 0 (megatron-core's ``thd`` rule without context parallelism)."""
    return _last(
        "freqs", (freqs, cu_seqlens), (n,), lambda: freqs[packed_positions(cu_seqlens, n).to(freqs.device)]
    )


def _one_pass_ok(t, freqs, config, cu_seqlens, cp_group, mla_rotary_interleaved) -> bool:
    return (
        cu_seqlens is not None
        and not config.apply_rope_fusion
        and not config.multi_latent_attention
        and not mla_rotary_interleaved
        and cp_group is not None
        and cp_group.size() == 1
        and t.dim() == 3
        and freqs.dim() == 4
    )


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group=None,
    **kwargs,
):
    """megatron-core's ``apply_rotary_pos_emb`` (same arguments), the unfused ``thd`` path without
    context parallelism in one pass: ``t [n, heads, d]`` rotated by ``freqs``, a per-sequence
    table ``[max_s, 1, 1, d]`` or one that already holds every packed position (``[n, 1, 1, d]``,
    megatron-core's "exact mapping": at CP 1 its per-sequence slices put the table back whole)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if not _one_pass_ok(t, freqs, config, cu_seqlens, cp_group, kwargs.get("mla_rotary_interleaved")):
        return _STOCK(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kwargs)
    n = t.shape[0]
    table = freqs if freqs.shape[0] == n else packed_freqs(freqs, cu_seqlens, n)
    if config.rotary_interleaved or table.shape[-1] != t.shape[-1] or table.requires_grad:
        return _apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), table, rotary_interleaved=config.rotary_interleaved, mscale=mscale
        ).squeeze(1)
    # megatron-core's _apply_rotary_pos_emb_bshd for a rotation over the whole head (no pass-through
    # part, not interleaved), its cosine and sine taken once per table
    cos, sin_signed = table_trig(table, mscale, t.dtype)
    return rotate(t, cos, sin_signed)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """megatron-core's non-interleaved rotation ``t * cos + rotate_half(t) * sin`` over the last
    dimension, with ``sin_signed`` (:func:`signed_sin`) for ``sin``. ``rotate_half(t)`` is
    ``cat(-t2, t1)``: ``t`` rolled by half its width with the first half's sign moved into the
    table. Equal to megatron-core's form to the bit (a sign flip is exact, the sum is the same
    sum), in four ops where that one takes six (split, neg, cat): fewer kernels per query and key
    per layer, in the forward and in the backward."""
    return t * cos + t.roll(t.shape[-1] // 2, -1) * sin_signed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with the first half of its last dimension negated: :func:`rotate`'s table."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def table_trig(table: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(table) * mscale`` and ``sin(table) * mscale`` (the latter as :func:`signed_sin`) in
    ``dtype``, ``[n, 1, d]``, as megatron-core computes them for every rotation; computed once for
    the last table (a forward's layers share it)."""

    def trig():
        cos, sin = ((f(table) * mscale).to(dtype).squeeze(1) for f in (torch.cos, torch.sin))
        return cos, signed_sin(sin)

    return _last("trig", (table,), (mscale, dtype), trig)


def install() -> bool:
    """Make megatron-core's attention call :func:`apply_rotary_pos_emb` (idempotent); returns
    whether it was installed now. The attention module imported the function by name, so the
    name is replaced there; every other caller keeps megatron-core's."""
    global _STOCK
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is apply_rotary_pos_emb:
        return False
    _STOCK = attention.apply_rotary_pos_emb
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True
