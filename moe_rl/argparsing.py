"""The command line's shared parts, a leaf under ``moe_rl.cli`` and ``moe_rl.plan``.

:class:`ArgParser` (the house usage-error line), :func:`one_line_errors` (a user error, or a
full disk, becomes one ``moe-rl: <kind>: <message>`` line and exit code 2) and the count types of
the benchmarks' and studies' flags (:func:`int_at_least`). Only the standard
library and ``moe_rl.errors`` are imported, so both commands use them without importing each other.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import signal
import sys
import threading
import traceback
from collections.abc import Callable

from moe_rl.errors import Interrupted, StopRequested, Unavailable, UserError, is_disk_full


class ArgParser(argparse.ArgumentParser):
    """argparse with the house error line: usage, then ``moe-rl: usage error: ...``; exit code 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"moe-rl: usage error: {self.prog}: {message}\n")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"What stops a command: ``kill``, Ctrl-C, a closed terminal or SSH session."


def _interrupt(signum, frame) -> None:

    raise Interrupted(signum)


@contextlib.contextmanager
def stop_signals_end_the_command():
    """While inside (main thread only), SIGTERM / SIGINT / SIGHUP raise
    :class:`moe_rl.errors.Interrupted` at once. Step loops and sweeps install their own handlers
    inside (they stop at the next step with a checkpoint) and hand a signal they could not act on
    back to this one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# -- flag values checked by argparse's type= (a usage line naming the flag) -------------------------
def _refuse(text: str, want: str):
    return argparse.ArgumentTypeError(f"{text!r}: give {want}")


def number_in(low: float = 0.0, high: float | None = None) -> Callable[[str], float]:
    """argparse type: a finite, normal number > ``low`` (and < ``high``): seconds, GiB, a fraction."""
    want = f"a number > {low:g}" + (f" and < {high:g}" if high is not None else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _refuse(text, want) from None
        if not (math.isfinite(value) and value > low and (high is None or value < high)):
            raise _refuse(text, want)
        if abs(value) < sys.float_info.min:
            raise _refuse(text, f"{want}, not below the smallest normal number")
        return value

    parse.rule = f"number > {low:g}" if high is None else f"number in ({low:g}, {high:g})"
    return parse


def text_value(text: str) -> str:
    """argparse type: a non-blank string (a path, a name, a key)."""
    if not text.strip():
        raise _refuse(text, "a non-empty value")
    return text


text_value.rule = "text"


def one_line_errors(command: Callable[[], int], verbose: bool) -> int:
    """``command()``; a :class:`moe_rl.errors.UserError`, an outside service that is down
    (:class:`moe_rl.errors.Unavailable`) or a file-system ``OSError`` (full disk, read-only, permission,
    name too long, ...) becomes one line on stderr and exit code 2 (``verbose``: with its traceback);
    a stop signal, at a step (:class:`~moe_rl.errors.StopRequested`) or anywhere else
    (:class:`~moe_rl.errors.Interrupted`, Ctrl-C), one ``moe-rl: stopped: ...`` line and exit code
    128 + the signal; any other exception is a bug and keeps its traceback."""
    try:
        with stop_signals_end_the_command():
            return command()
    except StopRequested as e:
        again = "" if "--resume" in str(e) else "; run the same command again to continue"
        _one_line("stopped", f"{e}{again}", verbose)
        return e.exit_code
    except (Interrupted, KeyboardInterrupt) as e:
        what = str(e) if isinstance(e, Interrupted) else "SIGINT received"
        _one_line(
            "stopped",
            f"{what}: stopped where no step was under way; nothing half-written is left: run the same "
            "command again to continue (moe-rl train: with --resume once the run has saved a checkpoint)",
            verbose,
        )
        return getattr(e, "exit_code", 128 + signal.SIGINT)
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
    except (
        BaseException
    ) as e:  # a full disk wrapped in a library's own exception (torch's CheckpointException)
        if not is_disk_full(e):
            raise
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return _one_line(
            "disk full", f"no space left on the device ({first}): free space or pick another folder", verbose
        )


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


def run_main(main: Callable[[], int | None], verbose: bool | None = None) -> int:
    """A command's ``main()`` through :func:`one_line_errors`, for every entry point besides
    ``moe-rl`` itself (benchmarks, studies, tools, ``python -m`` servers): a user error, a file
    error, a service that is down or a stop signal is one ``moe-rl: ...`` line; a return value
    that is no exit code (None, a result dict) counts as 0. ``verbose`` (default: ``-v`` or
    ``--verbose`` on the command line) adds the traceback."""
    if verbose is None:
        verbose = bool({"-v", "--verbose"} & set(sys.argv[1:]))

    def command() -> int:
        code = main()
        return code if isinstance(code, int) and not isinstance(code, bool) else 0

    return one_line_errors(command, verbose)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: a whole number >= ``minimum`` in the 64-bit range (a count of jobs, seeds,
    steps, threads, GPUs, bytes: 1; warm-up steps, a GPU index: 0)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        if value > 2**63 - 1:
            raise argparse.ArgumentTypeError(f"{value} is past the 64-bit range")
        return value

    parse.rule = f"int >= {minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
