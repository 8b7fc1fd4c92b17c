"""One owner per run folder: ``moe-rl train`` holds ``<train.out_dir>/.moe-rl.lock`` while it runs,
and the same lock in its checkpoint folder (``checkpoint.dir``); ``moe-rl compare`` / ``demo`` hold
their ``--out`` for the whole command.

A second ``train`` into the folder of a running one used to be accepted when the first had no
checkpoint yet: ``metrics.jsonl`` interleaved two runs and ``recipe.yaml`` was the second's while
``latest`` was the first's. The lock is taken before anything is written into the folder, by the
first rank only (the ranks of one run share the folder):

- an exclusive ``flock`` on the lock file, held while the run runs: the kernel lets it go when the
  holder ends however it ends (``kill -9`` included), so a lock left by a dead run is simply taken
  over (with a warning naming the old holder); a run that ends normally removes the file;
- the file says who holds it (pid, host, start time, command), so a refusal is one line naming the
  holder and the fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from moe_rl.errors import PathError

log = logging.getLogger(__name__)

LOCK = ".moe-rl.lock"
"The lock file's name inside ``train.out_dir``."


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(h: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
    return f"pid {h.get('pid', '?')} on {h.get('host', '?')} since {since} ({h.get('command', '?')})"


@contextlib.contextmanager
def hold_run_dir(
    out_dir: str | Path, *, rank: int | None = None, what: str = "train.out_dir"
) -> Iterator[Path | None]:
    """Hold ``out_dir`` for this run (rank 0 only; other ranks yield None): a :class:`PathError`
    naming the holder when another live process holds it (``what``: the folder's name in it, e.g.
    ``checkpoint.dir`` or ``compare --out``)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        yield None
        return
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    try:
        fd = _lock(path, out, what)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    try:
        old = _holder(path)
        if old.get("pid") is not None:
            log.warning(
                "%s: taking over the lock of a run that ended without releasing it: %s", out, _describe(old)
            )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still held: whoever opens the path next gets a new file
        os.close(fd)  # releases the flock
        if created:  # a run refused before writing anything leaves no folder behind
            with contextlib.suppress(OSError):
                out.rmdir()


def _lock(path: Path, out: Path, what: str) -> int:
    """An fd of ``path`` holding its exclusive flock; the file is the one at ``path`` still (a
    holder that released and unlinked it between our open and our flock leaves us a dead inode:
    open again)."""
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(path)
            os.close(fd)
            raise PathError(
                f"{what} {out} is in use by another run: {_describe(holder)}; wait for it, "
                f"stop it (SIGTERM saves a checkpoint), or give another {what}"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise PathError(f"{what} {out}: could not take {LOCK}: another process keeps replacing it")


def held_by(out_dir: str | Path) -> dict | None:
    """The holder of ``out_dir``'s lock (pid, host, since, command) while a live process holds it,
    else None. Takes nothing: a free lock is released at once."""
    path = Path(out_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(path) or {"pid": "?"}
    finally:
        os.close(fd)  # releases a shared lock we took
    return None
