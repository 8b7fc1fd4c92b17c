"""Faults at the n-th write: count the writes a call makes, then fail each one in turn.

A *write* is one call that changes the file system, counted in this process only (forked
helpers, such as megatron-core's checkpoint writers, write uncounted) and once per outermost call
(``shutil.rmtree``'s unlinks, ``torch.save``'s own open are one write):

- ``open``/``io.open``/``Path.open`` in a writing mode (``w``, ``a``, ``x``, ``+``), ``os.open`` with
  a writing flag, and every ``write`` to a file opened for appending (``metrics.jsonl``'s rows);
- ``os.write``; ``os.replace``/``os.rename`` (``Path.replace``/``rename``); ``os.unlink``/``os.remove``/
  ``os.rmdir``/``shutil.rmtree``; ``os.mkdir`` (``Path.mkdir``) of a path that does not exist;
- ``torch.save`` and ``safetensors.torch.save_file`` (their C++/Rust writers open no Python file).

The fault at write n (:func:`fault_at`) is one of

- ``raise``: :class:`InjectedFault` before the write (a bug or an interrupt at that line);
- ``enospc``: the write starts and the disk is full: an open for writing creates or truncates its
  file, a file write or a ``torch.save``/``save_file``/``os.write`` leaves half of its bytes, then
  ``OSError(ENOSPC)``; a rename, removal or mkdir fails before it happens;
- ``kill``: what ``enospc`` leaves, then SIGKILL of this process (for a child process:
  :func:`child_command` runs ``moe-rl`` with the fault from :data:`ENV`).

    writes = count_writes(lambda: save(...))          # ["open .../x.tmp (w)", "replace ...", ...]
    for n in range(1, len(writes) + 1):
        with fault_at(n, "enospc"), pytest.raises(OSError):
            save(...)
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

KINDS = ("raise", "enospc", "kill")
ENV = "MOE_RL_TEST_FAULT"
"``<n>:<kind>`` (or ``count:<path>``) in a child's environment: :func:`install_from_env`."
_WRITING_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class InjectedFault(RuntimeError):
    """The ``raise`` fault: an exception at the n-th write."""


class Faults:
    """The counter the patched functions report to; ``fail_at`` None counts only."""

    def __init__(self, fail_at: int | None = None, kind: str = "raise"):
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r}: one of {KINDS}")
        self.fail_at, self.kind = fail_at, kind
        self.writes: list[str] = []
        "Every write seen, in order (what, path)."
        self.fired: str | None = None
        "The write that failed, once it did."
        self.pid = os.getpid()
        self._inside = threading.local()

    @contextlib.contextmanager
    def write(self, what: str, torn: Callable[[], object] | None = None) -> Iterator[bool]:
        """Around one write: counts it (not the writes it makes itself) and fails it when it is the
        n-th. ``torn``: what ``enospc`` and ``kill`` leave of it. Yields whether it is counted."""
        if os.getpid() != self.pid or getattr(self._inside, "depth", 0):
            yield False
            return
        self.writes.append(what)
        if len(self.writes) == self.fail_at:
            self.fired = what
            self.fail(what, torn)
        self._inside.depth = 1
        try:
            yield True
        finally:
            self._inside.depth = 0

    def fail(self, what: str, torn: Callable[[], object] | None) -> None:
        n = len(self.writes)
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at write {n}: {what}")
        if torn is not None:
            self._inside.depth = 1
            try:
                torn()
            finally:
                self._inside.depth = 0
        if self.kind == "kill":
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at write {n}: {what})")


_ACTIVE: list[Faults] = []


def _faults() -> Faults | None:
    return _ACTIVE[-1] if _ACTIVE else None


class _AppendFile:
    """A file opened for appending: each ``write`` is a write (torn: half of it lands)."""

    def __init__(self, f, name: str):
        self._f, self._name = f, name

    def write(self, data):
        faults = _faults()
        if faults is None:
            return self._f.write(data)

        def torn():
            self._f.write(data[: len(data) // 2])
            self._f.flush()

        with faults.write(f"append {self._name}", torn):
            return self._f.write(data)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _patched(real: dict) -> dict:
    """Wrappers of the write functions, around ``real`` (name -> the original)."""

    def open_(file, mode="r", *args, **kw):
        faults = _faults()
        if faults is None or not any(c in mode for c in "wax+") or isinstance(file, int):
            return real["open"](file, mode, *args, **kw)

        def torn():
            if "r" not in mode:  # w, x, a: created (and for w truncated) before the disk filled
                real["open"](file, mode.replace("x", "w"), *args, **kw).close()

        with faults.write(f"open {file} ({mode})", torn) as counted:
            f = real["open"](file, mode, *args, **kw)
        return _AppendFile(f, str(file)) if counted and "a" in mode else f

    def os_open(path, flags, *args, **kw):
        faults = _faults()
        if faults is None or not flags & _WRITING_FLAGS:
            return real["os.open"](path, flags, *args, **kw)

        def torn():
            os.close(real["os.open"](path, flags & ~os.O_EXCL, *args, **kw))

        with faults.write(f"os.open {path}", torn):
            return real["os.open"](path, flags, *args, **kw)

    def os_write(fd, data):
        faults = _faults()
        if faults is None:
            return real["os.write"](fd, data)
        with faults.write(f"os.write fd {fd}", lambda: real["os.write"](fd, bytes(data)[: len(data) // 2])):
            return real["os.write"](fd, data)

    def plain(key: str):
        def call(*args, **kw):
            faults = _faults()
            if faults is None or (key == "os.mkdir" and os.path.lexists(args[0])):  # EEXIST: no change
                return real[key](*args, **kw)
            with faults.write(f"{key} {' -> '.join(str(a) for a in args[:2])}"):
                return real[key](*args, **kw)

        return call

    def bytes_writer(key: str, to_bytes: Callable):
        def call(obj, path, *args, **kw):
            faults = _faults()
            if faults is None or not isinstance(path, (str, os.PathLike)):
                return real[key](obj, path, *args, **kw)

            def torn():
                data = to_bytes(obj, *args, **kw)
                with real["open"](path, "wb") as f:
                    f.write(data[: len(data) // 2])

            with faults.write(f"{key} {path}", torn):
                return real[key](obj, path, *args, **kw)

        return call

    def torch_bytes(obj, *args, **kw):
        import torch

        buf = io.BytesIO()
        torch.serialization.save(obj, buf)  # the original (patched name is torch.save)
        return buf.getvalue()

    def safetensors_bytes(tensors, *args, **kw):
        from safetensors.torch import save

        return save(tensors, metadata=kw.get("metadata"))

    out = {"open": open_, "os.open": os_open, "os.write": os_write}
    out |= {
        k: plain(k) for k in ("os.replace", "os.rename", "os.unlink", "os.remove", "os.rmdir", "os.mkdir")
    }
    out |= {"shutil.rmtree": plain("shutil.rmtree")}
    out["torch.save"] = bytes_writer("torch.save", torch_bytes)
    out["safetensors.torch.save_file"] = bytes_writer("safetensors.torch.save_file", safetensors_bytes)
    return out


def _targets() -> dict[str, tuple[object, str]]:
    """name -> (owner object, attribute) of every patched function."""
    import safetensors.torch
    import torch

    t = {"open": (builtins, "open"), "io.open": (io, "open")}
    t |= {
        f"os.{n}": (os, n)
        for n in ("open", "write", "replace", "rename", "unlink", "remove", "rmdir", "mkdir")
    }
    t |= {"shutil.rmtree": (shutil, "rmtree"), "torch.save": (torch, "save")}
    t["safetensors.torch.save_file"] = (safetensors.torch, "save_file")
    return t


@contextlib.contextmanager
def _installed(faults: Faults) -> Iterator[Faults]:
    targets = _targets()
    real = {name: getattr(obj, attr) for name, (obj, attr) in targets.items()}
    real["open"] = real["io.open"] = builtins.open
    wrappers = _patched(real)
    wrappers["io.open"] = wrappers["open"]
    _ACTIVE.append(faults)
    for name, (obj, attr) in targets.items():
        setattr(obj, attr, wrappers[name])
    try:
        yield faults
    finally:
        for name, (obj, attr) in targets.items():
            setattr(obj, attr, real[name])
        _ACTIVE.remove(faults)


def count_writes(fn: Callable[[], object]) -> list[str]:
    """The writes ``fn()`` makes, in order (it runs once, unfaulted)."""
    with _installed(Faults()) as faults:
        fn()
    return faults.writes


@contextlib.contextmanager
def fault_at(n: int, kind: str = "raise") -> Iterator[Faults]:
    """Fail the ``n``-th write made inside the block (1-based) with ``kind`` (module docstring)."""
    with _installed(Faults(n, kind)) as faults:
        yield faults


def snapshot(root: Path) -> dict[str, bytes]:
    """``{relative path: bytes}`` of every file under ``root``."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


_CHILD: list = []
"The child's planted context (kept referenced: a collected one would unpatch)."


def install_from_env() -> None:
    """In a child process: plant the fault named by :data:`ENV` (``<n>:<kind>``) for the rest of it,
    or with ``count:<path>`` count its writes and write them to ``path`` (JSON) when it exits."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    n, arg = spec.split(":", 1)
    planted = _installed(Faults(None if n == "count" else int(n), "raise" if n == "count" else arg))
    _CHILD.append(planted)
    faults = planted.__enter__()
    if n == "count":
        import atexit
        import json

        atexit.register(lambda: Path(arg).write_text(json.dumps(faults.writes)))


def child_command(*args: str, module: str = "moe_rl.cli") -> list[str]:
    """argv of ``python -m <module> ARGS`` with the fault of :data:`ENV` planted first."""
    code = (
        "import sys, runpy; from tests.crash import install_from_env; install_from_env(); "
        f"sys.argv = [{module!r}, *sys.argv[1:]]; runpy.run_module({module!r}, run_name='__main__')"
    )
    return [sys.executable, "-c", code, *args]
