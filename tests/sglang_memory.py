"""SGLang's own release and resume of a colocated engine's memory, on a stand-in memory saver.

:class:`SGLangMemory` runs the scheduler's ``release_memory_occupation`` and
``resume_memory_occupation`` (with ``_export_static_state`` / ``_import_static_state``), compiled
out of the wheel unpacked under ``.sglang/<version>`` (``make sglang-wheels``: 0.5.23's
``scheduler_components/weight_updater.py``, 0.5.11's scheduler mixin), on a namespace standing in
for the scheduler (one TP rank, idle when the server says so). Its ``memory_saver_adapter`` is
:class:`MemorySaver`, standing in for torch_memory_saver: pause and resume by tag, recording which
tags are resident. A paused region loses its contents unless SGLang made it with a CPU backup (the
weights' under ``--enable-weights-cpu-backup``): the stand-in zeroes the served model's parameters
then and, with the backup, restores them on resume. Pausing a paused tag or resuming an active one
raises (torch_memory_saver ends the process).

:func:`attach` routes a ``moe-rl serve`` :class:`~moe_rl.serve.http.ServerThread`'s two memory
endpoints through it, then through serve's own handlers (which refuse generation while memory is
released); a call SGLang's code fails answers 500 with its error.
"""

from __future__ import annotations
import __future__

import ast
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("0.5.11", "0.5.23")
SOURCES = {
    "0.5.23": "sglang/srt/managers/scheduler_components/weight_updater.py",
    "0.5.11": "sglang/srt/managers/scheduler_update_weights_mixin.py",
}
FUNCTIONS = (
    "release_memory_occupation",
    "resume_memory_occupation",
    "_export_static_state",
    "_import_static_state",
)
TAGS = ("weights", "kv_cache", "cuda_graph")


class _Torch:
    """torch for SGLang's functions, with one TP rank: no process group to wait for, no device sync."""

    distributed = SimpleNamespace(barrier=lambda *a, **k: None)

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def get_device_module():
        return SimpleNamespace(synchronize=lambda: None)


def sglang_functions(version: str) -> dict[str, Callable]:
    """:data:`FUNCTIONS` from SGLang ``version``'s own source (skips where it is not unpacked)."""
    root = ROOT / ".sglang" / version
    path = root / SOURCES[version]
    if not path.is_file():
        pytest.skip(f"SGLang {version}'s code is not in {root}: run `make sglang-wheels` (needs PyPI)")
    fns = [
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS
    ]
    assert sorted(f.name for f in fns) == sorted(FUNCTIONS), [f.name for f in fns]
    for f in fns:
        f.decorator_list = []
    ns: dict = {}
    exec(compile((root / "sglang/srt/constants.py").read_text(), "sglang/srt/constants.py", "exec"), ns)
    ns.update(
        torch=_Torch(),
        ReleaseMemoryOccupationReqOutput=SimpleNamespace,
        ResumeMemoryOccupationReqOutput=SimpleNamespace,
    )
    flags = __future__.annotations.compiler_flag
    exec(
        compile(ast.Module(body=fns, type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True), ns
    )
    return {name: ns[name] for name in FUNCTIONS}


class MemorySaver:
    """torch_memory_saver's ``pause(tag)`` / ``resume(tag)`` over one served model (module docstring);
    ``on_change(tags)`` is called with the resident tags after every change."""

    def __init__(self, model: torch.nn.Module, *, cpu_backup: bool, on_change: Callable[[set], None]):
        self.model, self.cpu_backup, self.on_change = model, cpu_backup, on_change
        self.resident = set(TAGS)
        self._backup: list[torch.Tensor] | None = None
        self.calls: list[tuple[str, str]] = []

    @torch.no_grad()
    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))
        if tag not in self.resident:
            raise RuntimeError(f"torch_memory_saver: pause of {tag!r}, which is paused")
        if tag == "weights":
            self._backup = [p.detach().clone() for p in self.model.parameters()] if self.cpu_backup else None
            for p in self.model.parameters():
                p.zero_()  # the freed region's contents are gone
        self.resident.discard(tag)
        self.on_change(set(self.resident))

    @torch.no_grad()
    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))
        if tag in self.resident:
            raise RuntimeError(f"torch_memory_saver: resume of {tag!r}, which is active")
        if tag == "weights" and self._backup is not None:
            for p, b in zip(self.model.parameters(), self._backup):
                p.copy_(b)
            self._backup = None
        self.resident.add(tag)
        self.on_change(set(self.resident))


class SGLangMemory:
    """SGLang ``version``'s scheduler memory calls over ``model`` (module docstring)."""

    def __init__(
        self,
        version: str,
        model: torch.nn.Module,
        *,
        cpu_backup: bool,
        is_idle: Callable[[], bool],
        on_change: Callable[[set], None] = lambda tags: None,
    ):
        self.fns = sglang_functions(version)
        self.saver = MemorySaver(model, cpu_backup=cpu_backup, on_change=on_change)
        self.scheduler = SimpleNamespace(
            scheduler=None,
            offload_tags=set(),
            memory_saver_adapter=self.saver,
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
            tp_cpu_group=None,
            is_fully_idle=lambda **kw: is_idle(),
            flush_cache=lambda *a, **kw: True,
            _assert_weight_cache_inactive=lambda op: None,
        )

    def release(self, tags: list[str] | None) -> None:
        self.fns["release_memory_occupation"](self.scheduler, SimpleNamespace(tags=tags))

    def resume(self, tags: list[str] | None) -> None:
        self.fns["resume_memory_occupation"](self.scheduler, SimpleNamespace(tags=tags))


def attach(server, memory: SGLangMemory) -> None:
    """``server``'s memory endpoints through ``memory``, then through its own handlers."""
    original = server.app.handle

    def handle(method, path, body):
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            tags = (body or {}).get("tags")
            try:
                (memory.release if path.startswith("/release") else memory.resume)(tags)
            except Exception as e:  # noqa: BLE001 - SGLang's scheduler would stop; the caller sees the call fail
                return 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        return original(method, path, body)

    server.app.handle = handle
