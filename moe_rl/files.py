"""Files written whole or not at all (standard library only: every layer may import it).

A file written in place and interrupted (a full disk, a stop signal, a crash) leaves half of
itself where the previous version was. :func:`write_text` writes a temp file beside the target,
flushes it to disk and renames it over the target, so a reader sees the old file or the new one.
"""

from __future__ import annotations

import os
from pathlib import Path


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
