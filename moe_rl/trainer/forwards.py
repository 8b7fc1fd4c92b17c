"""The trainer's forwards of a batch's rows, shared by the RL step and its probes: micro-batches,
packing, the policy's natural routes, and flip counts reduced over data-parallel ranks.

Shape legend: B = sequences of this data-parallel rank, S = model input positions, L = MoE
layers, K = top-k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.megatron.packing import PackedRows, token_budget_chunks
from moe_rl.megatron.routing import RoutingSession
from moe_rl.routing import RouterAction
from moe_rl.routing.flip import flip_counts, flip_metrics

if TYPE_CHECKING:
    from moe_rl.trainer.context import Run


def natural_routes(run: Run, tokens_BT: torch.Tensor, lens_B: torch.Tensor | None = None) -> torch.Tensor:
    """The policy's own top-k experts ``[B, S, L, K]`` for ``tokens_BT`` (no gradients), forwards
    ended at the last router; with ``lens_B`` (and ``train.packing``) only those positions."""
    b, s = tokens_BT.shape[0], tokens_BT.shape[1] - 1
    lens_B = torch.full((b,), s, dtype=torch.int64) if lens_B is None else lens_B
    out = []
    for rows in micro_batches(run, lens_B, 0, b):
        pack = packed(run, tokens_BT[rows], lens_B[rows])
        session = RoutingSession(
            run.policy, RouterAction.NATURAL, pack=pack, stop_after_routes=True, noise=run.route_noise
        )
        with torch.no_grad(), session:
            run.policy.logits(tokens_BT[rows, :-1], pack=pack)
        out.append(session.natural_BSLK(rows.stop - rows.start, s))
    return torch.cat(out)


def probe_rows(run: Run, b: int) -> int:
    """Rows of the flip probe: the first ``train.flip_probe_sequences`` of the batch."""
    return min(run.recipe.train.flip_probe_sequences, b)


def micro_batches(run: Run, lens_B: torch.Tensor, start: int, stop: int) -> list[slice]:
    """Row slices of ``[start, stop)``, one per forward: ``train.micro_batch_size`` rows, or with
    packing and ``train.pack_tokens``, at most that many input tokens (``lens_B``) each."""
    cfg = run.recipe.train
    if cfg.packing and cfg.pack_tokens:
        return token_budget_chunks(lens_B[start:stop], cfg.pack_tokens, start)
    return [slice(start + c.start, start + c.stop) for c in chunks(stop - start, cfg.micro_batch_size)]


def packed(run: Run, tokens_BT: torch.Tensor, lens_B: torch.Tensor) -> PackedRows | None:
    """These rows packed for the policy (``train.packing``), or None: the padded forward."""
    return run.policy.pack(tokens_BT, lens_B) if run.recipe.train.packing else None


def chunks(n: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` (all rows when size is 0; none of no rows)."""
    size = size or max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# -- flip counting -----------------------------------------------------------------------------------
def route_flips(a_BSLK: torch.Tensor, b_BSLK: torch.Tensor, valid_BS: torch.Tensor) -> dict:
    """Additive flip counts between two route sets of the same tokens (``flip_counts``)."""
    n = a_BSLK.shape[0] * a_BSLK.shape[1]
    return flip_counts(
        a_BSLK.reshape(n, *a_BSLK.shape[2:]), b_BSLK.reshape(n, *b_BSLK.shape[2:]), valid_BS.reshape(n)
    )


def flip_rates(run: Run, counts: dict[str, list[dict]]) -> dict[str, float]:
    """Flip counts (metric prefix -> pieces) summed over pieces and data-parallel ranks, as rates."""
    out = {}
    for prefix, pieces in counts.items():
        total = {k: sum(c[k] for c in pieces).float().clone() for k in pieces[0]}
        for v in total.values():
            dist.all_reduce(v, run.info.dp_group)
        out.update(flip_metrics(total, prefix))
    return out
