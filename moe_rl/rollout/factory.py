"""Build the SGLang rollout engine a recipe asks for: attach or launch, and wire weight sync.

Every rank of the trainer gets a client to the same server (each generates its own share
of the prompts); rank 0 alone pushes weights, the other ranks only take part in gathering
the full tensors and then adopt the new version.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl import dist
from moe_rl.rollout.sglang_client import SGLangClient, SGLangEngine
from moe_rl.rollout.types import HFStateSource, Rollouts, SamplingParams

if TYPE_CHECKING:
    from moe_rl.trainer.run import Run

log = logging.getLogger(__name__)


class RankedSGLangEngine:
    """SGLangEngine on every rank; weight pushes from rank 0 only."""

    def __init__(self, inner: SGLangEngine, rank: int):
        self.inner, self.rank = inner, rank

    @property
    def weight_version(self) -> str:
        return self.inner.weight_version

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        return self.inner.generate(prompts, n, sampling)

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


def build_sglang_engine(run: Run) -> RankedSGLangEngine:
    """The engine for ``run`` (a trainer Run): launch a server (rank 0) or attach to rollout.sglang.url."""
    from moe_rl.rollout.sglang_launcher import SGLangLauncher, SGLangServerConfig
    from moe_rl.rollout.weight_sync import DiskWeightSync, DistributedWeightSync

    rollout_cfg, model_cfg = run.recipe.rollout, run.recipe.model
    launcher, url = None, rollout_cfg.sglang.url
    if url is None:
        model_path = rollout_cfg.sglang.model_path or str(run.out / "hf_init")
        if not rollout_cfg.sglang.model_path:  # the server starts from the policy as it is now
            from moe_rl.megatron.hf import export_hf

            export_hf(run.policy, model_path, tokenizer=run.tok)
        if run.info.rank == 0:
            server_cfg = SGLangServerConfig(
                model_path=model_path,
                tp_size=rollout_cfg.sglang.tp,
                ep_size=rollout_cfg.sglang.ep,
                host=rollout_cfg.sglang.host,
                port=rollout_cfg.sglang.port or None,
                enable_return_routed_experts=run.recipe.algo.routing == "r3",
                mem_fraction_static=rollout_cfg.sglang.mem_fraction,
                module=rollout_cfg.sglang.module,
            )
            launcher = SGLangLauncher(
                server_cfg,
                log_path=run.out / "logs" / "sglang.log",
                startup_timeout_s=rollout_cfg.sglang.startup_timeout_s,
            )
            launcher.start()
            url = launcher.url
        url = dist.broadcast_object(url)
    client = SGLangClient(url, timeout_s=rollout_cfg.timeout_s, retries=rollout_cfg.retries)
    sync = None
    if run.info.rank == 0:
        if rollout_cfg.weight_sync == "disk":
            sync = DiskWeightSync(client, rollout_cfg.weight_sync_dir or Path(run.out) / "weights")
        else:
            sync = DistributedWeightSync(client, world_size=1 + rollout_cfg.sglang.tp)
    inner = SGLangEngine(
        client,
        num_layers=model_cfg.num_layers,
        topk=model_cfg.moe_router_topk,
        num_experts=model_cfg.num_experts,
        pad_id=run.tok.pad_id,
        weight_sync=sync,
        launcher=launcher,
    )
    return RankedSGLangEngine(inner, run.info.rank)
