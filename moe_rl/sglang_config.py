"""Configuration of the SGLang rollout engines (the ``rollout.sglang`` section of a recipe).

A data-only module under ``moe_rl.config`` (which composes it in
:class:`moe_rl.config.RolloutConfig`), outside ``moe_rl.rollout``, whose package imports torch:
only ``moe_rl.configlib`` is imported. The engines it configures are ``moe_rl.rollout.factory``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_rl.configlib import check_choices, check_text, require, require_positive


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    """The SGLang engines of rollout.engine=sglang: which to attach to, or how to launch them."""

    url: str | None = None
    "Attach to one running SGLang server at this URL (None with engine=sglang: launch the engines)."
    engines: int | list[str] = 1
    "How many engines to launch (colocated: in all, spread evenly over the trainer's nodes), or the URLs of running ones; 2+ sit behind sglang-router."
    router_url: str | None = None
    "Attach to a running sglang-router in front of the engines (None with 2+ engines: launch one)."
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = "cache_aware"
    "sglang-router --policy of a launched router (cache_aware keeps a prompt's samples on one engine)."
    model_path: str | None = None
    "HF checkpoint directory the launched SGLang server starts from (the policy's export)."
    tp: int = 1
    "Tensor-parallel size of each launched SGLang engine."
    ep: int = 1
    "Expert-parallel size of each launched SGLang engine."
    port: int = 30000
    "Port of the first launched engine (next engines: free ports; 0: a free port for each)."
    host: str | None = None
    "Where launched engines bind (None: 127.0.0.1; across nodes rank 0's routable address; docs/multinode.md)."
    gpus: list[int] | None = None
    "GPUs the rollout engines use: engine i gets gpus[i*tp:(i+1)*tp] as its CUDA_VISIBLE_DEVICES (colocated: on each node; default the trainer's)."
    colocate: bool = False
    "Engines share the trainer's GPUs: --enable-memory-saver --enable-weights-cpu-backup, memory held only for a push or a rollout, tensor pushes."
    mem_fraction: float = 0.8
    "SGLang --mem-fraction-static: the share of each GPU's memory an engine reserves (weights + KV cache)."
    offload_trainer: bool = True
    "Colocated: the trainer's weights, gradients and Adam state wait in host memory while the engines work."
    module: str = "sglang.launch_server"
    "Server module the launcher runs (moe_rl.serve.embedded: our SGLang-protocol server, CPU)."
    startup_timeout_s: float = 900.0
    "How long a launched server may take to answer /health_generate."
    trainer_address: str | None = None
    "Address engines reach the trainer's weight-update rendezvous at (None: $MOE_RL_TRAINER_ADDR, the route, Slurm)."
    api_key: str | None = None
    "SGLang --api-key: sent as Authorization: Bearer (and passed to launched engines and router)."
    admin_api_key: str | None = None
    "SGLang --admin-api-key: needed for weight updates, pause, abort and memory calls when set."
    step_deadline_s: float | None = None
    "Seconds a rollout step may take; then stragglers are aborted and kept as partial (None: no deadline)."
    max_concurrency: int = 256
    "Requests in flight at once from one trainer rank."

    def __post_init__(self) -> None:
        check_choices(self, "rollout.sglang")
        require_positive(self, "rollout.sglang", "startup_timeout_s", "step_deadline_s")
        require(
            0 <= self.port <= 65535, f"rollout.sglang.port={self.port} must be in 0..65535 (0: a free port)"
        )
        require(
            self.host is None or bool(self.host.strip("[] ")),
            "rollout.sglang.host is empty: use null (chosen), 127.0.0.1 or the node's address",
        )
        launches = self.url is None and not isinstance(self.engines, list)
        require(
            not (launches and self.host and self.host.strip("[]") in ("0.0.0.0", "::") and not self.api_key),
            f"rollout.sglang.host={self.host} listens on every interface: set rollout.sglang.api_key too "
            "(or bind one address)",
        )
        require(self.tp >= 1 and self.ep >= 1, "rollout.sglang.tp and rollout.sglang.ep must be >= 1")
        require(0 < self.mem_fraction < 1, "rollout.sglang.mem_fraction must be in (0, 1)")
        require(
            bool(self.engines) if isinstance(self.engines, list) else self.engines >= 1,
            f"rollout.sglang.engines={self.engines}: give a count >= 1 or a non-empty list of engine URLs",
        )
        for name in ("url", "router_url", "model_path"):
            require(getattr(self, name) != "", f"rollout.sglang.{name} is empty: give one or null")
        require(
            not (self.url and isinstance(self.engines, list)),
            "set rollout.sglang.url (one engine) or rollout.sglang.engines: [urls], not both",
        )
        require(self.max_concurrency >= 1, "rollout.sglang.max_concurrency must be >= 1")
        require(
            all(g >= 0 for g in self.gpus or ()),
            f"rollout.sglang.gpus={self.gpus}: GPU indices are >= 0 (CUDA_VISIBLE_DEVICES numbers)",
        )
        check_text(self, "rollout.sglang")

    @property
    def num_engines(self) -> int:
        """Engines the rollouts use (attached or launched)."""
        return len(self.engines) if isinstance(self.engines, list) else 1 if self.url else self.engines
