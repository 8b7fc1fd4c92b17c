"""Where a command may write: never into, over or around what another command wrote.

A run's folders are recognised by their markers, whoever's run they are (this recipe's or any
other): a checkpoint (``meta.json``), a checkpoint folder (``latest``, or checkpoints in it) and a
run folder (its lock, ``run.json``, ``recipe.yaml`` with ``metrics.jsonl``, or a checkpoint folder
in it). :func:`check_export_target` refuses an export destination that is, holds or sits inside
one of them, with or without ``--overwrite``, and any input the export reads; ``--overwrite``
replaces only a file or a folder that is none of these (e.g. an earlier export). Standard library
only.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_rl.errors import PathError

CHECKPOINT_MARKER = "meta.json"
"Written last into every checkpoint (moe_rl.megatron.checkpoint.META)."
ROOT_MARKER = "latest"
"The checkpoint folder's pointer to its newest checkpoint."
RUN_MARKERS = (".moe-rl.lock", "run.json", "checkpoints")
"Entries that make a folder a run's on their own (recipe.yaml counts beside metrics.jsonl)."
SCAN_DEPTH = 3
"How deep a destination folder is searched for a run's folder (runs/<run>/checkpoints/<ckpt>)."


def run_markers(folder: Path) -> list[str]:
    """What makes ``folder`` a checkpoint (``meta.json``), a checkpoint folder (``latest``, or
    ``<name>/meta.json`` of a checkpoint in it) or a run folder (:data:`RUN_MARKERS`, or
    ``recipe.yaml`` beside ``metrics.jsonl``), sorted; ``[]`` when nothing does."""
    try:
        children = list(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return []
    names = {c.name for c in children}
    marks = names & {CHECKPOINT_MARKER, ROOT_MARKER, *RUN_MARKERS}
    if {"recipe.yaml", "metrics.jsonl"} <= names:
        marks |= {"recipe.yaml", "metrics.jsonl"}
    held = next((c for c in children if c.is_dir() and (c / CHECKPOINT_MARKER).is_file()), None)
    if held is not None:
        marks.add(f"{held.name}/{CHECKPOINT_MARKER}")
    if CHECKPOINT_MARKER in marks and not (folder / CHECKPOINT_MARKER).is_file():
        marks.discard(CHECKPOINT_MARKER)  # a folder named meta.json is no checkpoint's
    return sorted(marks)


def _checkpointish(marks: list[str]) -> bool:
    return any(m in (CHECKPOINT_MARKER, ROOT_MARKER) or m.endswith("/" + CHECKPOINT_MARKER) for m in marks)


def enclosing_checkpoint_folder(path: Path) -> Path | None:
    """The checkpoint or checkpoint folder ``path`` (existing or not) sits inside, or None. Only
    those count: a new folder beside a run's files (``<run>/hf``) is fine."""
    return next((parent for parent in path.parents if _checkpointish(run_markers(parent))), None)


def held_run_folder(path: Path, depth: int = SCAN_DEPTH) -> Path | None:
    """The run folder, checkpoint folder or checkpoint that ``path`` is or holds within ``depth``
    levels (:func:`run_markers`), or None."""
    if not path.is_dir():
        return None
    for here, dirs, _ in os.walk(path):
        if run_markers(Path(here)):
            return Path(here)
        if len(Path(here).relative_to(path).parts) >= depth:
            dirs[:] = []
    return None


def check_export_target(
    out: str | Path, *, overwrite: bool, reads: dict[str, str | Path] | str | Path | None = None
) -> None:
    """Refuse an export destination it does not own (``PathError`` naming it and the fix).

    With or without ``overwrite``: any input the export reads (``reads``: ``{what: path}``, e.g.
    ``--checkpoint``, ``checkpoint.load``, ``model.hf_path``; one path is ``--checkpoint``), a
    folder holding one or a path inside one; a destination inside any run's checkpoint folder; a
    run folder, a checkpoint folder or a checkpoint, or a folder holding one. Without
    ``overwrite``: an existing file or a non-empty folder. A new path or an empty folder is fine.
    """
    out = Path(out)
    target = out.resolve()
    if reads is not None and not isinstance(reads, dict):
        reads = {"--checkpoint": reads}
    for what, path in (reads or {}).items():
        src = Path(path).resolve()
        if target == src or src.is_relative_to(target) or target.is_relative_to(src):
            raise PathError(
                f"export destination {out} would overwrite or sit inside the checkpoint it exports "
                f"({what} {path}): give another output path (--overwrite never replaces what it reads)"
            )
    inside = enclosing_checkpoint_folder(target)
    if inside is not None:
        raise PathError(
            f"export destination {out} is inside a run's checkpoint folder ({inside} has "
            f"{', '.join(run_markers(inside))}): an export never writes there, with or without "
            "--overwrite; give a path outside it (e.g. beside the run)"
        )
    held = held_run_folder(target)
    if held is not None:
        where = "is" if held == target else f"holds ({held.relative_to(target)})"
        raise PathError(
            f"export destination {out} {where} a run or checkpoint directory (has "
            f"{', '.join(run_markers(held))}): an export never replaces a run's folder or checkpoints, "
            "with or without --overwrite; give a new path"
        )
    if overwrite or (not out.exists() and not out.is_symlink()):
        return
    if not out.is_dir():
        raise PathError(f"export destination {out} is an existing file: give a new path, or --overwrite")
    if any(out.iterdir()):
        raise PathError(
            f"export destination {out} is a non-empty directory: give a new or empty one, or --overwrite"
        )
