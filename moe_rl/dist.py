"""Collectives and process-group helpers: the one place moe-rl calls ``torch.distributed``.

Torch only (no megatron-core). Every function takes an explicit group (``None`` = the
world) and is a no-op, or the identity, when torch.distributed is not initialised or the
group has one member, so the same code runs in a single CPU process and under torchrun.

A collective's tensors live on its group's device (:func:`group_device`: CUDA for NCCL, the
host for gloo); one elsewhere is refused with the tensor's device named, before the backend
sees it (NCCL would fail later, or hang, with less to go on).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


def is_distributed() -> bool:
    """True when torch.distributed is initialised (any world size)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without distributed)."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: Any = None) -> int:
    """Members of ``group`` (1 without distributed)."""
    return dist.get_world_size(group) if is_distributed() else 1


def _active(group: Any) -> bool:
    return is_distributed() and dist.get_world_size(group) > 1


def group_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: this process's CUDA device for NCCL, else
    the host (the CPU without distributed)."""
    if is_distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _on_group_device(t: torch.Tensor, group: Any, what: str) -> None:
    want = group_device(group)
    if t.device.type != want.type:
        raise RuntimeError(
            f"moe_rl.dist.{what}: a {dist.get_backend(group)} collective got a tensor on {t.device}, "
            f"its group reduces tensors on {want.type}: make it on the policy's device "
            "(the rollout batch moves there once, in moe_rl.trainer.run.Run.generate)"
        )


def barrier(group: Any = None) -> None:
    """Wait for every member of ``group``."""
    if _active(group):
        dist.barrier(group=group)


def all_reduce(t: torch.Tensor, group: Any = None, op: Any = ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``group``; returns ``t``."""
    if _active(group):
        _on_group_device(t, group, "all_reduce")
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_cat(t: torch.Tensor, group: Any = None, dim: int = 0) -> torch.Tensor:
    """Every member's ``t`` (same shape on all) concatenated along ``dim`` in rank order."""
    if not _active(group):
        return t
    _on_group_device(t, group, "all_gather_cat")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def any_rank(flag: bool, group: Any = None) -> bool:
    """True when ``flag`` is true on at least one member of ``group``."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group_device(group))
    return bool(all_reduce(t, group, ReduceOp.MAX).item())


def all_ranks(flag: bool, group: Any = None) -> bool:
    """True when ``flag`` is true on every member of ``group``."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group_device(group))
    return bool(all_reduce(t, group, ReduceOp.MIN).item())


def max_over(value: int | float, group: Any = None) -> int | float:
    """The largest ``value`` over the members of ``group``."""
    t = torch.tensor([value], dtype=torch.float64, device=group_device(group))
    out = all_reduce(t, group, ReduceOp.MAX).item()
    return type(value)(out)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` as held by global rank ``src``, on every member of ``group`` (must be picklable)."""
    if not _active(group):
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every member's ``obj`` (picklable), in rank order, on every member of ``group``."""
    if not _active(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every member's ``obj`` (picklable), in rank order, on global rank ``dst``; None elsewhere."""
    if not _active(group):
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def new_group(ranks: Sequence[int], backend: str | None = None) -> Any:
    """A process group over ``ranks`` (every process of the world must call this, in the same order)."""
    return dist.new_group(ranks=list(ranks), backend=backend)


def host_port(host: str, port: int) -> str:
    """``host:port`` with an IPv6 literal bracketed (``[fd00::1]:29500``), as URLs and ``tcp://``
    init methods need it."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` (IPv4 or IPv6; all interfaces for ``""``) right now."""
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
