"""Compact storage of routed experts, and SGLang's wire format for them.

Shape legend: N = tokens, L = MoE layers, K = experts per token.

Routes are stored as uint8 when there are at most 256 experts, else int16: L x K bytes
(or 2 L x K) per token. SGLang's ``return_routed_experts`` sends a base64 string of
little-endian int32 ``[prompt_len + completion_len - 1, L, K]`` per request.
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def route_dtype(num_experts: int) -> torch.dtype:
    """uint8 for at most 256 experts, int16 up to 32768."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 route storage")


def encode_routes(routes_NLK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Store expert indices in the smallest dtype that holds ``num_experts``; checks the range."""
    if routes_NLK.numel() and (int(routes_NLK.min()) < 0 or int(routes_NLK.max()) >= num_experts):
        raise ValueError(
            f"route indices outside [0, {num_experts}): "
            f"min {int(routes_NLK.min())}, max {int(routes_NLK.max())}"
        )
    return routes_NLK.to(route_dtype(num_experts))


def decode_routes(stored: torch.Tensor) -> torch.Tensor:
    """Back to int64 indices (what megatron-core's router replay takes)."""
    return stored.to(torch.int64)


def route_bytes_per_token(num_layers: int, topk: int, num_experts: int) -> int:
    """Storage cost of one token's routes: L x K x itemsize (Qwen3-30B-A3B: 48 x 8 x 1 = 384)."""
    return num_layers * topk * torch.empty((), dtype=route_dtype(num_experts)).element_size()


def decode_sglang_routes(payload: str, num_layers: int, topk: int) -> torch.Tensor:
    """Decode SGLang's base64 int32 routed experts to int64 ``[N, L, K]``.

    N is prompt + completion - 1 tokens. Raises ValueError naming the mismatch when the
    payload does not hold whole [L, K] rows.
    """
    raw = base64.b64decode(payload, validate=True)
    per_row = num_layers * topk * 4
    if len(raw) % per_row:
        raise ValueError(
            f"routed_experts payload of {len(raw)} bytes is not a whole number of "
            f"[{num_layers} layers x {topk} topk] int32 rows: the server's model has a "
            "different number of MoE layers or top-k than the trainer's"
        )
    arr = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, topk)
    return torch.from_numpy(arr.astype(np.int64))


def encode_sglang_routes(routes_NLK: torch.Tensor) -> str:
    """Encode ``[N, L, K]`` routes the way SGLang sends them (base64 of little-endian int32)."""
    arr = routes_NLK.detach().cpu().to(torch.int32).numpy().astype("<i4", copy=False)
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")
