import torch

from moe_rl.routing.codec import (
    decode_routes,
    decode_sglang_routes,
    encode_routes,
    encode_sglang_routes,
    route_bytes_per_token,
    route_dtype,
)
from moe_rl.routing.flip import flip_counts, flip_metrics, flip_rate


def test_hand_built_flip_rates():
    # 3 tokens, 2 layers, K = 2
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 7], [1, 2]]])
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [0, 1]], [[7, 0], [1, 2]]])
    m = flip_rate(a, b)
    # layer 0 flips: 0, 0, 0 ; layer 1 flips: 1/2, 1, 0
    assert m["flip/layer_0"] == 0.0
    assert abs(m["flip/layer_1"] - 0.5) < 1e-7
    assert abs(m["flip/rate"] - 0.25) < 1e-7
    assert abs(m["flip/token_any"] - 2 / 3) < 1e-7
    # routers (token, layer) whose set changed: layer 1 of tokens 0 and 1, 2 of 6 (per slot: 1.5 / 6)
    assert abs(m["flip/router_rate"] - 2 / 6) < 1e-7


def test_mask_and_order_invariance_and_additivity():
    g = torch.Generator().manual_seed(0)
    a = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40 * 3)]).view(40, 3, 2)
    b = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40 * 3)]).view(40, 3, 2)
    mask = (torch.rand(40, generator=g) < 0.7).float()
    full = flip_rate(a, b, mask)
    assert flip_rate(a.flip(-1), b, mask) == full  # sets, not sequences
    assert flip_rate(a[mask.bool()], b[mask.bool()]) == full  # masked rows do not count
    parts = [flip_counts(a[:15], b[:15], mask[:15]), flip_counts(a[15:], b[15:], mask[15:])]
    summed = {k: parts[0][k] + parts[1][k] for k in parts[0]}
    assert flip_metrics(summed) == full
    assert flip_rate(a, a, mask)["flip/rate"] == 0.0


def test_route_storage_and_sglang_codec():
    assert route_dtype(8) == torch.uint8 and route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16
    assert route_bytes_per_token(48, 8, 128) == 384  # Qwen3-30B-A3B
    assert route_bytes_per_token(4, 2, 512) == 16
    r = torch.randint(0, 300, (7, 4, 2))
    assert torch.equal(decode_routes(encode_routes(r, 300)), r)
    assert encode_routes(r, 300).dtype == torch.int16
    assert torch.equal(decode_sglang_routes(encode_sglang_routes(r), 4, 2), r)
    import pytest

    with pytest.raises(ValueError, match="outside"):
        encode_routes(r, 256)
    with pytest.raises(ValueError, match="different number of MoE layers"):
        decode_sglang_routes(encode_sglang_routes(r), 3, 2)
