"""Files written whole or not at all (standard library only: every layer may import it).

A file written in place and interrupted (a full disk, a stop signal, a crash) leaves half of
itself where the previous version was. :func:`write_text` writes a temp file beside the target,
flushes it to disk and renames it over the target, so a reader sees the old file or the new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
    from moe_rl.errors import DataError

    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}): it was cut short or edited; "
            "run the command that writes it again"
        ) from None
