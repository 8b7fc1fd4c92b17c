"""R3 route validation: every violation, its message, padding rows, valid routes untouched.

Shape legend: B = sequences, S = model input positions, T = S + 1 padded tokens, L = MoE layers,
K = top-k, E = experts.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.routing.codec import decode_routes, encode_routes
from moe_rl.routing.validate import RouteError, sanitize_padding, valid_rows_BS, validate_routes

L, K, E = 3, 2, 8
TOTAL = torch.tensor([6, 4, 1])  # valid rows: 5, 3, 0


def good_routes(rows: int = 5) -> torch.Tensor:
    """[B, rows, L, K] distinct in-range experts on valid rows, zeros on padding (as engines send)."""
    g = torch.Generator().manual_seed(0)
    r = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(3 * rows * L)]).reshape(3, rows, L, K)
    return torch.where(valid_rows_BS(TOTAL, rows)[:, :, None, None], r, 0)


def check(routes, engine="sglang", total=TOTAL):
    return validate_routes(routes, total, num_layers=L, topk=K, num_experts=E, engine=engine)


@pytest.mark.parametrize("rows", [5, 6])  # [B, S, L, K] as the trainer holds them, or raw [B, T, L, K]
def test_valid_routes_pass_untouched(rows):
    r = good_routes(rows)
    before = r.clone()
    assert check(r) is r and torch.equal(r, before)
    stored = encode_routes(r, E)  # uint8 storage, as Rollouts.routes_BTLK holds them
    assert stored.dtype == torch.uint8 and check(stored) is stored
    assert check(decode_routes(stored)).dtype == torch.int64


def test_padding_rows_are_not_checked():
    r = good_routes()
    assert bool((r[1, 3:] == 0).all()) and bool((r[2] == 0).all())  # zero padding: repeated expert 0
    r[1, 4, 0] = torch.tensor([99, 99])
    check(r)


def test_out_of_range_expert_names_engine_sequence_row_layer():
    r = good_routes()
    r[1, 2, 1] = torch.tensor([3, E])
    r[0, 4, 2] = torch.tensor([E + 5, 1])  # a later bad row in sequence 0: sequence order wins
    with pytest.raises(RouteError, match=r"^sglang routes: sequence 0, row 4 \(of 5 valid\), layer 2: "):
        check(r)
    r[0, 4, 2] = torch.tensor([5, 1])
    with pytest.raises(RouteError) as e:
        check(r, engine="embedded")
    assert str(e.value) == (
        "embedded routes: sequence 1, row 2 (of 3 valid), layer 1: experts [3, 8] contain "
        "expert index outside [0, 8)"
    )
    assert isinstance(e.value, ValueError)


def test_negative_expert():
    r = good_routes().to(torch.int16)
    r[0, 0, 0, 1] = -1
    with pytest.raises(RouteError, match=r"sequence 0, row 0 .* layer 0: experts \[\d, -1\] .*outside"):
        check(r)


def test_repeated_expert():
    r = good_routes()
    r[0, 1, 2] = torch.tensor([6, 6])
    with pytest.raises(RouteError) as e:
        check(r)
    assert str(e.value) == (
        "sglang routes: sequence 0, row 1 (of 5 valid), layer 2: experts [6, 6] contain a repeated expert "
        "(top-2 needs 2 distinct experts)"
    )


def test_shape_violations():
    r = good_routes()
    with pytest.raises(RouteError, match="sglang routes: 2 MoE layers per row, the model has 3"):
        check(r[:, :, :2])
    with pytest.raises(RouteError, match="sglang routes: 1 experts per row, the model routes top-2"):
        check(r[..., :1])
    with pytest.raises(RouteError, match=r"expected \[B, S, L, K\]"):
        check(r[0])
    with pytest.raises(RouteError, match="3 sequences but total_lens has shape"):
        check(r, total=TOTAL[:2])
    with pytest.raises(
        RouteError, match=r"sequence 0 needs 5 rows \(prompt \+ response - 1 = 6 - 1\), the routes hold 4"
    ):
        check(r[:, :4])


def test_sanitize_padding():
    r = good_routes(6)
    out = sanitize_padding(r, TOTAL)
    valid = valid_rows_BS(TOTAL, 6)
    assert torch.equal(out[valid], r[valid])
    assert (out[~valid] == torch.arange(K)).all() and out.dtype == r.dtype
    check(out)  # still valid, and now every row has K distinct experts
    s = out.sort(-1).values
    assert (s[..., 1:] != s[..., :-1]).all()
    # a bad valid row is not repaired, so validation still reports it
    r[0, 0, 0] = torch.tensor([2, 2])
    assert sanitize_padding(r, TOTAL)[0, 0, 0].tolist() == [2, 2]
    full = torch.tensor([7, 7, 7])  # 6 valid rows each: no padding
    no_pad = good_routes(6)
    assert sanitize_padding(no_pad, full) is no_pad
