"""The run's context: :class:`Run` holds what one run trains with, and its second seam,
:meth:`Run.derive` (the first seam, hooks after each optimizer step, is :meth:`Run.add_hook`).

The stages that train it live beside it: :func:`moe_rl.trainer.sft.run_sft`,
:func:`moe_rl.trainer.loop.run_rl`, both on :func:`moe_rl.trainer.stage.run_stage`;
:func:`moe_rl.trainer.run.run` runs them in order.
"""

from __future__ import annotations

import copy
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import yaml

from moe_rl.config import Recipe, to_dict
from moe_rl.files import write_text
from moe_rl.megatron.optim import Optimizer
from moe_rl.megatron.parallel import backend_for, destroy_parallel
from moe_rl.megatron.policy import build_policy
from moe_rl.preflight import check_vocab
from moe_rl.routing.noise import RouteNoise
from moe_rl.tasks import build_task, load_tokenizer
from moe_rl.trainer.engine_handle import EngineHandle
from moe_rl.trainer.metrics import MetricsSink
from moe_rl.trainer.progress import Progress
from moe_rl.trainer.signals import StopSignals
from moe_rl.trainer.state import Checkpointer, RunState, SaveResume, read_run_file, write_run_file

if TYPE_CHECKING:
    from moe_rl.config import AlgoConfig, OptimConfig, TrainConfig
    from moe_rl.megatron.parallel import ParallelInfo
    from moe_rl.megatron.policy import Policy
    from moe_rl.rollout.types import RolloutEngine
    from moe_rl.tasks.base import Task
    from moe_rl.tasks.tokenizer import Tokenizer
    from moe_rl.trainer.batch import RLBatch

log = logging.getLogger(__name__)
RANK_LOGGER = "moe_rl.rank"
"The logger of each rank's one start line: at INFO on every rank (``moe_rl.cli._setup_logging``)."

SHARED_SECTIONS = ("model", "parallel", "rollout", "task")
"Recipe sections a derived run keeps: the policy, process groups, engine and task were built from them."


# -- seam 1: hooks after each optimizer step (moe_rl.trainer.hooks) ------------------------------
@dataclass(frozen=True)
class OptimizerStep:
    """What a hook sees after one optimizer step."""

    run: Run
    "The run that stepped (``run.optimizer.step_count`` counts this step already)."
    stage: str
    "The stage: ``sft`` or ``rl``."
    step: int
    "The stage's step the update belongs to (an RL step holds ``minibatches`` updates)."
    minibatch: int
    "The update's index j within the step, 0 .. ``minibatches`` - 1 (0 in SFT)."
    minibatches: int
    "Updates in the step: ``train.minibatches`` in RL, 1 in SFT."
    stats: dict[str, float]
    "What ``optimizer.step()`` returned (``grad_norm``, ``lr``, ``skipped``; SFT adds ``loss``)."
    batch: RLBatch | None = None
    "The RL step's rollout batch (this rank's rows); None in SFT."


class StepHook:
    """A measurement after each optimizer step; subclass and override what it needs."""

    def begin(self, run: Run, step: int, batch: RLBatch) -> None:
        """Before the first update of RL step ``step`` on ``batch``."""

    def __call__(self, event: OptimizerStep) -> None:
        """After each optimizer step."""

    def metrics(self, run: Run) -> dict[str, float]:
        """After the updates of an RL step: metrics to add to the step's (reduced over ranks)."""
        return {}


class FunctionHook(StepHook):
    """A plain function ``fn(event)`` as a hook (:meth:`Run.add_hook` wraps functions in it)."""

    def __init__(self, fn: Callable[[OptimizerStep], object]):
        self.fn = fn

    def __call__(self, event: OptimizerStep) -> None:
        self.fn(event)


class KLReference(Protocol):
    """What the RL step asks of the KL term's reference (:class:`moe_rl.trainer.reference.Reference`)."""

    def use(self, run: Run, batch: RLBatch, rewards_B: torch.Tensor) -> dict[str, float]:
        """Set ``batch.ref_logp_BT`` (and, with an in-reward KL, the advantages); the penalty's metrics."""
        ...


class Run(EngineHandle, SaveResume):
    """The objects one run holds, built in dependency order; every trainer function takes it. Its
    engine handle (:class:`~moe_rl.trainer.engine_handle.EngineHandle`: generate, push, the
    engine's memory) and its save and resume policy (:class:`~moe_rl.trainer.state.SaveResume`,
    beside the :class:`~moe_rl.trainer.state.Checkpointer`) are its bases."""

    recipe: Recipe
    "The resolved recipe (another algo / optim / train: :meth:`derive` a run)."
    tok: Tokenizer
    "The tokenizer."
    task: Task
    "The verifiable task: prompts, rewards, demonstrations."
    info: ParallelInfo
    "This process's ranks and process groups."
    policy: Policy
    "The megatron-core policy being trained."
    optimizer: Optimizer | None
    "The optimizer of the current stage (None until :meth:`make_optimizer`)."
    engine: RolloutEngine | None
    "The rollout engine (None until :meth:`ensure_engine`)."
    route_noise: RouteNoise
    "The selection noise the trainer's routing sessions route with (``train.route_noise``): drawn anew for each RL step by :func:`moe_rl.trainer.rl.collect`; forwards outside a session route without."
    engine_gives_routes: bool
    "Ask the engine for every token's routed experts (free on the embedded engine; SGLang: R3 only)."
    sink: MetricsSink
    "Where metrics go (metrics.jsonl and the trackers of train.loggers, rank 0)."
    state: RunState
    "The run's position (stage, step, counters); saved in every checkpoint."
    checkpointer: Checkpointer
    "Saves, resumes and rolls back this run's checkpoints."
    out: Path
    "``train.out_dir``."
    signals: StopSignals
    "SIGTERM / SIGINT seen while :func:`moe_rl.trainer.run.run` runs the stages (installed there)."
    hooks: list[StepHook]
    "Called after each optimizer step (:mod:`moe_rl.trainer.hooks`), after :attr:`probes`."
    probes: list[StepHook]
    "The trainer's own probes (:mod:`moe_rl.trainer.probe`), made by the first RL step (:func:`moe_rl.trainer.rl.step_hooks`); one list for this run and those derived from it."
    reference: KLReference | None
    "The KL term's reference, the RL stage's starting weights (:mod:`moe_rl.trainer.reference`); None without one."
    phases: Progress
    "Rank 0's progress: phase lines, a bar or plain step lines, progress.json (:mod:`moe_rl.trainer.progress`)."

    def __init__(self, recipe: Recipe, *, write_recipe: bool = True):
        from moe_rl.megatron.parallel import init_parallel

        self.recipe = recipe
        self.tok = load_tokenizer(recipe.model.tokenizer)
        check_vocab(recipe, self.tok)  # `moe-rl train` runs all of preflight before this
        self.task = build_task(recipe.task, self.tok)
        self._owns_dist = not torch.distributed.is_initialized()
        if recipe.rollout.engine == "sglang":  # before NCCL starts: it reads its interface once
            from moe_rl.rollout.factory import pin_nccl_for_engines

            pin_nccl_for_engines(recipe, nccl=backend_for(recipe.parallel) == "nccl")
        self.info = init_parallel(recipe.parallel, seed=recipe.train.seed)
        if self.info.world_size > 1:  # every rank's one line (the others log warnings only)
            i = self.info
            logging.getLogger(RANK_LOGGER).info(
                "rank %d/%d on %s: tp %d/%d, ep %d/%d, dp %d/%d",
                *(i.rank, i.world_size, i.device, i.tp_rank, i.tp_size, i.ep_rank, i.ep_size),
                *(i.dp_rank, i.dp_size),
            )
        self.policy = build_policy(recipe.model, recipe.parallel, self.info)
        self.route_noise = RouteNoise(recipe.train.route_noise, seed=recipe.train.seed)
        self.optimizer = None
        self.engine = None
        self.engine_gives_routes = False
        self.out = Path(recipe.train.out_dir)
        self.sink = MetricsSink(
            self.out, enabled=self.info.rank == 0, loggers=recipe.train.loggers, recipe=to_dict(recipe)
        )
        self.state = RunState(run_id=uuid.uuid4().hex[:12])
        self.tag_rows()
        self.checkpointer = Checkpointer(
            checkpoint_root(recipe), self.policy.model, keep=recipe.checkpoint.keep
        )
        self.signals = StopSignals()
        self.hooks = []
        self.probes = []
        self.reference = None
        self.phases = Progress(self.out, enabled=self.info.rank == 0, log_every=recipe.train.log_every)
        self._derived_from: Run | None = None
        if write_recipe:
            self.write_recipe()

    def write_recipe(self) -> None:
        """``<out_dir>/recipe.yaml`` (the resolved recipe) and ``run.json`` (the run's id and
        checkpoint folder: what ``--resume`` continues), each written atomically (rank 0)."""
        if self.info.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            write_text(self.out / "recipe.yaml", yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
            if read_run_file(self.out).get("run_id") != self.state.run_id:  # a resume leaves it be
                write_run_file(self.out, self.state.run_id, self.checkpointer.root)

    def make_optimizer(self, stage: str) -> None:
        """A fresh optimizer for ``stage``: RL does not inherit the SFT stage's Adam moments. In
        RL with ``train.freeze_router`` it never changes the routers (:meth:`frozen_for`)."""
        cfg = self.recipe.optim
        lr = self.recipe.train.sft_lr
        if stage == "sft" and lr is not None:
            cfg = replace(cfg, lr=lr, min_lr=min(cfg.min_lr, lr))
        self.optimizer = Optimizer(
            self.policy.model, cfg, self.info, frozen=self.frozen_for(stage), scaled=self.scaled_for(stage)
        )

    def frozen_for(self, stage: str) -> tuple[torch.nn.Parameter, ...]:
        """The parameters ``stage``'s optimizer leaves as they are: with ``train.freeze_router``, in
        the RL stage, every parameter of every MoE router (the weight; a bias if one had any). SFT
        trains them: an RL arm with the router frozen starts from the same SFT weights as the others."""
        if stage != "rl" or not self.recipe.train.freeze_router:
            return ()
        return self._router_params("train.freeze_router")

    def scaled_for(self, stage: str) -> tuple[tuple[torch.nn.Parameter, ...], float]:
        """``(params, mult)`` of ``stage``'s optimizer: in RL with ``train.router_lr_mult`` other than
        1, every router parameter at that multiple of the learning rate (SFT: none)."""
        mult = self.recipe.train.router_lr_mult
        if stage != "rl" or mult == 1.0:
            return (), 1.0
        return self._router_params("train.router_lr_mult"), mult

    def _router_params(self, field: str) -> tuple[torch.nn.Parameter, ...]:
        for router in self.policy.routers:
            if getattr(router, "expert_bias", None) is not None:  # updated outside the optimizer
                raise NotImplementedError(
                    f"{field}: this router has an expert bias (moe_router_enable_expert_bias), "
                    "which megatron-core updates outside the optimizer; moe-rl does not build such routers"
                )
        return tuple(p for router in self.policy.routers for p in router.parameters())

    def add_hook(self, hook: StepHook | Callable[[OptimizerStep], object]) -> StepHook:
        """Seam 1: call ``hook`` after each optimizer step of this run (a :class:`StepHook`, or a
        function of an :class:`OptimizerStep`); returns it (a function comes back wrapped)."""
        hook = hook if isinstance(hook, StepHook) else FunctionHook(hook)
        self.hooks.append(hook)
        return hook

    def derive(
        self,
        *,
        recipe: Recipe | None = None,
        algo: AlgoConfig | None = None,
        optim: OptimConfig | None = None,
        train: TrainConfig | None = None,
        new_optimizer: bool = False,
        engine: RolloutEngine | None = None,
        engine_gives_routes: bool | None = None,
    ) -> Run:
        """Seam 2: a run for the next measurement, reconfigured; this run is left as it was.

        The derived run trains the same policy with the same tokenizer, task, process groups,
        engine, sink and checkpointer, under ``recipe`` (whole) with any of its ``algo``, ``optim``
        and ``train`` sections replaced. The sections those shared parts were built from
        (:data:`SHARED_SECTIONS`) must not change: build a new :class:`Run` for another model.

        - Optimizer: shared, unless the ``optim`` section or ``train.freeze_router`` changed, or
          ``new_optimizer`` (fresh Adam moments, e.g. after loading a start checkpoint): then a new
          one for the current stage (:meth:`make_optimizer`).
        - ``engine``: serve rollouts from this engine instead (a benchmark's recording wrapper
          or recorded rollouts), whose routes count as given when ``engine_gives_routes``; the
          caller closes it.
        - Hooks registered so far carry over; hooks added to either run later are its own. The
          run state is a copy.

        This run keeps owning the shared parts: close it; a derived run's :meth:`close` closes
        only its progress bar.
        """
        sections = {"algo": algo, "optim": optim, "train": train}
        new = replace(recipe or self.recipe, **{k: v for k, v in sections.items() if v is not None})
        changed = [k for k in SHARED_SECTIONS if getattr(new, k) != getattr(self.recipe, k)]
        if changed:
            raise ValueError(
                f"a derived run shares this run's policy, engine and task: its {', '.join(changed)} "
                "section(s) must stay as they are; build a new Run for them"
            )
        out = copy.copy(self)
        out.recipe, out.state, out.hooks = new, copy.deepcopy(self.state), list(self.hooks)
        out._derived_from = self
        out.phases = type(self.phases)(self.out, enabled=self.phases.enabled, log_every=new.train.log_every)
        if engine is not None:
            out.engine = engine
        if engine_gives_routes is not None:
            out.engine_gives_routes = engine_gives_routes
        frozen_changed = (new.train.freeze_router, new.train.router_lr_mult) != (
            self.recipe.train.freeze_router,
            self.recipe.train.router_lr_mult,
        )
        if new_optimizer or new.optim != self.recipe.optim or frozen_changed:
            out.make_optimizer(out.state.stage or "rl")
        return out

    def progress(self, stage: str, step: int, total: int, metrics: dict[str, float]) -> None:
        """Rank 0's progress after ``stage``'s step ``step`` (0-based) of ``total``, with s/step and
        the time left: a bar on a terminal; where stderr is a file or a pipe (a log, Slurm, a child
        of ``compare``), one plain line every ``train.log_every`` steps, at the first and the last
        (:class:`moe_rl.trainer.progress.Progress`)."""
        if self.phases.name != stage:
            self.phases.stage(stage, total, step)
        self.phases.step(step, progress_fields(stage, metrics))

    def close(self) -> None:
        """Flush metrics, stop the engine, and end the process groups this run started (a run from
        :meth:`derive` closes its progress bar only: the run it came from owns the rest)."""
        if self._derived_from is None:
            self.sink.close()
        self.phases.close()
        if self._derived_from is not None:
            return
        if self.engine is not None:
            self.engine.close()
        if self._owns_dist and torch.distributed.is_initialized():
            destroy_parallel()


def checkpoint_root(recipe: Recipe) -> Path:
    """Where a recipe's run keeps its checkpoints: ``checkpoint.dir``, else ``<out_dir>/checkpoints``."""
    return Path(recipe.checkpoint.dir or Path(recipe.train.out_dir) / "checkpoints")


PROGRESS_FIELDS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "sft": (("loss", "loss", "{:.4f}"), ("grad_norm", "grad_norm", "{:.3f}")),
    "rl": (
        ("reward/mean", "reward", "{:.3f}"),
        ("reward/accuracy", "acc", "{:.1%}"),
        ("flip/step/rate", "flip/step", "{:.2%}"),
    ),
}
"""What a stage's progress shows besides step / total, s/step and ETA: (metric, label, format).
Rates as percentages, marked with %, as the docs give them (metrics.jsonl keeps fractions)."""


def progress_fields(stage: str, metrics: dict[str, float]) -> dict[str, str]:
    """``label -> formatted value`` of ``stage``'s :data:`PROGRESS_FIELDS` present in ``metrics``."""
    return {
        label: fmt.format(metrics[key])
        for key, label, fmt in PROGRESS_FIELDS.get(stage, ())
        if isinstance(metrics.get(key), (int, float))
    }
