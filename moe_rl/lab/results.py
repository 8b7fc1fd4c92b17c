"""Result files: named by machine, preset and commit; JSON written atomically, with ``null`` for a
number that is not one.

:func:`result_path` names a result ``<name>-<machine>-<preset>-<commit>.json`` in the folder of what
wrote it (``benchmarks/results/``, ``studies/<study>/results/``; ``tools.index`` lists each).

A benchmark or a demo writes its result over the previous one; written in place, a full disk
left an 8 KB truncated JSON where the last good result was. :func:`write_json` writes it with
:func:`moe_rl.files.write_text` (a temp file beside the target, fsync, rename), so a reader (or the
next run) sees the old file or the complete new one. Non-finite floats (NaN, infinities: a rate of no
steps, a fit of too few points) become ``null`` (bare ``NaN`` is not JSON; strict parsers refuse
the whole file).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from moe_rl.files import write_text as write_text  # re-exported: callers import it here

CHECKOUT = Path(__file__).resolve().parents[2]
"The checkout moe_rl runs from (its commit names the results)."


def machine() -> str:
    """A short machine name: the GPU model when CUDA is present, else CPU count and arch."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
    except Exception:
        pass
    return f"cpu{os.cpu_count()}-{platform.machine()}"


def commit() -> str:
    """The checkout's short commit (with -dirty when files changed), or 'nocommit'."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=CHECKOUT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "nocommit"


def result_path(
    name: str, preset: str, out: str | None = None, suffix: str = ".json", *, folder: str | Path
) -> Path:
    """``folder``/<name>-<machine>-<preset>-<commit><suffix> (or ``out``), its folder made."""
    p = Path(out) if out else Path(folder) / f"{name}-{machine()}-{preset}-{commit()}{suffix}"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:  # a numpy / torch scalar
        return json_safe(obj.item())
    return obj


def write_json(path: str | Path, doc: Any, *, indent: int | None = 1, newline: bool = False) -> Path:
    """Write ``doc`` as JSON at ``path`` atomically (:func:`moe_rl.files.write_text`); non-finite floats as
    ``null``, other non-JSON values as their ``str``. ``newline``: end the file with one."""
    text = json.dumps(json_safe(doc), indent=indent, default=str, allow_nan=False) + ("\n" if newline else "")
    return write_text(path, text)


def csv_text(rows: list[dict]) -> str:
    """``rows`` (one dict each, the first one's keys as the header) as CSV; None as empty."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [])
    w.writeheader()
    w.writerows({k: "" if v is None else v for k, v in json_safe(row).items()} for row in rows)
    return buf.getvalue()
