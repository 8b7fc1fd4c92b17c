"""Files written whole or not at all: :func:`write_text` (results, a run's ``recipe.yaml``, a checkpoint's
``meta.json`` and ``latest``).

Written in place, a full disk or a crash mid-write leaves a truncated file where the last good one
was (a result JSON, or the ``recipe.yaml`` by which ``moe-rl compare`` recognises an arm's run: an
unreadable one made it start the arm over, removing its checkpoints). :func:`write_text` writes a
temp file beside the target, flushes it to disk and renames it over the target, so a reader (or the
next command) sees the old file or the complete new one. Imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moe_rl.errors import DataError


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` at ``path`` atomically: a temp file beside it, fsync, rename (a reader never
    sees half a file, an interrupted write leaves the old one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path) -> Any:
    """The JSON document at ``path``; one that is cut short or edited is a
    :class:`moe_rl.errors.DataError` naming the file, line and column (a missing file: the
    ``OSError``, which names it)."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}): it was cut short or edited; "
            "run the command that writes it again"
        ) from None
