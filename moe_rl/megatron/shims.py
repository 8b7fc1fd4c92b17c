"""The CPU shims megatron-core needs when CUDA is absent (docs/megatron_cpu.md#cuda-shims).

megatron-core hard-codes CUDA in a handful of places. Each shim below replaces exactly
one of them, is applied only when ``torch.cuda.is_available()`` is false, and names the
megatron-core versions it was seen in. ``apply_cpu_shims()`` is idempotent; it returns
the names of the shims it applied so tests can check each one is needed and enough.

The sequence-parallel norm is not a shim: the policy builder uses its own norm class
(:class:`moe_rl.megatron.model.RMSNorm`) that tags parameters instead of refusing SP.
megatron-core's optimizer (``get_megatron_optimizer`` and its gradient clipping) is the one
place that needs more than a patched function: it makes tensors on ``device="cuda"`` and checks
``param.type() == "torch.cuda.FloatTensor"`` in many places, so moe-rl runs each call into it
inside :func:`cuda_as_cpu` (the ``cuda_as_cpu`` shim; see docs/megatron_cpu.md).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_APPLIED: list[str] = []


class _CpuStream:
    """Stands in for torch.cuda.Stream / Event on CPU: every operation is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _CpuStream()

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


_CURRENT = _CpuStream()


def _shim_current_device() -> None:
    # torch.cuda.current_device() is used as a tensor device in attention buffers, the RoPE
    # inv_freq, router gating and tensor-parallel mappings (megatron-core 0.16.1, 0.19.2).
    torch.cuda.current_device = lambda: torch.device("cpu")


def _shim_streams() -> None:
    # The alltoall token dispatcher creates torch.cuda.Stream() and waits on the current
    # stream (megatron-core 0.16.1, 0.19.2).
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CURRENT
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _shim_synchronize() -> None:
    # dist_checkpointing's FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize()
    # after its host copies, also for CPU tensors (megatron-core 0.16.1; not listed in
    # docs/megatron_cpu.md, found by the checkpoint round-trip test). CPU copies are synchronous.
    torch.cuda.synchronize = lambda device=None: None


def _shim_te_general_gemm() -> None:
    # 0.16.1: moe_utils imports te_general_gemm inside a try block whose except branch does
    # not define it, so router gating raises NameError without transformer-engine (fixed in 0.19).
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _shim_alltoall_splits() -> None:
    # The alltoall dispatcher moves its split sizes to the host only when they are CUDA
    # tensors; on CPU they stay tensors and all_to_all_single rejects them
    # (megatron-core 0.16.1, 0.19.2). Convert CPU tensors to numpy as the CUDA path does.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _shim_causal_mask() -> None:
    # get_default_causal_mask builds its mask on device="cuda" when attention_mask is None,
    # as in inference (megatron-core 0.16.1, 0.19.2). Only megatron's DotProductAttention
    # (the stock local spec, build_gpt(stock_local=True)) calls it; SDPAttention does not.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _shim_rng() -> None:
    # Activation recompute and the model-parallel RNG tracker save and restore the CUDA RNG
    # state (megatron-core 0.16.1, 0.19.2). On CPU the CPU generator is the one in use.
    from megatron.core.tensor_parallel import random as mrandom

    def _get(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def _set(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get
    mrandom._set_cuda_rng_state = _set
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by the caller


class _CudaAsCpu(TorchFunctionMode):
    """Inside megatron-core's optimizer on CPU: ``device="cuda"`` means the current device (the
    ``current_device`` shim's: the CPU), ``.cuda()`` is a no-op and ``Tensor.type()`` names CPU
    tensors as their CUDA type (``torch.cuda.FloatTensor``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            here = torch.cuda.current_device() if "current_device" in _APPLIED else "cpu"
            kwargs = {**kwargs, "device": here}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and not args[0].is_cuda:
            return "torch.cuda." + func(*args).split(".", 1)[1]
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _shim_cuda_as_cpu() -> None:
    # megatron-core's optimizer: MixedPrecisionOptimizer / FP32Optimizer make found_inf and scale
    # tensors on device="cuda", clip_grads makes its norm buffers there, and the distributed and
    # fp16 optimizers accept parameters only when param.type() is a torch.cuda type
    # (megatron-core 0.16.1). Registering the shim enables cuda_as_cpu(); nothing is patched.
    pass


def _shim_distopt_adam_step() -> None:
    # Without transformer-engine or apex (always so on CPU) megatron-core's optimizer is torch's
    # Adam, whose per-parameter state holds a "step". DistributedOptimizer.load_state_dict puts one
    # shared step tensor there and then copies every state key from the loaded tensors, which have
    # no "step": KeyError 'step' (megatron-core 0.16.1). Copy only the loaded keys; Optimizer.
    # load_state_dict then gives every parameter its own step tensor.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = getattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", None)
    if original is None:  # another megatron-core layout: tests/dist/test_shims.py says if still needed
        log.warning("distopt_adam_step: DistributedOptimizer._set_main_param_and_optimizer_states is gone")
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def cuda_as_cpu():
    """Context for every call into megatron-core's optimizer: :class:`_CudaAsCpu` once the
    ``cuda_as_cpu`` shim is applied (CPU), else a no-op (CUDA)."""
    return _CudaAsCpu() if "cuda_as_cpu" in _APPLIED else contextlib.nullcontext()


SHIMS = {
    "current_device": _shim_current_device,
    "streams": _shim_streams,
    "synchronize": _shim_synchronize,
    "te_general_gemm": _shim_te_general_gemm,
    "alltoall_splits": _shim_alltoall_splits,
    "causal_mask": _shim_causal_mask,
    "rng": _shim_rng,
    "cuda_as_cpu": _shim_cuda_as_cpu,
    "distopt_adam_step": _shim_distopt_adam_step,
}


def apply_cpu_shims(only: tuple[str, ...] | None = None) -> list[str]:
    """Apply the shims (all, or the named ones) when CUDA is absent; return those applied."""
    if torch.cuda.is_available():
        return []
    for name, fn in SHIMS.items():
        if (only is None or name in only) and name not in _APPLIED:
            fn()
            _APPLIED.append(name)
            log.debug("applied megatron-core CPU shim %s", name)
    return list(_APPLIED)
