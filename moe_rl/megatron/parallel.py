"""Process groups: torch.distributed + megatron-core model parallel state.

Works under ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR in the environment), under
``mp.spawn`` (the caller passes rank/world/init_method) and in a plain single process
(a world of one on a free local port). gloo without CUDA, NCCL with it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.config import ConfigError, ParallelConfig
from moe_rl.dist import free_port
from moe_rl.megatron.shims import apply_cpu_shims


@dataclass(frozen=True)
class ParallelInfo:
    """Ranks and groups of this process; groups are None in a world of one."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    dp_rank: int
    dp_size: int
    tp_group: object
    ep_group: object
    dp_group: object
    expert_dp_group: object
    mp_group: object
    device: torch.device


def backend_for(cfg: ParallelConfig) -> str:
    """gloo without CUDA, nccl with it, unless the config names one."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_world(cfg: ParallelConfig, world_size: int) -> None:
    """Fail before any group starts when the layout does not match the world size."""
    if cfg.world_size != world_size:
        raise ConfigError(
            f"parallel layout tensor_parallel={cfg.tensor_parallel} x pipeline_parallel="
            f"{cfg.pipeline_parallel} x data_parallel={cfg.data_parallel} = {cfg.world_size} "
            f"processes, but the world has {world_size}: set parallel.data_parallel="
            f"{max(1, world_size // (cfg.tensor_parallel * cfg.pipeline_parallel))} or launch "
            f"{cfg.world_size} processes"
        )


def init_parallel(
    cfg: ParallelConfig,
    *,
    seed: int,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> ParallelInfo:
    """Start torch.distributed (if needed) and megatron-core's model-parallel groups."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_cpu_shims()
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    check_world(cfg, world_size)
    if not dist.is_initialized():
        rendezvous: dict = {"init_method": init_method}  # None: env:// (torchrun, Slurm)
        if init_method is None and "MASTER_ADDR" not in os.environ:
            if world_size == 1:
                # one process: an in-memory store, no port. A port picked by free_port() is free
                # only when picked; the first lent GPU's run lost one to another socket between
                # that and the store's bind (EADDRINUSE) after a dozen runs in one process
                rendezvous = {"store": dist.HashStore()}
            else:
                rendezvous = {"init_method": f"tcp://127.0.0.1:{free_port()}"}
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(
            backend=backend_for(cfg),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            **rendezvous,
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_parallel,
            pipeline_model_parallel_size=cfg.pipeline_parallel,
            expert_model_parallel_size=cfg.expert_parallel,
            expert_tensor_parallel_size=1,
            # megatron-core takes minutes and builds timedelta(minutes=...): a float keeps
            # parallel.timeout_s exact (whole minutes bounded a hung rank at 60 s for 30 s)
            distributed_timeout_minutes=cfg.timeout_s / 60,
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    return parallel_info()


def parallel_info() -> ParallelInfo:
    """The current process's ranks and groups (after :func:`init_parallel`)."""
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        device=torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu"),
    )


def destroy_parallel() -> None:
    """Tear down megatron-core's groups and torch.distributed."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "ParallelInfo",
    "backend_for",
    "check_world",
    "destroy_parallel",
    "init_parallel",
    "parallel_info",
]
