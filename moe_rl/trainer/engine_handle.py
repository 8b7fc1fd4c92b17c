"""The run's engine handle: :class:`EngineHandle` builds the rollout engine the recipe names and
does what the trainer does with it: generate (the trainer's one device boundary), push the
weights, the push check's scores, and the memory the engine works in where it shares the
trainer's GPUs. :class:`~moe_rl.trainer.context.Run` is one (it holds the parts named below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moe_rl.rollout import get_engine_class
from moe_rl.trainer.colocate import engine_phase

if TYPE_CHECKING:
    from moe_rl.config import Recipe
    from moe_rl.megatron.optim import Optimizer
    from moe_rl.megatron.parallel import ParallelInfo
    from moe_rl.megatron.policy import Policy
    from moe_rl.rollout.types import HFStateSource, RolloutEngine, Rollouts, SamplingParams
    from moe_rl.tasks.tokenizer import Tokenizer


class EngineHandle:
    """The rollout engine of a run and the trainer's side of it (module docstring)."""

    recipe: Recipe
    "The resolved recipe (its ``rollout`` section configures the engine)."
    tok: Tokenizer
    "The tokenizer (pad and eos ids; an SGLang server's tokenizer files)."
    info: ParallelInfo
    "This process's ranks and device."
    policy: Policy
    "The policy the engine samples (embedded) or whose weights it receives (SGLang)."
    optimizer: Optimizer | None
    "The optimizer: its step count names the weights pushed; colocated, it waits on the host meanwhile."
    out: Path
    "``train.out_dir`` (an SGLang launch's logs and exported start)."
    engine: RolloutEngine | None
    "The rollout engine (None until :meth:`ensure_engine`)."
    engine_gives_routes: bool
    "Ask the engine for every token's routed experts (free on the embedded engine; SGLang: R3 only)."

    def ensure_engine(self) -> None:
        """Build the rollout engine the recipe names (once)."""
        if self.engine is not None:
            return
        rollout_cfg = self.recipe.rollout
        if rollout_cfg.engine == "embedded":
            self.engine = self.embedded_engine()
            self.engine_gives_routes = True  # free: captured during generation
        else:
            from moe_rl.rollout.factory import build_sglang_engine, engine_start

            kw = {"policy": self.policy, "tokenizer": self.tok, "out": self.out}
            start = engine_start(self.recipe, **kw)  # the export reads the weights: before they leave
            with self.memory_for_engine("launch"):  # colocated: engines start beside no trainer state
                self.engine = build_sglang_engine(self.recipe, rank=self.info.rank, model_path=start, **kw)
            self.engine_gives_routes = self.recipe.algo.routing.wants_engine_routes

    def embedded_engine(self, route_noise: float | None = None) -> RolloutEngine:
        """An embedded engine over this run's policy, as the ``rollout`` section configures one: the
        run's own (:meth:`ensure_engine`), or another beside it whose routers add selection noise
        ``route_noise`` instead of ``rollout.route_noise`` (a measurement's second engine: pass it
        to :meth:`derive`; the caller closes it)."""
        cfg = self.recipe.rollout
        return get_engine_class("embedded")(
            self.policy,
            pad_id=self.tok.pad_id,
            eos_id=self.tok.eos_id,
            decoder=cfg.embedded_decoder,
            dtype=self.recipe.rollout_dtype,
            router_dtype=cfg.router_dtype,
            route_noise=cfg.route_noise if route_noise is None else route_noise,
        )

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """The engine's ``n`` rollouts of each prompt, on the policy's device: the trainer's one
        device boundary (engines return host tensors; everything the step computes from the batch
        lives on the policy's device, as NCCL's collectives need). The engine works with the
        trainer's memory on the host where it shares the GPUs (:meth:`memory_for_engine`)."""
        with self.memory_for_engine("rollout"):  # a rollout reads no trainer tensor
            rollouts = self.engine.generate(prompt_ids, n, sampling)
        self.check_push()
        return rollouts.to(self.info.device)

    @torch.no_grad()
    def check_push(self) -> None:
        """After a rollout that took a due push check's probes (``rollout.verify_every``): the
        trainer scores the tokens each engine scored, without route noise; WeightSyncError when an
        engine's scores are off (:func:`moe_rl.rollout.weight_sync.verify.check_scores`)."""
        take = getattr(self.engine, "take_push_probes", None)
        probes = take() if take is not None else None
        if not probes:
            return
        from moe_rl.rollout.weight_sync.verify import check_scores, score_tolerance

        mine = [  # outside a routing session: no route noise
            self.policy.logprobs(torch.tensor([p.tokens])).logp_BT[0, p.prompt_len :].tolist() for p in probes
        ]
        r = self.recipe
        tolerance = score_tolerance(r.model.dtype, r.rollout_dtype, r.rollout.verify_tolerance)
        check_scores(probes, mine, tolerance, self.engine.weight_version)

    def push_weights(self) -> None:
        """The policy's weights to the engine, which then serves version ``optimizer.step_count``."""
        with self.memory_for_engine("push"):  # a push reads the weights
            self.engine.update_weights(self.weights_for_engine(), str(self.optimizer.step_count))

    @contextlib.contextmanager
    def memory_for_engine(self, phase: str) -> Iterator[None]:
        """Around engine phase ``phase`` (rollout, push, launch) on the trainer's own GPUs
        (``rollout.colocated``): the engines hold memory only inside the block and, with
        ``rollout.sglang.offload_trainer``, the trainer's state waits in host memory meanwhile, every
        rank in step (:func:`moe_rl.trainer.colocate.engine_phase`); a no-op elsewhere. Every
        tensor is back, as it was, when the block ends."""
        if not self.recipe.rollout.colocated:
            yield
            return

        trainer = self.optimizer if self.recipe.rollout.sglang.offload_trainer else None
        with engine_phase(trainer, lambda: self.engine, phase):
            yield

    def weights_for_engine(self) -> HFStateSource | None:
        """What ``engine.update_weights`` reads: None for the embedded engine (it shares the
        policy's weights in process), else the policy's weights under HF names."""
        if self.recipe.rollout.engine == "embedded":
            return None
        from moe_rl.megatron.hf import PolicyHFSource

        return PolicyHFSource(self.policy)
