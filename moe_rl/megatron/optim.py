"""megatron-core's DistributedDataParallel and optimizer behind moe-rl's step interface.

The policy's module is wrapped once in megatron-core's ``DistributedDataParallel`` (contiguous
fp32 grad buffers, bucketed reduction overlapped with backward on GPU) and stepped by
``get_megatron_optimizer`` (Adam with decoupled weight decay; the distributed optimizer shards
fp32 main weights and Adam moments over data-parallel ranks). Which group reduces which gradient
is megatron-core's own rule, with one tag fixed by the builder (``moe_rl.megatron.model``):

- experts (``allreduce=False``): summed over the expert-data-parallel group;
- everything else: summed over the data-parallel group;
- ``sequence_parallel`` parameters (norms under TP + SP): then summed over the TP group
  (``finalize_model_grads``).

Gradients are summed, not averaged: the losses carry global denominators (moe_rl.losses), so
DDP runs with ``calculate_per_token_loss`` (scaling factor 1). On CPU every call into
megatron-core's optimizer runs inside :func:`moe_rl.megatron.shims.cuda_as_cpu`.

Frozen parameters (``Optimizer(frozen=...)``; ``train.freeze_router`` freezes the routers for the
RL stage) stay in DDP and in the optimizer, in a param group of their own that megatron-core's
builder makes from a ``config_overrides`` entry with ``lr_mult = wd_mult = 0``; their reduced
gradient is zeroed before the step. An update then leaves them bit for bit as they were, and they
add nothing to the global gradient norm (so clipping of the other parameters is what it would be
without them), as with ``requires_grad_(False)``. ``requires_grad_(False)`` itself is not used:
megatron-core's DDP skips such parameters only when they are frozen before it wraps the model (no
buffer, no hook), and one DDP wraps the model for every stage (:func:`wrap_ddp`), so a router that
trained in SFT is already in its buffers; frozen later, the distributed optimizer fails to place it
(a parameter of the buffer in no param group) and the overlapped reduction waits for a gradient
that never comes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import math

import torch

from moe_rl.config import OptimConfig
from moe_rl.megatron.offload import HostOffload
from moe_rl.megatron.parallel import ParallelInfo
from moe_rl.megatron.shims import cuda_as_cpu

log = logging.getLogger(__name__)


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warmup, then decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay_style == "constant" or cfg.decay_steps == 0:
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    if cfg.decay_style == "linear":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 - frac)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


def use_distributed_optimizer(cfg: OptimConfig, info: ParallelInfo) -> bool:
    """``optim.distributed`` resolved: auto is on where data_parallel > 1."""
    return cfg.distributed is True or (cfg.distributed == "auto" and info.dp_size > 1)


def _ddp_key(cfg: OptimConfig, info: ParallelInfo) -> tuple:
    on_gpu = info.device.type == "cuda"
    distributed = use_distributed_optimizer(cfg, info)
    return (
        distributed,
        cfg.grad_reduce_in_fp32,
        cfg.overlap_grad_reduce and on_gpu,
        cfg.overlap_param_gather and on_gpu and distributed,
        cfg.bucket_size,
    )


def wrap_ddp(model: torch.nn.Module, cfg: OptimConfig, info: ParallelInfo):
    """megatron-core's DistributedDataParallel around ``model``, built once per module.

    DDP hooks every parameter's gradient accumulator; a second wrapper would hook them again, so
    later optimizers of the same model (one per stage) reuse the first wrapper, which must have
    been built with the same DDP settings.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    key = _ddp_key(cfg, info)
    held = model.__dict__.get("_moe_rl_ddp")
    if held is not None:
        if held[0] != key:
            raise ValueError(
                f"this model is already wrapped in DDP with (distributed, grad_reduce_in_fp32, "
                f"overlap_grad_reduce, overlap_param_gather, bucket_size) = {held[0]}, not {key}: "
                "build the policy again to change these optim settings"
            )
        return held[1]
    distributed, fp32_reduce, overlap_grad, overlap_param, bucket = key
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32_reduce,
        overlap_grad_reduce=overlap_grad,
        overlap_param_gather=overlap_param,
        use_distributed_optimizer=distributed,
        bucket_size=bucket,
    )
    # Sum, do not average, over data-parallel ranks (the module doc): DDP reads this flag only to
    # pick its gradient scaling factor; the model's own config (router aux-loss scaling) keeps its.
    ddp_model_cfg = copy.copy(model.config)
    ddp_model_cfg.calculate_per_token_loss = True
    ddp = DistributedDataParallel(config=ddp_model_cfg, ddp_config=ddp_cfg, module=model)
    object.__setattr__(model, "_moe_rl_ddp", (key, ddp))  # not a submodule: no module cycle
    return ddp


def _group_overrides(
    mcfg, frozen: tuple[torch.nn.Parameter, ...], scaled: tuple[tuple[torch.nn.Parameter, ...], float]
) -> dict | None:
    """megatron-core's ``config_overrides``: its standard ones (no weight decay on biases and
    1-d parameters, what it applies when given none) plus ``lr_mult = wd_mult = 0`` for ``frozen``
    and ``lr_mult = wd_mult = mult`` for ``scaled = (params, mult)`` (None when neither: megatron-
    core's default)."""
    params, mult = scaled
    if not frozen and not params:
        return None
    from megatron.core.optimizer import ParamKey, ParamPredicate, get_standard_config_overrides

    out = get_standard_config_overrides(mcfg)
    for name, group, m in (("moe_rl_frozen", frozen, 0.0), ("moe_rl_scaled", params, mult)):
        if group:
            ids = frozenset(id(p) for p in group)
            key = ParamKey(predicate=ParamPredicate(name=name, fn=lambda p, ids=ids: id(p) in ids))
            out[key] = {"lr_mult": float(m), "wd_mult": float(m)}
    return out


def _megatron_config(cfg: OptimConfig, model: torch.nn.Module, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig

    bf16 = model.config.params_dtype == torch.bfloat16
    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.grad_clip,
        bf16=bf16,
        params_dtype=model.config.params_dtype,
        use_distributed_optimizer=distributed,
        overlap_param_gather=cfg.overlap_param_gather and distributed and torch.cuda.is_available(),
    )


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's ``local_multi_tensor_l2_norm`` (apex's ``multi_tensor_l2norm`` signature):
    the l2 norm of every tensor of ``tensor_lists`` together, ``[1]`` fp32 on their device. By one
    ``torch._foreach_norm`` (a multi-tensor kernel on CUDA) instead of a norm per tensor and a
    ``torch.tensor`` of them, which reads every norm back to the host: one device-to-host sync per
    gradient, every step."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron-core's ``local_multi_tensor_scale`` (apex's ``multi_tensor_scale`` signature):
    ``dst = src * scale`` for every pair of ``tensor_lists = [src, dst]``, by foreach ops (in place
    where ``dst`` is ``src``, a plain copy where ``scale`` is 1) instead of two kernels per tensor."""
    src, dst = tensor_lists
    if not dst:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


#: megatron-core's modules that bind its local multi-tensor fallbacks (no transformer-engine or
#: apex), the names they bind them to, and what stands in for each.
_MULTI_TENSOR = {
    "megatron.core.optimizer.clip_grads": ("l2_norm_impl", "multi_tensor_scale_impl"),
    "megatron.core.optimizer.optimizer": ("multi_tensor_scale_impl",),
}


def use_foreach_multi_tensor() -> list[str]:
    """Where megatron-core fell back to its local multi-tensor functions (no transformer-engine or
    apex: the CPU, and GPUs without either), put :func:`foreach_l2_norm` and :func:`foreach_scale`
    in their place (idempotent; transformer-engine's or apex's kernels are left alone). Returns the
    names replaced now, as ``module.name``."""
    from megatron.core import utils

    local = {
        utils.local_multi_tensor_l2_norm: foreach_l2_norm,
        utils.local_multi_tensor_scale: foreach_scale,
    }
    done = []
    for module, names in _MULTI_TENSOR.items():
        mod = importlib.import_module(module)
        for name in names:
            ours = local.get(getattr(mod, name, None))
            if ours is not None:
                setattr(mod, name, ours)
                done.append(f"{module}.{name}")
    return done


def _fuse_adam(optimizers: list) -> str:
    """Where megatron-core fell back to ``torch.optim.AdamW`` (no transformer-engine or apex: its
    ``FusedAdam`` is what it takes where either is installed), step with torch's fused kernel: one
    pass per parameter group (CPU: fp32 parameters; CUDA: any floating dtype) instead of the
    per-parameter form on CPU (20M fp32 parameters: ~25 ms instead of ~120 ms) or the multi-tensor
    ``foreach`` form on CUDA. The same update within float rounding. Returns what steps, for the log."""
    kinds = set()
    for opt in optimizers:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            kinds.add(type(inner).__module__.split(".")[0] + "." + type(inner).__name__)
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        devices = {p.device.type for p in params}
        fusable = devices == {"cuda"} or (
            devices == {"cpu"} and all(p.dtype == torch.float32 for p in params)
        )
        if params and fusable:
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
        kinds.add(f"torch {type(inner).__name__}{' (fused)' if params and fusable else ''}")
    return ", ".join(sorted(kinds))


def _set_adam_step(inner: torch.optim.Optimizer, step: int) -> None:
    """Set Adam's step count (its bias correction) to ``step`` in whichever layout ``inner`` keeps it.

    torch's Adam/AdamW (megatron-core's fallback, so on CPU) keeps a per-parameter ``step`` tensor;
    transformer-engine's and apex's ``FusedAdam`` (megatron-core's choice wherever either is
    installed) keep one ``step`` per param group, which their loaders take from the param groups
    the caller passes in. Step 0 is a fresh optimizer: the first update then uses step 1.
    """
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
        for st in inner.state.values():
            if st:
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
        return
    for group in inner.param_groups:
        if step:
            group["step"] = step
        else:
            group.pop("step", None)


class Optimizer:
    """megatron-core DDP + optimizer with the trainer's interface: ``step()`` -> skipped /
    grad_norm / lr, ``step_count`` (drives the LR schedule) and ``lr_scale`` (sentinel rollbacks).

    bf16 parameters (GPU) get fp32 main weights (megatron's mixed-precision optimizer); fp32
    parameters are their own main weights. A step with a non-finite gradient norm is skipped and
    reported, and the gradients are cleared either way.

    Gradient accumulation: call ``backward`` once per micro-batch and :meth:`step` once per
    minibatch; iterate the micro-batches through :meth:`micro_batches` so that DDP starts its
    reduction only after the last one (with ``overlap_grad_reduce``).

    ``frozen``: parameters of ``model`` this optimizer never changes (the module docstring says how).
    ``scaled``: ``(params, mult)``, parameters whose learning rate and weight decay are ``mult``
    times the others' (a param group of their own, as the frozen ones).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        info: ParallelInfo,
        *,
        frozen: tuple[torch.nn.Parameter, ...] | list[torch.nn.Parameter] = (),
        scaled: tuple[tuple[torch.nn.Parameter, ...] | list[torch.nn.Parameter], float] = ((), 1.0),
    ):
        from megatron.core.optimizer import get_megatron_optimizer

        self.cfg = cfg
        self.info = info
        self.distributed = use_distributed_optimizer(cfg, info)
        "Whether megatron-core's distributed optimizer (sharded state) is in use."
        self.ddp = wrap_ddp(model, cfg, info)
        own = {id(p) for p in model.parameters() if p.requires_grad}
        self.frozen = tuple(frozen)
        "Parameters no step changes (gradient zeroed, lr and weight decay multiplied by 0)."
        self.scaled = (tuple(scaled[0]), float(scaled[1]))
        "Parameters whose learning rate and weight decay are a multiple of the others' (params, mult)."
        if any(id(p) not in own for p in (*self.frozen, *self.scaled[0])):
            raise ValueError(
                "Optimizer(frozen=..., scaled=...) takes trainable parameters of the model it steps"
            )
        if {id(p) for p in self.frozen} & {id(p) for p in self.scaled[0]}:
            raise ValueError("Optimizer: a parameter is both frozen and scaled")
        mcfg = _megatron_config(cfg, model, self.distributed)
        use_foreach_multi_tensor()
        with cuda_as_cpu():
            self.opt = get_megatron_optimizer(
                mcfg, [self.ddp], config_overrides=_group_overrides(mcfg, self.frozen, self.scaled)
            )
        log.info(
            "optimizer: %s; overlap_grad_reduce %s, overlap_param_gather %s, distributed %s",
            _fuse_adam(self.inner),
            *_ddp_key(cfg, info)[2:4],
            self.distributed,
        )
        self.step_count = 0
        self.lr_scale = 1.0  # lowered by the collapse sentinel's rollback
        self._synced = False
        self._offload = HostOffload()
        self.zero_grad()

    @property
    def inner(self) -> list:
        """The megatron optimizers (dense, then experts) behind the chained one."""
        return list(getattr(self.opt, "chained_optimizers", [self.opt]))

    def micro_batches(self, items):
        """Yield ``items`` (micro-batches); backward passes of all but the last run under DDP's
        ``no_sync``, so an overlapped reduction starts once, after the last backward."""
        items = list(items)
        for i, item in enumerate(items):
            with self.ddp.no_sync() if i < len(items) - 1 else contextlib.nullcontext():
                yield item

    def zero_grad(self) -> None:
        """Clear DDP's grad buffers and the optimizer's main gradients."""
        self.ddp.zero_grad_buffer()
        with cuda_as_cpu():
            self.opt.zero_grad()
        self._synced = False

    def finish_grad_sync(self) -> None:
        """Reduce the accumulated gradients (DDP buckets, then sequence-parallel parameters over
        TP): ``param.main_grad`` then holds the global gradient (this rank's shard of it, when
        distributed). Once per step, after the last backward: :meth:`step` calls it if not yet called."""
        from megatron.core.distributed import finalize_model_grads

        if not self._synced:
            finalize_model_grads([self.ddp])
            self._synced = True

    def _set_schedule(self, lr: float) -> None:
        for opt in self.inner:
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)

    def _clip(self, norm: float) -> None:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for opt in self.inner:
            params = opt.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, self.cfg.grad_clip, norm)

    def step(self) -> dict[str, float]:
        """Reduce, clip and apply the gradients; skip (and report) a non-finite step."""
        lr = lr_at(self.cfg, self.step_count) * self.lr_scale
        self.finish_grad_sync()
        for p in self.frozen:  # out of the norm and of Adam's moments; lr_mult 0 leaves them as they are
            p.main_grad.zero_()
        with cuda_as_cpu():
            self._set_schedule(lr)
            found_inf = self.opt.prepare_grads()  # copies grads to the main weights (fp32)
            norm = float(self.opt.get_grad_norm() or 0.0)  # global: all ranks agree
            finite = not found_inf and math.isfinite(norm)
            if finite:
                if self.cfg.grad_clip > 0:
                    self._clip(norm)
                self.opt.step_with_ready_grads()  # also all-gathers the weights when distributed
                self.step_count += 1
        self.zero_grad()
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0 if finite else 1.0}

    def sharded_state_dict(self, model_sharded_state_dict: dict, *, is_loading: bool) -> dict:
        """The optimizer's dist_checkpointing state: Adam moments and fp32 main weights as
        ShardedTensors shaped like the model's, so it reshards across TP, EP and DP.

        The distributed optimizer uses its ``fully_reshardable`` format (gathered over DP at save):
        megatron-core 0.16.1 rejects the flattened ShardedTensors of ``fully_sharded_model_space``.
        """
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        if is_loading:
            self._materialise_state()
        with cuda_as_cpu():
            return self.opt.sharded_state_dict(
                model_sharded_state_dict, is_loading=is_loading, metadata=metadata
            )

    @torch.no_grad()
    def _materialise_state(self) -> None:
        """Give a fresh optimizer its Adam state (zero moments) to load into: one step at lr 0 with
        zero gradients, which changes no weight (the distributed optimizer's ``state_dict`` needs
        a step count to exist)."""
        for opt in self.inner:
            inner = opt.optimizer
            if inner.state:
                continue
            lrs = [group["lr"] for group in inner.param_groups]
            for group in inner.param_groups:
                group["lr"] = 0.0
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            inner.step()
            for group, lr in zip(inner.param_groups, lrs):
                group["lr"] = lr
                for p in group["params"]:
                    p.grad = None

    def load_state_dict(self, state: dict, step_count: int) -> None:
        """Load what :meth:`sharded_state_dict` described, as ``dist_checkpointing.load`` returns it.

        Adam's step count is set from ``step_count``, the number of applied updates, in whichever
        layout the optimizer keeps it (:func:`_set_adam_step`): megatron-core's loaders restore torch
        Adam's per-parameter ``step`` as one tensor shared by all parameters (then advanced once per
        parameter at each step), and FusedAdam's param-group ``step`` comes from the loading
        optimizer's own param groups (``checkpoint._own_common``), i.e. 1 after a fresh start's
        :meth:`_materialise_state` or the live count on a rollback, never the checkpoint's.
        """
        with cuda_as_cpu():
            self.opt.load_state_dict(state)
        for opt in self.inner:
            _set_adam_step(opt.optimizer, step_count)
        self.step_count = step_count

    # -- in-memory copies: one state, several continuations ---------------------------------------
    def snapshot(self) -> dict:
        """A copy of this optimizer's whole state in memory, for :meth:`restore`: Adam's moments and
        step counts, the fp32 main weights of bf16 parameters, ``step_count`` and ``lr_scale``.
        Later steps leave it as it was. The model's weights are not in it (fp32 parameters are their
        own main weights): copy them with the policy's ``state_dict``.

        The non-distributed optimizer only: the distributed one keeps its state in shards across
        data-parallel ranks (save a checkpoint instead)."""
        if self.distributed:
            raise NotImplementedError(
                "Optimizer.snapshot: the distributed optimizer (optim.distributed) keeps its state in "
                "shards across data-parallel ranks; save a checkpoint instead (moe_rl.megatron.checkpoint)"
            )
        with cuda_as_cpu():
            state = copy.deepcopy(self.opt.state_dict())
        return {"optimizer": state, "step_count": self.step_count, "lr_scale": self.lr_scale}

    def restore(self, snapshot: dict) -> None:
        """Back to the state :meth:`snapshot` copied, gradients cleared; the snapshot stays as it
        was (restore it again for the next continuation). Load the model's weights first: with bf16
        parameters the restored fp32 main weights are what the next step updates."""
        with cuda_as_cpu():
            self.opt.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        self.step_count = int(snapshot["step_count"])
        self.lr_scale = float(snapshot["lr_scale"])
        self.zero_grad()

    # -- colocated engines: the trainer's memory given up while they work -------------------------
    def release_memory(self, *, weights: bool) -> int:
        """Free this rank's gradients (DDP's grad buffers, clear between steps: no copy), Adam
        moments and fp32 main weights and, with ``weights``, the model's weights (copied to host
        memory) for a colocated engine; the bytes freed. :meth:`resume_memory` takes them back.
        Call it between optimizer steps (after :meth:`step`, whose gradients are then cleared)."""
        model = list(self.ddp.module.parameters())
        model_storages = {p.untyped_storage().data_ptr() for p in model}
        grads = [b.grad_data for b in self.ddp.buffers + self.ddp.expert_parallel_buffers]
        state = [
            t
            for opt in self.inner
            for t in [
                *(p for g in opt.optimizer.param_groups for p in g["params"]),
                *(v for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)),
            ]
            if t.untyped_storage().data_ptr() not in model_storages  # fp32: the weights are the main ones
        ]
        freed = self._offload.release(grads, keep_values=False)
        return freed + self._offload.release(state + (model if weights else []))

    def resume_memory(self) -> int:
        """Everything :meth:`release_memory` freed, back on the device as it was (gradients zero)."""
        return self._offload.resume()

    @property
    def released_bytes(self) -> int:
        """Device bytes :meth:`release_memory` holds on the host now."""
        return self._offload.released_bytes

    def reload_model_params(self) -> None:
        """Copy the model's weights into the fp32 main weights (after they were set from outside)."""
        with cuda_as_cpu():
            self.opt.reload_model_params()

    def reset(self) -> None:
        """Back to a fresh optimizer on the model's current weights: no Adam moments, step 0."""
        for opt in self.inner:
            opt.optimizer.state.clear()
            _set_adam_step(opt.optimizer, 0)  # FusedAdam's step lives in the param groups
        self.reload_model_params()  # fp32 main weights of bf16 parameters
        self.step_count = 0
