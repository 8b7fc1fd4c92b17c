"""Triton kernels, each with its PyTorch reference beside it (importable as ``moe_rl.kernels``).

- ``logprob_reference``: log-probs / entropy from (vocab-parallel) logits, analytic backward.
- ``hidden_logprob_reference``: the same from hidden states and the output weight, chunked
  over vocab in plain torch (memory-light, CPU).
- ``fused_logprob``: the Triton kernels for it (imports triton; CUDA, or CPU tensors when
  ``TRITON_INTERPRET=1`` was set before triton was imported: tests).

``logprobs_from_hidden(..., impl="auto")`` picks the kernel on CUDA when triton is
importable and one of its tiles fits the GPU's shared memory in the inputs' dtype, and the
reference elsewhere. Importing this package needs only torch.
"""

from __future__ import annotations

import importlib.util

import torch

from moe_rl.kernels.hidden_logprob_reference import hidden_logprobs_entropy

LOGPROB_IMPLS = ("auto", "triton", "torch")
"Valid ``impl`` values of logprobs_from_hidden."


def triton_available() -> bool:
    """True when the triton package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolve_logprob_impl(impl: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``triton`` or ``torch`` for ``impl`` on ``device``; an unknown name lists the valid ones.

    ``auto`` is the Triton kernel on CUDA when triton is importable and, given the inputs'
    ``dtype``, one of its tiles fits the GPU's shared memory; else the torch reference."""
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"unknown log-prob impl {impl!r}; valid: {', '.join(LOGPROB_IMPLS)}")
    if impl == "auto":
        if device.type != "cuda" or not triton_available():
            return "torch"
        if dtype is None:
            return "triton"
        from moe_rl.kernels.fused_logprob import device_tile  # logs one line when no tile fits

        return "triton" if device_tile(device, dtype) is not None else "torch"
    if impl == "triton" and not triton_available():
        raise ValueError("impl='triton' needs the triton package (pip install moe-rl[gpu]); use impl='torch'")
    return impl


def logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    group=None,
    vocab_start: int = 0,
    with_entropy: bool = False,
    impl: str = "auto",
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (logp_N, entropy_N) of ``target_N`` from hidden_NH [N, H] and weight_VH [V, H].

    Semantics of ``logprob_reference.logprobs_entropy(hidden_NH @ weight_VH.T, ...)`` without
    materialising the logits. ``impl``: auto (the Triton kernel on CUDA when triton is
    importable, the chunked torch reference elsewhere) | triton (forced: on CPU it needs
    ``TRITON_INTERPRET=1`` set before triton is imported, and is slow; tests) | torch. Under TP the gradient of hidden_NH is this shard's
    contribution, to be all-reduced by the caller.
    """
    kw = dict(
        temperature=temperature,
        group=group,
        vocab_start=vocab_start,
        with_entropy=with_entropy,
        vocab_chunk=vocab_chunk,
    )
    if resolve_logprob_impl(impl, hidden_NH.device, hidden_NH.dtype) == "triton":
        from moe_rl.kernels.fused_logprob import fused_logprobs

        return fused_logprobs(hidden_NH, weight_VH, target_N, **kw)
    return hidden_logprobs_entropy(hidden_NH, weight_VH, target_N, **kw)


__all__ = [
    "LOGPROB_IMPLS",
    "hidden_logprobs_entropy",
    "logprobs_from_hidden",
    "resolve_logprob_impl",
    "triton_available",
]
