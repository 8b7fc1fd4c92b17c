"""The command line's shared parts, a leaf under ``moe_rl.cli`` and ``moe_rl.plan``.

:class:`ArgParser` (the house usage-error line), :func:`one_line_errors` (a user error, or a
full disk, becomes one ``moe-rl: <kind>: <message>`` line and exit code 2) and the count types of
the benchmarks' and studies' flags (:func:`int_at_least`). Only the standard
library and ``moe_rl.errors`` are imported, so both commands use them without importing each other.
"""

from __future__ import annotations

import argparse
import errno
import sys
import traceback
from collections.abc import Callable


class ArgParser(argparse.ArgumentParser):
    """argparse with the house error line: usage, then ``moe-rl: usage error: ...``; exit code 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"moe-rl: usage error: {self.prog}: {message}\n")


def one_line_errors(command: Callable[[], int], verbose: bool) -> int:
    """``command()``; a :class:`moe_rl.errors.UserError`, an outside service that is down
    (:class:`moe_rl.errors.Unavailable`) or a file-system ``OSError`` (full disk, read-only, permission,
    name too long, ...) becomes one line on stderr and exit code 2 (``verbose``: with its traceback);
    any other exception is a bug and keeps it."""
    from moe_rl.errors import Unavailable, UserError

    try:
        return command()
    except UserError as e:
        return _one_line(e.kind, str(e), verbose)
    except Unavailable as e:
        return _one_line(
            "unavailable", f"{e}: start it or check its log, then rerun (--resume continues a run)", verbose
        )
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {e.filename}" if e.filename else ""
            return _one_line(
                "disk full", f"no space left on the device{where}: free space or pick another folder", verbose
            )
        if e.errno is None or isinstance(e, ConnectionError):
            raise  # not a file-system error the user met: a bug, with its traceback
        return _one_line("file system", os_error_line(e), verbose)
    except RuntimeError as e:
        message = _torch_write_failure(e)
        if message is None:
            raise
        return _one_line("disk full", message, verbose)


OS_FIXES = {
    errno.EROFS: "the file system is read-only: pick a folder on a writable one",
    errno.EACCES: "permission denied: pick a folder you can write, or fix its permissions",
    errno.EPERM: "operation not permitted: pick another folder, or fix its permissions",
    errno.EEXIST: "it already exists: remove it or pick another path",
    errno.ENAMETOOLONG: "the name is too long for the file system: use a shorter path",
    errno.EBUSY: "the device or file is busy (in use by another process): retry once it is free",
    errno.ENOENT: "no such file or directory: check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "it is a folder where a file was expected: give a file path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.EIO: "input/output error: the disk or the network file system failed; check it",
    errno.EXDEV: "the path crosses file systems where a rename must not: keep the paths on one",
}
"The fix the one line names for an ``OSError``'s errno (others: the system's own words)."


def os_error_line(e: OSError) -> str:
    """``OSError`` -> ``<errno name> on <path>[ -> <path2>]: <fix>`` (the system's words when no fix is known)."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p)
    on = f" on {paths}" if paths else ""
    return f"{name}{on}: {OS_FIXES.get(e.errno, e.strerror or str(e))}"


def _one_line(kind: str, message: str, verbose: bool) -> int:
    """The user's one line on stderr (after the traceback with -v); exit code 2."""
    if verbose:
        traceback.print_exc()
    print(f"moe-rl: {kind}: {message}", file=sys.stderr)
    return 2


def _torch_write_failure(e: RuntimeError) -> str | None:
    """PyTorch's file writer reports a failed write (a full disk) as ``unexpected pos A vs B`` or
    ``file write failed``, without the path: the one line for it, else None (a bug)."""
    text = str(e)
    if "inline_container" not in text or not ("unexpected pos" in text or "file write failed" in text):
        return None
    detail = text.rsplit("]", 1)[-1].strip(" .")
    return (
        f"writing a torch file (a checkpoint) failed ({detail}): the disk is full or refused the write; "
        "free space or pick another folder"
    )


def int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (a count of jobs, seeds, steps, threads: 1; warm-up
    steps: 0)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
