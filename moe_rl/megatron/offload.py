"""The trainer's device memory given up while colocated SGLang engines generate, and taken back.

verl and slime free the trainer's GPU memory for the rollout engine that shares its GPUs (verl:
parameter, gradient and optimizer offload of its FSDP / megatron workers; slime: the same through
``torch_memory_saver``) and take it back before training. Here a storage is released in place: its
bytes are copied to host memory and the storage is resized to nothing, so every tensor and view
over it (a parameter, DDP's grad buffer and each ``main_grad`` view into it, the Adam moments, the
distributed optimizer's shards) stays the same Python object and is whole again, bit for bit,
after :meth:`HostOffload.resume`. A storage whose values need not survive (gradients, cleared
after every step) is freed without a copy and comes back zeroed. megatron-core's
``DistributedDataParallel.offload_grad_buffers`` does the same for the grad buffers.

The host copies live in one arena per :class:`HostOffload` (one per rank), pinned when the
storages are on a GPU, allocated when a release needs more than it holds and reused by every
later offload: torch's caching host allocator keeps every pinned block it ever made, so a fresh
buffer per storage per offload would grow host memory by the whole state at every step (about
0.5 TB a node of 8 GPUs at Qwen3-30B-A3B). The device-to-host copies of one release run
asynchronously into the pinned arena and are waited for once, before any storage is freed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

ALIGN = 512
"Byte alignment of each storage's slice of the arena (DMA-friendly)."


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int | None  # where its bytes wait in the arena; None: freed without a copy, zeroed on resume


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(storages: Iterable[torch.UntypedStorage]) -> None:
    if any(s.device.type == "cuda" for s in storages):
        torch.cuda.synchronize()


class HostOffload:
    """Storages released to the host (:meth:`release`) until :meth:`resume`; each storage once."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._arena: torch.Tensor | None = None
        self._used = 0

    @property
    def released_bytes(self) -> int:
        """Device bytes now released."""
        return sum(h.nbytes for h in self._held)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena (held from its first use to the end of the process)."""
        return 0 if self._arena is None else self._arena.numel()

    def _reserve(self, nbytes: int, pinned: bool) -> None:
        """An arena of at least ``self._used + nbytes`` bytes (pinned if asked), the bytes already
        in it kept."""
        need = self._used + nbytes
        arena = self._arena
        if arena is not None and arena.numel() >= need and (arena.is_pinned() or not pinned):
            return
        grown = torch.empty(need, dtype=torch.uint8, pin_memory=pinned)
        if arena is not None and self._used:
            grown[: self._used].copy_(arena[: self._used])
        self._arena = grown

    def release(self, tensors: Iterable[torch.Tensor], *, keep_values: bool = True) -> int:
        """Free the storages of ``tensors`` (copied to the host arena first when ``keep_values``);
        the bytes freed. A storage already released, or empty, is skipped."""
        new: list[_Held] = []
        seen: set[int] = set()
        for t in tensors:
            storage = t.untyped_storage()
            n = storage.nbytes()
            if n == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            new.append(_Held(storage, n, None))
        if keep_values and new:
            padded = [-(-h.nbytes // ALIGN) * ALIGN for h in new]
            self._reserve(sum(padded), pinned=any(h.storage.device.type == "cuda" for h in new))
            for h, size in zip(new, padded):
                h.offset, self._used = self._used, self._used + size
                self._arena[h.offset : h.offset + h.nbytes].copy_(_bytes_of(h.storage), non_blocking=True)
            _synchronize(h.storage for h in new)  # every copy landed before a byte is freed
        for h in new:
            h.storage.resize_(0)
        self._held.extend(new)
        freed = sum(h.nbytes for h in new)
        if freed and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    def resume(self) -> int:
        """Every released storage back, with its values (or zeros); the bytes taken back."""
        taken = 0
        for h in self._held:
            h.storage.resize_(h.nbytes)
            dst = _bytes_of(h.storage)
            if h.offset is None:
                dst.zero_()
            else:
                dst.copy_(self._arena[h.offset : h.offset + h.nbytes], non_blocking=True)
            taken += h.nbytes
        _synchronize(h.storage for h in self._held)
        self._held.clear()
        self._used = 0
        return taken
