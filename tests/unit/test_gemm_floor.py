"""benchmarks/gemm_floor.py: which calls it records, and that it rebuilds them as they were."""

from __future__ import annotations

import torch

from benchmarks.gemm_floor import GemmRecorder, _fresh, _sig, own_gemm_seconds


def test_records_matrix_products_by_layout_and_ignores_the_rest():
    a, w = torch.randn(8, 16), torch.randn(32, 16)
    with GemmRecorder() as rec:
        for _ in range(3):
            a @ w.t()  # a transposed (strided) operand: one distinct call, three times
        torch.relu(a)
        torch.bmm(torch.randn(2, 4, 5), torch.randn(2, 5, 3))
        x = torch.randn(6, 16, requires_grad=True)
        (x @ w.t()).sum().backward()  # the backward's products are recorded too
    names = sorted(str(k[0]) for k in rec.calls)
    assert not any("relu" in n for n in names)
    assert sum(rec.calls.values()) == 3 + 1 + 1 + 1  # mm x3, bmm, forward mm, backward mm
    assert max(rec.calls.values()) == 3 and len(rec.calls) == 4
    out = own_gemm_seconds(rec, reps=2)
    assert out["calls"] == 6 and out["distinct_calls"] == 4
    assert out["gemm_cpu_s"] > 0 and set(out["by_op"]) == {"mm", "bmm"}
    assert sum(out["by_op"].values()) == out["gemm_cpu_s"]


def test_fresh_arguments_keep_shapes_strides_and_integer_values():
    t = torch.randn(4, 6).t()[1:]  # non-contiguous, offset view
    offs = torch.tensor([1, 4], dtype=torch.int32)
    f = _fresh(_sig([t, offs, 2, (3, 4)]))
    assert f[0].shape == t.shape and f[0].stride() == t.stride() and f[0].dtype == t.dtype
    assert torch.equal(f[1], offs) and f[2] == 2 and f[3] == [3, 4]
    assert _sig(f[0]) == _sig(t)
