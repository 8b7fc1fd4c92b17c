"""megatron-core's ``torch.compile`` (``megatron.core.jit.jit_fuser``) taken at a function's first
call rather than at import, and only where a compiled kernel runs (docs/megatron_cpu.md#jit-fuser).

megatron-core applies ``jit_fuser`` (``torch.compile``) to about fifty functions as it is imported,
and ``torch.compile`` imports torch's dynamo and inductor: 1.6 s of the 4.3 s a process took to
import megatron-core on the 2-core CPU machine, paid by every rank and every ``moe-rl`` command.
One of the functions, the router's ``_apply_expert_bias`` (nothing to do unless expert bias is on),
runs in every router forward, so every process also traced it with dynamo and checked its guards
at each call. The kernels megatron-core compiles are Triton's: compiled on CUDA with Triton
(:func:`compile_here`, the rule :func:`moe_rl.megatron.model.fusions` applies to
``bias_activation_fusion``), and elsewhere the function runs as written, as megatron-core's own
``disable_jit_fuser`` makes it. Values are the function's either way.

:func:`install` (run by importing :mod:`moe_rl.megatron`, which every module that imports
megatron-core here is part of) adds an import hook that replaces ``jit_fuser`` as soon as
``megatron.core.jit`` has run, before any module of megatron-core applies it. When megatron-core
was imported before :mod:`moe_rl.megatron`, its functions keep the ``torch.compile`` applied at
import (the same values, the import's cost already paid).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable

import torch

JIT_MODULE = "megatron.core.jit"


@functools.cache
def compile_here() -> bool:
    """Whether megatron-core's ``torch.compile`` makes a kernel here: CUDA and an importable Triton."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a Triton broken for this driver
        return False
    return True


def deferred(compile_fn: Callable) -> Callable:
    """``jit_fuser`` in place of ``compile_fn`` (megatron-core's ``torch.compile``): each decorated
    function, at its first call, becomes ``compile_fn(fn)`` where :func:`compile_here`, else stays
    ``fn``."""

    def fuser(fn: Callable) -> Callable:
        chosen: list[Callable] = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not chosen:
                chosen.append(compile_fn(fn) if compile_here() else fn)
            return chosen[0](*args, **kwargs)

        call.deferred_compile = compile_fn
        return call

    fuser.deferred_compile = compile_fn
    return fuser


class _JitHook(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the path finder does and replaces its ``jit_fuser`` right
    after the module runs; once."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # an unusual install: megatron-core's own jit_fuser
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.jit_fuser = deferred(module.jit_fuser)

        spec.loader.exec_module = exec_module
        return spec


def install() -> bool:
    """Add the import hook unless megatron-core's ``jit`` module was imported already (idempotent);
    returns whether the hook is in place."""
    if JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(f, _JitHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitHook())
    return True


def remove() -> None:
    """Take the import hook out of ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _JitHook)]
