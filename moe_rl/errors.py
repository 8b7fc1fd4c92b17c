"""The user-error type every ``moe-rl`` command turns into one line on stderr.

A :class:`UserError` is a mistake the user can fix (a recipe field, a path, a data file, a
reward function): the CLI prints ``moe-rl: <kind>: <message>`` and exits with code 2, with no
traceback unless ``-v`` is given. Anything else is a bug in moe-rl and keeps its traceback.
Messages name the field, file or record and say the fix.
"""

from __future__ import annotations


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
