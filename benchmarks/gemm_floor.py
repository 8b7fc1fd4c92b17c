"""The step's own matrix products at their own shapes: how fast the GEMM work alone could run.

``benchmarks.throughput_report.step_floor`` prices a step's matmul FLOPs at the host's best
rate, which large square GEMMs reach. RL steps on small models do not run large square GEMMs:
a decode step sends ~``batch * topk / experts`` rows through each expert (8 on the small
preset), training micro-batches ~100. Such GEMMs run far below the peak (weight-bandwidth and
call-overhead bound), whatever framework issues them.

:class:`GemmRecorder` records every matrix-product op one real step dispatches (forward,
backward, decode; the ops of :data:`GEMM_OPS`, with their shapes, strides, dtypes and, for
``_grouped_mm``, the group offsets); :func:`own_gemm_seconds` then runs each distinct call alone
on fresh random inputs of the same layout (and the same integer arguments) and adds up the fastest time of each call. The sum is
what the step's GEMMs cost with nothing else around them: a floor for this implementation's
work at these shapes (the step over it is the share that is not GEMM), and, compared with
``step_floor``, how far these shapes stay from the host's peak.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)
"Ops (aten overload packets) that are matrix products, or attention kernels made of them."


def _sig(x):
    """A hashable description of one argument, enough to rebuild one like it (:func:`_fresh`):
    the layout of a float tensor, the values of any other tensor, containers and plain values."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point:
            return ("t", tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type)
        return ("i", tuple(x.shape), x.dtype, x.device.type, tuple(x.reshape(-1).tolist()))
    if isinstance(x, (list, tuple)):
        return ("l", tuple(_sig(y) for y in x))
    return ("v", x)


def _fresh(sig):
    """An argument as :func:`_sig` described it: float tensors random in that shape and strides
    (on their own storage), other tensors with the recorded values."""
    kind = sig[0]
    if kind == "t":
        _, shape, stride, dtype, device = sig
        n = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
        return torch.randn(n, dtype=dtype, device=device).as_strided(shape, stride)
    if kind == "i":
        _, shape, dtype, device, values = sig
        return torch.tensor(values, dtype=dtype, device=device).reshape(shape)
    if kind == "l":
        return [_fresh(y) for y in sig[1]]
    return sig[1]


class GemmRecorder(TorchDispatchMode):
    """Counts the :data:`GEMM_OPS` calls dispatched inside it by (op, argument signature); holds
    no tensor."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()  # (op, args signature, kwargs signature) -> calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in GEMM_OPS:
            self.calls[(func, _sig(list(args)), tuple((k, _sig(v)) for k, v in sorted(kwargs.items())))] += 1
        return func(*args, **kwargs)


def own_gemm_seconds(rec: GemmRecorder, reps: int = 3, flush_mib: int = 0) -> dict:
    """Every distinct recorded call run alone ``reps`` times on fresh inputs (after one warm-up):
    the sum over calls of the fastest CPU time (``time.process_time``: the process's own
    seconds), in total and per op."""
    total, by_op = 0.0, Counter()
    scratch = torch.zeros(flush_mib * 2**18) if flush_mib else None
    with torch.no_grad():
        for (func, args_sig, kwargs_sig), count in rec.calls.items():
            args, kwargs = _fresh(args_sig), {k: _fresh(v) for k, v in kwargs_sig}
            func(*args, **kwargs)
            best = float("inf")
            for _ in range(reps):
                if scratch is not None:
                    scratch.add_(1.0)  # evict the inputs from the caches this size covers
                t = time.process_time()
                func(*args, **kwargs)
                best = min(best, time.process_time() - t)
            total += count * best
            by_op[func.overloadpacket.__name__] += count * best
    return {
        "gemm_cpu_s": total,
        "by_op": dict(by_op),
        "calls": sum(rec.calls.values()),
        "distinct_calls": len(rec.calls),
    }
