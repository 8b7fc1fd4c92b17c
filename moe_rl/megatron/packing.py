"""Packed sequences: the rows of a padded ``[B, T]`` batch laid end to end, no padding computed.

Shape legend: B = sequences, T = padded tokens, S = T - 1 model input positions, N = packed
input positions (the sum of the rows' input lengths), P = N padded to a multiple of the TP size
(sequence parallelism splits the pack, not the rows), L = MoE layers, K = top-k.

Row ``b`` of length ``n_b`` (its input positions, ``t < total_len - 1``) contributes input
positions ``0 .. n_b - 1`` at pack offsets ``cu_seqlens[i] .. cu_seqlens[i + 1]``; position ids
restart at 0 for every row (RoPE is applied per segment by megatron-core's ``thd`` path) and
attention is causal within a segment only. The pack is handed to megatron-core as a
``PackedSeqParams(qkv_format="thd")``: on GPU transformer-engine's attention consumes it
(megatron-core turns the causal mask into ``padding_causal`` for ``thd``; written to that contract,
not run here: the development machines have no GPU); on CPU
:class:`moe_rl.megatron.local_layers.SDPAttention` runs causal SDPA per segment.

Everything the model returns per packed position (log-probs, entropy, router rows) is mapped
back to the ``[B, T]`` / ``[B, S, L, K]`` layout by :meth:`PackedRows.scatter_BS`, so losses,
flip metrics and routing replay never see the packing (docs/design.md, "One RL step").
Positions the pack does not cover are 0 there (masked by ``valid_BS`` and the loss mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """Rows of a ``[B, T]`` batch packed into one sequence of ``P`` model input positions."""

    inputs_P: torch.Tensor
    "Input token ids, int64 ``[P]`` (the TP padding positions hold token 0)."
    row_N: torch.Tensor
    "Row of each real packed position, int64 ``[N]``."
    pos_N: torch.Tensor
    "Input position of each real packed position within its row, int64 ``[N]``."
    cu_seqlens: torch.Tensor
    "Segment boundaries, int32 ``[segments + 1]`` (the TP padding, if any, is the last segment)."
    max_seqlen: int
    "Longest segment."
    b: int
    "Rows of the batch the pack came from."
    s: int
    "Input positions per row of that batch (T - 1)."

    @property
    def n(self) -> int:
        """Real (non-padding) packed positions."""
        return self.row_N.shape[0]

    @property
    def p(self) -> int:
        """Packed positions including the TP padding."""
        return self.inputs_P.shape[0]

    def gather_BS(self, x_BS: torch.Tensor) -> torch.Tensor:
        """``x[b, s, ...]`` at every real packed position: ``[B, S, ...]`` -> ``[N, ...]``."""
        return x_BS[self.row_N.to(x_BS.device), self.pos_N.to(x_BS.device)]

    def scatter_BS(self, x_N: torch.Tensor, *, shift: int = 0, width: int | None = None) -> torch.Tensor:
        """``[N, ...]`` -> ``[B, width, ...]`` (``width`` defaults to S) with ``x_N[i]`` at
        ``[row_N[i], pos_N[i] + shift]`` and 0 elsewhere; differentiable."""
        width = self.s if width is None else width
        out = x_N.new_zeros(self.b, width, *x_N.shape[1:])
        return out.index_put((self.row_N.to(x_N.device), self.pos_N.to(x_N.device) + shift), x_N)

    def packed_seq_params(self, device: torch.device | str | None = None):
        """megatron-core's ``PackedSeqParams`` (``thd``) of this pack, boundaries on ``device``
        (transformer-engine's fused attention reads them on the GPU), and on the host as
        ``host_bounds`` (a tuple of ints: what attention that loops over the segments needs, without
        reading the device's copy back)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device) if device is not None else self.cu_seqlens
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )
        params.host_bounds = tuple(int(b) for b in self.cu_seqlens.tolist())
        return params


def pack_rows(tokens_BT: torch.Tensor, lens_B: torch.Tensor, *, multiple: int = 1) -> PackedRows:
    """Pack the first ``lens_B[b]`` input positions of every row of ``tokens_BT[:, :-1]``.

    ``lens_B`` (int) are the rows' input lengths (``total_len - 1``; rows of length 0 are
    skipped); the pack is padded with one extra segment to a multiple of ``multiple``.
    """
    b, t = tokens_BT.shape
    lens = [int(n) for n in lens_B.tolist()]
    if any(n < 0 or n > t - 1 for n in lens):
        raise ValueError(f"pack_rows: input lengths must lie in [0, {t - 1}], got {lens}")
    rows = [r for r in range(b) if lens[r] > 0]
    row_N = torch.cat([torch.full((lens[r],), r, dtype=torch.int64) for r in rows])
    pos_N = torch.cat([torch.arange(lens[r], dtype=torch.int64) for r in rows])
    seg = [lens[r] for r in rows]
    n = sum(seg)
    pad = (-n) % multiple
    if pad:
        seg.append(pad)
    inputs_P = tokens_BT[row_N.to(tokens_BT.device), pos_N.to(tokens_BT.device)]
    if pad:
        inputs_P = torch.cat([inputs_P, inputs_P.new_zeros(pad)])
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seg, dtype=torch.int32), 0)
    return PackedRows(inputs_P, row_N, pos_N, cu.to(tokens_BT.device), max(seg), b, t - 1)


def token_budget_chunks(lens_B: torch.Tensor, budget: int, start: int = 0) -> list[slice]:
    """Consecutive row slices whose input lengths sum to at most ``budget`` (a longer row gets a
    slice alone); offsets from ``start``. Rows stay in order: micro-batches are contiguous."""
    out, first, used = [], 0, 0
    for i, n in enumerate(int(x) for x in lens_B.tolist()):
        if i > first and used + n > budget:
            out.append(slice(start + first, start + i))
            first, used = i, 0
        used += n
    if lens_B.numel():
        out.append(slice(start + first, start + lens_B.numel()))
    return out


def padding_share(lens_B: torch.Tensor, s: int) -> float:
    """Share of a padded ``[B, S]`` forward's positions that are padding (what packing removes)."""
    total = lens_B.numel() * s
    return 1.0 - float(lens_B.sum()) / total if total else 0.0
