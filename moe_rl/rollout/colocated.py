"""Colocated SGLang engines across the trainer's GPUs and nodes: where each engine runs, which
trainer rank builds each engine rank's weight payload, and the launch on every node.

With ``rollout.sglang.colocate`` the engines run on the trainer's own GPUs, on every node of the
trainer (slime's layout): ``rollout.sglang.engines`` engines in all, spread evenly over the nodes,
each node's tiled over its trainer GPUs (or ``rollout.sglang.gpus``) ``rollout.sglang.tp`` at a
time (:func:`colocated_placement`). The first rank of each node launches that node's engines,
listening where every node reaches them, and rank 0 starts sglang-router over all of them
(:func:`launch_on_every_node`). A colocated push hands each engine rank a CUDA IPC handle to a
bucket built by the trainer rank on the same GPU (:func:`colocated_payload_ranks`, read by
:class:`~moe_rl.rollout.weight_sync.tensor.TensorWeightSync`): a handle opens only on a GPU its
reader sees, and an engine's ``CUDA_VISIBLE_DEVICES`` holds its own GPUs alone.

Nodes and ranks are torchrun's: rank ``RANK`` on node ``GROUP_RANK`` (else ``RANK //
LOCAL_WORLD_SIZE``), on its node's visible GPU ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moe_rl import dist
from moe_rl.config import ConfigError

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.sglang_config import SGLangConfig

Placement = list[tuple[int, tuple[int, ...] | None]]
"(node, GPU ids) of each engine in order; GPU ids None where they are not known (no CUDA)."


def node_of(env: Mapping[str, str] | None = None) -> int:
    """This trainer rank's node (module docstring)."""
    env = os.environ if env is None else env
    if env.get("GROUP_RANK", "").strip():
        return int(env["GROUP_RANK"])
    return int(env.get("RANK", "0") or 0) // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))


def rank_gpu() -> int | None:
    """This rank's GPU as the node numbers them (its ``CUDA_VISIBLE_DEVICES`` entry), None without CUDA."""
    from moe_rl.rollout.factory import trainer_gpus

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


def own_address(cfg: SGLangConfig, node: int, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(bind, dial) of engines launched on ``node``: rank 0's node as
    :func:`moe_rl.rollout.factory.engine_address` says; another node at its own routable address,
    the local end of its route to ``$MASTER_ADDR`` (all interfaces with a wildcard host)."""
    from moe_rl.rollout.factory import engine_address
    from moe_rl.rollout.weight_sync.address import is_loopback, is_wildcard, route_address

    if node == 0:
        return engine_address(cfg, multi_node=True, env=env)
    env = os.environ if env is None else env
    if cfg.host is not None and not is_wildcard(cfg.host):
        raise ConfigError(
            f"rollout.sglang.host={cfg.host} names one address, but colocated engines run on every node: leave "
            "it unset (each node's routable address) or use 0.0.0.0 with rollout.sglang.api_key"
        )
    master = env.get("MASTER_ADDR")
    address = route_address(master) if master else None
    if not address or is_loopback(address.strip("[]")):
        raise ConfigError(
            f"node {node} has no routable address toward $MASTER_ADDR={master} for its colocated engines: "
            "run the trainer with MASTER_ADDR set to rank 0's routable address"
        )
    address = address.strip("[]")
    return (cfg.host, address) if cfg.host is not None else (address, address)


def launch_on_every_node(recipe: Recipe, out: Path, model_path: str, rank: int):
    """Each node's first rank launches that node's colocated engines; rank 0 the router over all
    of them. Every rank returns (its Fleet or None, every engine URL in placement order, router
    URL); a failure on any node is raised on every rank. Collective."""
    from moe_rl.rollout.factory import launch_fleet, start_router
    from moe_rl.rollout.sglang_launcher import SGLangLaunchError

    cfg = recipe.rollout.sglang
    layout = trainer_layout()
    node = layout[rank][0]
    fleet = urls = failure = None
    try:
        placement = colocated_placement(cfg, cfg.num_engines, layout)
        if rank == min(r for r, (n, _) in enumerate(layout) if n == node):
            mine = [i for i, (n, _) in enumerate(placement) if n == node]
            fleet, urls, _ = launch_fleet(
                recipe,
                out,
                model_path,
                masks=[placement[i][1] for i in mine],
                first=mine[0],
                address=own_address(cfg, node),
                router=False,
            )
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        failure = e
    every = dist.all_gather_object((urls or [], _said(failure, node)))
    errors = [err for _, err in every if err is not None]
    router_url = None
    if not errors and rank == 0:
        try:
            router_url = start_router(
                recipe, out, fleet, [url for node_urls, _ in every for url in node_urls], own_address(cfg, 0)
            )
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            failure = e
    router_url, error = dist.broadcast_object((router_url, _said(failure, node) if rank == 0 else None))
    errors += [error] if error else []
    if errors:
        if fleet is not None:
            fleet.stop()
        is_config, message = errors[0]
        raise (ConfigError(message) if is_config else SGLangLaunchError(message)) from failure
    return fleet, [url for node_urls, _ in every for url in node_urls], router_url


def _said(failure: Exception | None, node: int) -> tuple[bool, str] | None:
    """A failure as every rank can raise it: (is a ConfigError, one line naming the node)."""
    if failure is None:
        return None
    first = (str(failure).splitlines() or [""])[0] or type(failure).__name__
    return isinstance(
        failure, ConfigError
    ), f"node {node} could not launch its colocated SGLang engines: {first}"
