"""Colocated SGLang engines across the trainer's GPUs and nodes: where each engine runs, which
trainer rank builds each engine rank's weight payload, and the launch on every node.

With ``rollout.sglang.colocate`` the engines run on the trainer's own GPUs, on every node of the
trainer (slime's layout): ``rollout.sglang.engines`` engines in all, spread evenly over the nodes,
each node's tiled over its trainer GPUs (or ``rollout.sglang.gpus``) ``rollout.sglang.tp`` at a
time (:func:`colocated_placement`). The first rank of each node launches that node's engines,
listening where every node reaches them, and rank 0 starts sglang-router over all of them
(:func:`moe_rl.rollout.factory.launch_on_every_node`). A colocated push hands each engine rank a CUDA IPC handle to a
bucket built by the trainer rank on the same GPU (:func:`colocated_payload_ranks`, read by
:class:`~moe_rl.rollout.weight_sync.tensor.TensorWeightSync`): a handle opens only on a GPU its
reader sees, and an engine's ``CUDA_VISIBLE_DEVICES`` holds its own GPUs alone.

Nodes and ranks are torchrun's: rank ``RANK`` on node ``GROUP_RANK`` (else ``RANK //
LOCAL_WORLD_SIZE``), on its node's visible GPU ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.config import ConfigError

if TYPE_CHECKING:
    from moe_rl.sglang_config import SGLangConfig

Placement = list[tuple[int, tuple[int, ...] | None]]
"(node, GPU ids) of each engine in order; GPU ids None where they are not known (no CUDA)."


def node_of(env: Mapping[str, str] | None = None) -> int:
    """This trainer rank's node (module docstring)."""
    env = os.environ if env is None else env
    if env.get("GROUP_RANK", "").strip():
        return int(env["GROUP_RANK"])
    return int(env.get("RANK", "0") or 0) // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))


def trainer_gpus(env: dict[str, str] | None = None) -> list[int]:
    """Physical GPU ids this node's trainer ranks use (rank i on visible device i)."""
    env = os.environ if env is None else env
    if not torch.cuda.is_available():
        return []
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [int(x) for x in visible.split(",") if x.strip()]
        if visible
        else list(range(torch.cuda.device_count()))
    )
    return ids[:local]


def rank_gpu() -> int | None:
    """This rank's GPU as the node numbers them (its ``CUDA_VISIBLE_DEVICES`` entry), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    gpus = trainer_gpus({**os.environ, "LOCAL_WORLD_SIZE": str(torch.cuda.device_count())})
    return gpus[torch.cuda.current_device()]


def trainer_layout() -> list[tuple[int, int | None]]:
    """(node, GPU) of every trainer rank, in rank order (collective)."""
    return dist.all_gather_object((node_of(), rank_gpu()))


def colocated_placement(cfg: SGLangConfig, engines: int, layout: list[tuple[int, int | None]]) -> Placement:
    """Where each of ``engines`` colocated engines runs on the trainer's ``layout`` (module
    docstring); ConfigError naming the field when they do not tile the nodes."""
    from moe_rl.rollout.sglang_launcher import plan_gpus

    nodes = max(n for n, _ in layout) + 1
    if engines % nodes:
        per_node = max(1, sum(1 for n, _ in layout if n == 0) // cfg.tp)
        raise ConfigError(
            f"rollout.sglang.engines={engines}: colocated engines run on every one of the trainer's {nodes} "
            f"nodes; give a multiple of {nodes} (e.g. {nodes * per_node}: {per_node} engine(s) of tp "
            f"{cfg.tp} per node)"
        )
    per, out = engines // nodes, []
    for node in range(nodes):
        gpus = [g for n, g in layout if n == node]
        if cfg.gpus is not None:
            gpus = list(cfg.gpus)
        if None in gpus:
            out += [(node, None)] * per
            continue
        try:
            out += [(node, mask) for mask in plan_gpus(gpus, per, cfg.tp)]
        except ValueError as e:
            raise ConfigError(f"{e} (colocated, on each of the {nodes} nodes)") from None
    return out


def payload_ranks(placement: Placement, layout: list[tuple[int, int | None]]) -> list[list[int]]:
    """The trainer rank on each engine rank's GPU: ``[engine][tp rank] -> trainer rank``."""
    where = {(n, g): rank for rank, (n, g) in enumerate(layout)}
    out = []
    for i, (node, gpus) in enumerate(placement):
        missing = [g for g in gpus if (node, g) not in where]
        if missing:
            raise ConfigError(
                f"colocated engine {i} runs on GPUs {list(gpus)} of node {node}, but no trainer rank runs on "
                f"{missing}: each engine rank reads a bucket the trainer rank on its own GPU builds; list "
                "only the trainer's GPUs in rollout.sglang.gpus"
            )
        out.append([where[(node, g)] for g in gpus])
    return out


def colocated_payload_ranks(cfg: SGLangConfig, engines: int) -> list[list[int]] | None:
    """:func:`payload_ranks` of ``engines`` colocated engines placed as :func:`colocated_placement`
    places them (attached ones are taken to be placed so too); None where the trainer has no GPUs
    (the rank that calls the engines builds every payload). Collective."""
    layout = trainer_layout()
    if any(g is None for _, g in layout):
        return None
    return payload_ranks(colocated_placement(cfg, engines, layout), layout)
