"""A second device on a CPU-only machine, for tests: which tensors would live on the accelerator,
and every op that would mix them with host tensors (what CUDA refuses).

CPU torch has one real device, so a test cannot put the policy on a GPU and the engine's batch
on the host and watch the first RL step fail. :class:`DeviceLedger` keeps the books instead: a
torch function mode that tags every tensor it sees made as *device* (on :data:`ACCEL`, the
pretend accelerator: ``torch.device("cpu", 0)``, or ``"cuda"``) or *host* (made without a device,
on ``"cpu"``, from numpy, or by ``.cpu()``), propagates the tags through every torch call, and
records each call that takes a device tensor and a host tensor of more than one element, as CUDA
would raise "Expected all tensors to be on the same device". The CUDA rules it follows:

- a host tensor with zero dimensions may join device tensors (CUDA takes CPU scalars);
- ``copy_`` and ``to`` move data across devices; indexing a device tensor with host indices is
  allowed, the reverse is not;
- ``numpy()`` of a device tensor fails.

A ``torch.device("cpu")`` object is what ``t.device`` returns for every tensor here, so a
tensor made or moved there (``.to(x.device)``, ``device=x.device``: on CUDA, wherever x is)
carries no tag. Tensors it never saw made (autograd's gradients, megatron's internals before the ledger opened)
carry no tag and are never counted as mixing; the seeds (``device_tensors``: a model's
parameters and buffers) start on the device. ``Tensor.to(ACCEL)`` of a host tensor returns a
copy, as a real move does (on the CPU it would alias the host tensor and retag it).

Use: point the code's device at :data:`ACCEL` (``ParallelInfo.device``, and
``torch.cuda.current_device`` for megatron-core's own buffers), then
``with DeviceLedger(model.parameters()) as ledger: ...`` and assert ``ledger.mixes == []``;
``ledger.on_device(t)`` tells a collective's check whether ``t`` is where NCCL needs it.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

ACCEL = torch.device("cpu", 0)
"The pretend accelerator: CPU memory, but a device distinct from the host's ``cpu``."

DEVICE, HOST = "device", "host"
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_COPIES = {torch.Tensor.copy_}
#: calls that read a device tensor's values on the host: CUDA waits for the device (a sync)
_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
#: ops whose output size depends on a device tensor's values: CUDA reads them back first
_DATA_DEPENDENT = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.bincount,
    torch.Tensor.bincount,
}


@dataclass
class Mix:
    """One call that would mix devices: the function, the shapes on each side, and where."""

    func: str
    device_shapes: list[tuple[int, ...]]
    host_shapes: list[tuple[int, ...]]
    where: str

    def __str__(self) -> str:
        return f"{self.func}: device {self.device_shapes} with host {self.host_shapes} at {self.where}"


def _kind_of(device: Any) -> str | None:
    """The tag of a tensor made on ``device``: None for a ``torch.device("cpu")`` object, which is
    what ``t.device`` of any tensor here returns (``.to(x.device)`` moves to wherever x is)."""
    if isinstance(device, torch.device) and device == torch.device("cpu"):
        return None
    d = torch.device(device)
    return DEVICE if d.type == "cuda" or d == ACCEL else HOST


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _bool_index(index) -> bool:
    """Whether ``index`` (of ``t[index]``) holds a boolean mask tensor (its count is data-dependent)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _caller() -> str:
    """The innermost frame of moe-rl's own code (else the innermost non-torch frame)."""
    frames = [f for f in traceback.extract_stack()[:-3] if "device_ledger" not in f.filename]
    ours = [f for f in frames if "/moe_rl/" in f.filename or "/kernels/" in f.filename]
    f = (ours or [f for f in frames if "/torch/" not in f.filename] or frames)[-1]
    return f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno} ({f.name})"


class DeviceLedger(TorchFunctionMode):
    """Tags tensors device / host and records every call that mixes them (module docstring)."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._tags = WeakIdKeyDictionary()
        self.mixes: list[Mix] = []
        self.reads: list[Mix] = []
        "Device-to-host reads (syncs on CUDA): values read on the host, or data-dependent shapes."
        for t in device_tensors:
            self._tags[t] = DEVICE

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on the pretend accelerator."""
        return self._tags.get(t) == DEVICE

    def tag(self, t: torch.Tensor) -> str | None:
        return self._tags.get(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tags = [self._tags.get(t) for t in tensors]
        if (
            tags
            and tags[0] == DEVICE
            and (
                func in _READS
                or func in _DATA_DEPENDENT
                or (
                    func is torch.repeat_interleave
                    and isinstance(args[0], torch.Tensor)
                    and "output_size" not in kwargs
                )
                or (func is torch.Tensor.__getitem__ and _bool_index(args[1] if len(args) > 1 else None))
            )
        ):
            self.reads.append(Mix(_name(func), [tuple(tensors[0].shape)], [], _caller()))
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if func is torch.Tensor.numpy and tags and tags[0] == DEVICE:
            self._record(func, tensors[:1], [])
        elif func not in _COPIES:
            self._check(func, args, tensors, tags)
        out = func(*args, **kwargs)
        explicit = kwargs.get("device")
        if explicit is not None:
            kind = _kind_of(explicit)
            if kind is None:
                return out
        elif DEVICE in tags:
            kind = DEVICE
        elif HOST in tags or not tensors:
            kind = HOST  # made from host tensors, or from Python values without a device
        else:
            return out  # only untagged inputs: nothing known
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and not any(o is t for t in tensors):  # in place keeps its tag
                self._tags[o] = kind
        return out

    def _check(self, func, args, tensors, tags) -> None:
        device = [t for t, k in zip(tensors, tags) if k == DEVICE]
        host = [t for t, k in zip(tensors, tags) if k == HOST and t.dim() > 0]
        if not device or not host:
            return
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and self._tags.get(args[0]) == DEVICE:
            # host indices into a device tensor are fine; a host value assigned into it is not
            value = args[2] if func is torch.Tensor.__setitem__ else None
            if not any(value is h for h in host):
                return
            host = [value]
        self._record(func, device, host)

    def _record(self, func, device: list[torch.Tensor], host: list[torch.Tensor]) -> None:
        self.mixes.append(
            Mix(_name(func), [tuple(t.shape) for t in device], [tuple(t.shape) for t in host], _caller())
        )

    def _move(self, func, args, kwargs):
        src = args[0]
        if func is torch.Tensor.cpu:
            kind = HOST
        elif func is torch.Tensor.cuda:
            kind = DEVICE
        else:
            kind = self._tags.get(src)
            for a in (*args[1:], kwargs.get("device"), kwargs.get("other")):
                if isinstance(a, torch.Tensor):
                    kind = self._tags.get(a)
                elif isinstance(a, (str, torch.device)):
                    kind = _kind_of(a)  # None: to `x.device`, wherever x is
        if kind == HOST and self._tags.get(src) == DEVICE:
            self.reads.append(Mix(_name(func), [tuple(src.shape)], [], _caller()))
        out = src if func is torch.Tensor.cuda else func(*args, **kwargs)  # CPU torch has no .cuda()
        if out is src and kind != self._tags.get(src):
            out = src.clone()  # a real move makes a new tensor; on the CPU `to` would alias src
        if kind is None:
            self._tags.pop(out, None)
        else:
            self._tags[out] = kind
        return out


# -- the RL step's run on the pretend accelerator (unit and dist tiers) -----------------------------
def run_on_accel(out_dir, algo: dict, monkeypatch, **sections):
    """A Run of ``tests.tiny.TINY_RL`` (``algo``; ``sections`` merged in) whose policy, engine, megatron-core
    buffers and collectives use :data:`ACCEL`; its optimizer and engine are built."""
    import dataclasses

    from moe_rl import dist
    from moe_rl.trainer.run import Run
    from tests.tiny import tiny_rl_recipe

    run = Run(tiny_rl_recipe(out_dir, algo=algo, **sections))
    run.make_optimizer("rl")
    run.ensure_engine()
    info = dataclasses.replace(run.info, device=ACCEL)
    run.info = run.policy.info = run.engine.policy.info = info
    run.engine.device = ACCEL
    monkeypatch.setattr(torch.cuda, "current_device", lambda: ACCEL)  # megatron-core's buffers
    monkeypatch.setattr(dist, "group_device", lambda group=None: ACCEL)  # as NCCL's is CUDA
    return run


def check_collectives(
    monkeypatch, ledger: DeviceLedger, module: Any, names: tuple[str, ...], ok
) -> list[str]:
    """Wrap ``module``'s collectives ``names``: each records the tensors ``ok(ledger, t)`` refuses."""
    off: list[str] = []

    def checked(fn, name):
        def wrapper(t, *args, **kwargs):
            for x in t if isinstance(t, (list, tuple)) else [t]:
                if isinstance(x, torch.Tensor) and not ok(ledger, x):
                    off.append(f"{name} of {tuple(x.shape)} ({ledger.tag(x)}) at {_caller()}")
            return fn(t, *args, **kwargs)

        return wrapper

    for name in names:
        monkeypatch.setattr(module, name, checked(getattr(module, name), name))
    return off
