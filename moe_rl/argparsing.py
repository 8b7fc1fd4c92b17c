"""The command line's shared parts, a leaf under ``moe_rl.cli`` and ``moe_rl.plan``.

:class:`ArgParser` (the house usage-error line) and :func:`one_line_errors` (a user error, or a
full disk, becomes one ``moe-rl: <kind>: <message>`` line and exit code 2). Only the standard
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
    """``command()``; a :class:`moe_rl.errors.UserError` (or a full disk) becomes one line on
    stderr and exit code 2 (``verbose``: with its traceback); any other exception is a bug and keeps it."""
    from moe_rl.errors import UserError

    try:
        return command()
    except UserError as e:
        return _one_line(e.kind, str(e), verbose)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        return _one_line(
            "disk full", f"no space left on the device{where}: free space or pick another folder", verbose
        )
    except RuntimeError as e:
        message = _torch_write_failure(e)
        if message is None:
            raise
        return _one_line("disk full", message, verbose)


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
