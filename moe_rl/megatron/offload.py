"""The trainer's device memory given up while colocated SGLang engines generate, and taken back.

verl and slime free the trainer's GPU memory for the rollout engine that shares its GPUs (verl:
parameter, gradient and optimizer offload of its FSDP / megatron workers; slime: the same through
``torch_memory_saver``) and take it back before training. Here a storage is released in place: its
bytes are copied to host memory (pinned on CUDA) and the storage is resized to nothing, so every
tensor and view over it (a parameter, DDP's grad buffer and each ``main_grad`` view into it, the
Adam moments, the distributed optimizer's shards) stays the same Python object and is whole again,
bit for bit, after :meth:`HostOffload.resume`. A storage whose values need not survive (gradients,
cleared after every step) is freed without a copy and comes back zeroed. megatron-core's
``DistributedDataParallel.offload_grad_buffers`` does the same for the grad buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: freed without a copy, zeroed on resume


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Storages released to the host (:meth:`release`) until :meth:`resume`; each storage once."""

    def __init__(self) -> None:
        self._held: list[_Held] = []

    @property
    def released_bytes(self) -> int:
        """Device bytes now released."""
        return sum(h.nbytes for h in self._held)

    def release(self, tensors: Iterable[torch.Tensor], *, keep_values: bool = True) -> int:
        """Free the storages of ``tensors`` (copied to the host first when ``keep_values``); the
        bytes freed. A storage already released, or empty, is skipped."""
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            n = storage.nbytes()
            if n == 0:
                continue
            host = None
            if keep_values:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                host.copy_(_bytes_of(storage))
            storage.resize_(0)
            self._held.append(_Held(storage, n, host))
            freed += n
        if freed and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    def resume(self) -> int:
        """Every released storage back, with its values (or zeros); the bytes taken back."""
        taken = 0
        for h in self._held:
            h.storage.resize_(h.nbytes)
            dst = _bytes_of(h.storage)
            if h.host is None:
                dst.zero_()
            else:
                dst.copy_(h.host, non_blocking=True)
            taken += h.nbytes
        if self._held and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._held.clear()
        return taken
