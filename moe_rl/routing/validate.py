"""Checks on routed experts that come from outside the trainer (R3: the rollout engine's routes).

Shape legend: B = sequences, T = padded tokens per sequence, S = T - 1 model input positions,
L = MoE layers, K = experts per token (top-k), E = experts.

Routes arrive as ``Rollouts.routes_BTLK`` (moe_rl/rollout/types.py): stored uint8 / int16,
[B, T, L, K], row t holding the experts chosen when token t is the model's input, valid for
t < total_len[b] - 1 (prompt + response - 1 rows per sequence, what SGLang returns) and 0
elsewhere. The trainer slices them to the S = T - 1 input positions and decodes them to int64
[B, S, L, K] (``decode_routes(routes_BTLK[:, :S])`` in moe_rl/trainer/rl.py) before replay.
Both forms are accepted here: any dtype, second dimension S or T (rows past total_len - 1 are
padding either way).

A bad valid row is an error, never repaired: megatron-core's dispatcher needs K distinct
experts in [0, E) per row, and a silently "fixed" row would train on routes no engine chose.
Padding rows are not checked; :func:`sanitize_padding` gives them K distinct experts so that
the dispatcher accepts them (their positions carry no loss: the loss mask is 0 there).
"""

from __future__ import annotations

import torch


class RouteError(ValueError):
    """Routes that do not fit the model: the message names the engine, the sequence, the first
    bad row and what is wrong."""


def valid_rows_BS(total_lens_B: torch.Tensor, rows: int) -> torch.Tensor:
    """bool [B, rows]: True where row t < total_len[b] - 1 (a position the model reads)."""
    t = torch.arange(rows, device=total_lens_B.device)
    return t[None, :] < (total_lens_B.to(torch.int64)[:, None] - 1)


def _check_shape(routes: torch.Tensor, total_lens_B: torch.Tensor, num_layers: int, topk: int, engine: str):
    if routes.dim() != 4:
        raise RouteError(
            f"{engine} routes: expected [B, S, L, K] (or [B, T, L, K]) expert indices, got shape "
            f"{tuple(routes.shape)}"
        )
    b, rows, layers, k = routes.shape
    if tuple(total_lens_B.shape) != (b,):
        raise RouteError(
            f"{engine} routes: {b} sequences but total_lens has shape {tuple(total_lens_B.shape)}"
        )
    if layers != num_layers:
        raise RouteError(
            f"{engine} routes: {layers} MoE layers per row, the model has {num_layers}: the engine serves a "
            "different model"
        )
    if k != topk:
        raise RouteError(f"{engine} routes: {k} experts per row, the model routes top-{topk}")
    need = total_lens_B.to(torch.int64) - 1
    short = (need > rows).nonzero().flatten()
    if short.numel():
        i = int(short[0])
        raise RouteError(
            f"{engine} routes: sequence {i} needs {int(need[i])} rows (prompt + response - 1 = "
            f"{int(total_lens_B[i])} - 1), the routes hold {rows}"
        )


def validate_routes(
    routes_BSLK: torch.Tensor,
    total_lens_B: torch.Tensor,
    *,
    num_layers: int,
    topk: int,
    num_experts: int,
    engine: str,
) -> torch.Tensor:
    """Check R3 routes against the model and return them untouched; raise :class:`RouteError`.

    routes_BSLK: [B, S, L, K] or [B, T, L, K] expert indices (any integer dtype, module docstring);
    total_lens_B: prompt + response length per sequence. Checks, on the valid rows
    t < total_len - 1 only: the shape (L layers, K slots, enough rows), every index in
    [0, num_experts), and K distinct experts per row. ``engine`` names the source in messages.
    """
    _check_shape(routes_BSLK, total_lens_B, num_layers, topk, engine)
    b, rows = routes_BSLK.shape[:2]
    valid_BS = valid_rows_BS(total_lens_B, rows)
    r = routes_BSLK.to(torch.int64)
    out_of_range_BSL = ((r < 0) | (r >= num_experts)).any(-1)
    s = r.sort(dim=-1).values
    repeated_BSL = (s[..., 1:] == s[..., :-1]).any(-1)
    for bad_BSL, what in ((out_of_range_BSL, "outside"), (repeated_BSL, "repeated")):
        bad_BS = bad_BSL.any(-1) & valid_BS
        if bool(bad_BS.any()):
            i, t = (int(x) for x in bad_BS.nonzero()[0])
            layer = int(bad_BSL[i, t].nonzero()[0])
            experts = r[i, t, layer].tolist()
            problem = (
                f"expert index outside [0, {num_experts})"
                if what == "outside"
                else f"a repeated expert (top-{topk} needs {topk} distinct experts)"
            )
            raise RouteError(
                f"{engine} routes: sequence {i}, row {t} (of {int(total_lens_B[i]) - 1} valid), layer {layer}: "
                f"experts {experts} contain {problem}"
            )
    return routes_BSLK


def sanitize_padding(routes_BSLK: torch.Tensor, total_lens_B: torch.Tensor) -> torch.Tensor:
    """Routes with every padding row (t >= total_len - 1) set to experts 0..K-1; valid rows untouched.

    Position-based, unlike a repair of whatever row looks bad: a bad *valid* row is left for
    :func:`validate_routes` to report. Returns a new tensor when a padding row changes.
    routes_BSLK: [B, S, L, K] or [B, T, L, K]; total_lens_B: [B].
    """
    k = routes_BSLK.shape[-1]
    pad_BS = ~valid_rows_BS(total_lens_B.to(routes_BSLK.device), routes_BSLK.shape[1])
    if not bool(pad_BS.any()):
        return routes_BSLK
    fill = torch.arange(k, dtype=routes_BSLK.dtype, device=routes_BSLK.device)
    return torch.where(pad_BS[:, :, None, None], fill, routes_BSLK)
