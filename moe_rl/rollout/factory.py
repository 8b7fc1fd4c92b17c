"""Build the SGLang rollout engine a recipe asks for: attach or launch engines (and sglang-router),
place them on GPUs, and wire weight sync to every engine.

Every rank of the trainer gets a client to the generation endpoint (the router with 2+ engines)
and generates its own share of the prompts; rank 0 alone pushes weights (one group over every
engine, or disk, or colocated tensors), the other ranks only take part in gathering the full
tensors and then adopt the new version. Launched engines and the router run on rank 0's node.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl import dist
from moe_rl.config import ConfigError
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.types import HFStateSource, Rollouts, SamplingParams

if TYPE_CHECKING:
    from moe_rl.rollout.config import SGLangConfig
    from moe_rl.trainer.run import Run

log = logging.getLogger(__name__)


class RankedSGLangEngine:
    """SGLangEngine on every rank; weight pushes and (colocated) memory calls from rank 0 only,
    between barriers, so no engine releases its memory while another rank still generates."""

    def __init__(self, inner: SGLangEngine, rank: int):
        self.inner, self.rank = inner, rank
        inner.auto_memory = False

    @property
    def weight_version(self) -> str:
        return self.inner.weight_version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        if self.inner.colocated:
            if self.rank == 0:
                self.inner.resume_memory()
            dist.barrier()
        rollouts = self.inner.generate(prompts, n, sampling)
        if self.inner.colocated:
            dist.barrier()
            if self.rank == 0:
                self.inner.release_memory()
        return rollouts

    def update_weights(self, source: HFStateSource, version: str) -> str:
        if self.rank == 0:
            self.inner.update_weights(source, version)
        else:
            for _ in source.hf_tensors():  # the gathers are collective: take part, keep nothing
                pass
            self.inner.weight_version = version
        dist.barrier()
        return version

    def close(self) -> None:
        if self.rank == 0:
            self.inner.close()


def trainer_gpus(env: dict[str, str] | None = None) -> list[int]:
    """Physical GPU ids this node's trainer ranks use (rank i on visible device i)."""
    import torch

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


def engine_gpus(cfg: SGLangConfig, n: int, trainer: list[int]) -> list[tuple[int, ...] | None]:
    """Device mask of each launched engine; ConfigError when they would land on the trainer's GPUs."""
    from moe_rl.rollout.sglang_launcher import check_disjoint, plan_gpus

    gpus = cfg.gpus if cfg.gpus is not None else (trainer if cfg.colocate and trainer else None)
    if gpus is None:
        if trainer:
            raise ConfigError(
                f"rollout.sglang.gpus is not set: a launched engine would share the trainer's GPUs {trainer} "
                f"and reserve {cfg.mem_fraction:.0%} of their memory. List the GPUs the engines use "
                f"(engine i gets gpus[i*tp:(i+1)*tp]) or set rollout.sglang.colocate=true"
            )
        return [None] * n
    try:
        if not cfg.colocate:
            check_disjoint(gpus, trainer)
        return list(plan_gpus(gpus, n, cfg.tp))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def launch_fleet(run: Run, model_path: str):
    """Rank 0: launch the engines (and the router with 2+); returns (Fleet, engine URLs, router URL)."""
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig
    from moe_rl.rollout.sglang_router import Fleet, SGLangRouterLauncher

    cfg = run.recipe.rollout.sglang
    masks = engine_gpus(cfg, cfg.num_engines, trainer_gpus())
    launchers = []
    fleet = Fleet(launchers)
    try:
        for i, mask in enumerate(masks):
            server_cfg = SGLangServerConfig(
                model_path=model_path,
                tp_size=cfg.tp,
                ep_size=cfg.ep,
                host=cfg.host,
                port=(cfg.port or None) if i == 0 else None,
                enable_return_routed_experts=run.recipe.algo.routing == "r3",
                mem_fraction_static=cfg.mem_fraction,
                module=cfg.module,
                gpu_ids=mask,
                enable_memory_saver=cfg.colocate,
                api_key=cfg.api_key,
                admin_api_key=cfg.admin_api_key,
            )
            launcher = SGLangLauncher(
                server_cfg,
                log_path=run.out / "logs" / f"sglang-{i}.log",
                startup_timeout_s=cfg.startup_timeout_s,
            )
            launchers.append(launcher)
            launcher.start()
        urls = [launcher.url for launcher in launchers]
        router_url = cfg.router_url
        if len(urls) > 1 and router_url is None:
            fleet.router = SGLangRouterLauncher(
                urls,
                host=cfg.host,
                policy=cfg.router_policy,
                api_key=cfg.api_key,
                log_path=run.out / "logs" / "sglang-router.log",
                request_timeout_s=run.recipe.rollout.timeout_s,
            )
            router_url = fleet.router.start().base_url
    except BaseException:
        fleet.stop()
        raise
    return fleet, urls, router_url


def build_sglang_engine(run: Run) -> RankedSGLangEngine:
    """The engine for ``run`` (a trainer Run): attach to the recipe's URLs or launch engines on rank 0."""
    rollout_cfg, model_cfg = run.recipe.rollout, run.recipe.model
    cfg = rollout_cfg.sglang
    fleet, router_url = None, cfg.router_url
    if cfg.url is not None or isinstance(cfg.engines, list):
        urls = [cfg.url] if cfg.url is not None else list(cfg.engines)
    else:
        model_path = cfg.model_path or str(run.out / "hf_init")
        if not cfg.model_path:  # the server starts from the policy as it is now
            from moe_rl.megatron.hf import export_hf

            export_hf(run.policy, model_path, tokenizer=run.tok)
        urls = None
        if run.info.rank == 0:
            fleet, urls, router_url = launch_fleet(run, model_path)
        urls, router_url = dist.broadcast_object((urls, router_url))
    if len(urls) > 1 and router_url is None:
        raise ConfigError("rollout.sglang.engines lists several URLs: set rollout.sglang.router_url too")
    key = cfg.admin_api_key or cfg.api_key
    kw = {"timeout_s": rollout_cfg.timeout_s, "retries": rollout_cfg.retries}
    engines = [SGLangClient(u, api_key=key, **kw) for u in urls]
    front = SGLangClient(router_url, api_key=cfg.api_key, **kw) if router_url else engines[0]
    sync = _weight_sync(run, engines) if run.info.rank == 0 else None
    inner = SGLangEngine(
        front,
        engines=engines,
        num_layers=model_cfg.num_layers,
        topk=model_cfg.moe_router_topk,
        num_experts=model_cfg.num_experts,
        pad_id=run.tok.pad_id,
        weight_sync=sync,
        launcher=fleet,
        step_deadline_s=cfg.step_deadline_s,
        max_concurrency=cfg.max_concurrency,
        colocated=cfg.colocate,
    )
    return RankedSGLangEngine(inner, run.info.rank)


def _weight_sync(run: Run, engines: list[SGLangClient]):
    """Rank 0's pusher to every engine, as the recipe asks."""
    from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync, TensorWeightSync

    rollout_cfg = run.recipe.rollout
    tp_sizes = [rollout_cfg.sglang.tp] * len(engines)
    if rollout_cfg.weight_sync == "disk":
        return DiskWeightSync(engines, rollout_cfg.weight_sync_dir or Path(run.out) / "weights")
    if rollout_cfg.weight_sync == "tensor":
        return TensorWeightSync(engines, tp_sizes=tp_sizes, timeout_s=rollout_cfg.timeout_s)
    return DistributedWeightSync(
        engines,
        tp_sizes=tp_sizes,
        master_address=rollout_cfg.sglang.trainer_address,
        timeout_s=rollout_cfg.timeout_s,
    )
