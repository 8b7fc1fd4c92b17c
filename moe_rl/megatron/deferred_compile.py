"""megatron-core's import-time ``torch.compile`` taken at a function's first call rather than at
import, and only where a compiled kernel runs (docs/megatron_cpu.md#jit-fuser).

megatron-core applies ``torch.compile`` to about fifty functions as it is imported (its
``megatron.core.jit.jit_fuser``; 0.19 also decorates a router method directly), and
``torch.compile`` imports torch's dynamo and inductor: 1.6 s of the 4.3 s a process took to import
megatron-core 0.16.1 on the 2-core CPU machine, paid by every rank and every ``moe-rl`` command. One
of the functions, the router's ``_apply_expert_bias`` (nothing to do unless expert bias is on), runs
in every router forward, so every process also traced it with dynamo and checked its guards at each
call. The kernels megatron-core compiles are Triton's: compiled on CUDA with Triton
(:func:`compile_here`, the rule :func:`moe_rl.megatron.model.fusions` applies to
``bias_activation_fusion``), and elsewhere the function runs as written, as megatron-core's own
``disable_jit_fuser`` makes it. Values are the function's either way.

:func:`install` (run by importing :mod:`moe_rl.megatron`, which every module that imports
megatron-core here is part of; this module imports no third-party package, torch included) adds an
import hook: while a module of megatron-core runs its import, ``torch.compile`` applied to one of
megatron-core's functions returns :func:`deferred`'s wrapper (``jit_fuser``, bound to
``torch.compile`` then, keeps it); anything else gets ``torch.compile`` itself. Modules of megatron-core imported before :mod:`moe_rl.megatron` keep the ``torch.compile``
they applied (the same values, the import's cost already paid).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Callable, Iterator

PACKAGE = "megatron.core"


@functools.cache
def compile_here() -> bool:
    """Whether megatron-core's ``torch.compile`` makes a kernel here: CUDA and an importable Triton."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a Triton broken for this driver
        return False
    return True


def deferred(compile_fn: Callable) -> Callable:
    """``torch.compile`` for megatron-core's functions: a function of a ``megatron.`` module, at its
    first call, becomes ``compile_fn(fn, **options)`` where :func:`compile_here`, else stays ``fn``;
    anything else (a module, a function of another package) is ``compile_fn``'s at once."""

    def fuser(fn: Callable | None = None, **options):
        if fn is None:  # @torch.compile(mode=...)
            return lambda f: fuser(f, **options)
        if not (inspect.isfunction(fn) and (fn.__module__ or "").startswith("megatron.")):
            return compile_fn(fn, **options)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if call.chosen is None:
                call.chosen = compile_fn(fn, **options) if compile_here() else fn
            return call.chosen(*args, **kwargs)

        call.deferred_compile = compile_fn
        call.chosen = None  # what runs, from the first call: the compiled function or fn itself
        return call

    fuser.deferred_compile = compile_fn
    return fuser


@contextlib.contextmanager
def compile_deferred() -> Iterator[None]:
    """``torch.compile`` as :func:`deferred` makes it, for the block (nested blocks share it)."""
    import torch

    real = torch.compile
    if hasattr(real, "deferred_compile"):
        yield
        return
    torch.compile = deferred(real)
    try:
        yield
    finally:
        torch.compile = real


class _MegatronImports(importlib.abc.MetaPathFinder):
    """Finds each module of megatron-core as the path finder does and runs its import inside
    :func:`compile_deferred`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # an unusual install: megatron-core's own import
        run = spec.loader.exec_module

        def exec_module(module):
            with compile_deferred():
                run(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Add the import hook (idempotent)."""
    if not any(isinstance(f, _MegatronImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronImports())
