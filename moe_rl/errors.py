"""The user-error type every ``moe-rl`` command turns into one line on stderr.

A :class:`UserError` is a mistake the user can fix (a recipe field, a path, a data file, a
reward function): the CLI prints ``moe-rl: <kind>: <message>`` and exits with code 2, with no
traceback unless ``-v`` is given. Anything else is a bug in moe-rl and keeps its traceback.
Messages name the field, file or record and say the fix.
"""

from __future__ import annotations

import errno
import os
import signal


class UserError(ValueError):
    """A user mistake: shown as one line (``kind`` is its label), exit code 2."""

    kind = "error"


class PathError(UserError):
    """A path that is missing, of the wrong kind, or owned by something else (e.g. a run)."""

    kind = "path error"


class DataError(UserError):
    """A data file or record that cannot be used; the message names the file and line."""

    kind = "data error"


class Unavailable(Exception):
    """An outside service the command needs is down or stopped answering (an SGLang server, its
    router): shown as one ``moe-rl: unavailable: ...`` line, exit code 2. The message names it."""


class StopRequested(Exception):
    """A stop signal (SIGTERM, SIGINT, SIGHUP) ended the command at a safe point (after a training
    step, with its checkpoint; after the runs it waited on saved): one ``moe-rl: stopped: ...``
    line and exit code 128 + the signal's number (the shell's "ended by this signal")."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class Interrupted(BaseException):
    """A stop signal that arrived where no step loop waits for one (loading, building the model,
    an export, a report, a server shutting down): raised at once by the handler every ``moe-rl``
    command installs (:func:`moe_rl.argparsing.one_line_errors`). A ``BaseException``, as
    ``KeyboardInterrupt``, so no ``except Exception`` swallows it; every write it can cut is atomic
    (a temp file or folder renamed into place, removed when cut), so nothing is left half-written."""

    def __init__(self, signum: int):

        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum
        self.exit_code = 128 + signum


DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "[Errno 28]", "[Errno 122]")
"""How a full disk reads when a library wraps its OSError in its own exception (megatron-core's and
torch.distributed.checkpoint's writer workers: ``CheckpointException`` of ``RuntimeError``s)."""


def wrapped_exceptions(e: BaseException | None):
    """``e`` and every exception it wraps, each once: its cause and context and, for torch's
    ``CheckpointException``, every rank's failure (``failures``: rank -> exception or (exception,
    traceback)), and theirs in turn."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        failures = getattr(x, "failures", None)
        for f in failures.values() if isinstance(failures, dict) else ():
            todo += [v for v in (f if isinstance(f, tuple) else (f,)) if isinstance(v, BaseException)]
        todo += [x.__cause__, x.__context__]


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e``, or what it wraps (:func:`wrapped_exceptions`), is a full disk (ENOSPC,
    EDQUOT), however a library reported it."""
    for x in wrapped_exceptions(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(x)
        if any(w in text for w in DISK_FULL_WORDS) or (
            "inline_container" in text and ("unexpected pos" in text or "file write failed" in text)
        ):  # torch's file writer on a full disk
            return True
    return False


def disk_full_at(path: object) -> OSError:
    """The ``OSError`` (ENOSPC) a command's one line reads as "disk full writing <path>"."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
