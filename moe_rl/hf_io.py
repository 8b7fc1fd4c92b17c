"""Hugging Face safetensors checkpoints on disk: one writer, one reader, one atomic directory replace.

Torch and ``safetensors`` only (no megatron-core). Used by :func:`moe_rl.megatron.hf.export_hf`
and :func:`~moe_rl.megatron.hf.import_hf`, by the disk weight sync and by ``moe-rl serve``.

The layout is the one transformers' ``save_pretrained`` writes: ``model-0000k-of-0000N.safetensors``
shards (``metadata={"format": "pt"}``) and ``model.safetensors.index.json``
``{"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}`` (``indent=2``,
sorted keys). Tensors arrive one at a time (an export gathers them parameter by parameter), so
the writer streams: it holds at most one shard in memory, names the shards when it knows how many
there are, and never needs the whole state dict (which ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_rl.errors import DataError

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class WrittenCheckpoint:
    """What :meth:`ShardWriter.finish` wrote."""

    num_bytes: int
    "Payload bytes of all tensors."
    num_tensors: int
    "Tensors written."
    num_shards: int
    "safetensors files written."


class ShardWriter:
    """Streams named tensors into safetensors shards of at most ``max_shard_bytes`` under ``root``.

    A tensor larger than ``max_shard_bytes`` gets a shard of its own. :meth:`finish` writes the
    last shard, renames them to ``model-0000k-of-0000N.safetensors`` and writes the index.
    """

    def __init__(self, root: str | Path, max_shard_bytes: int = 4 << 30):
        self.root, self.max_shard_bytes = Path(root), max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = self.total_bytes = self.total_elements = 0
        self._files: list[tuple[str, list[str]]] = []
        self._names: set[str] = set()

    def add(self, name: str, t: torch.Tensor) -> None:
        """Queue ``t`` (copied to a compact CPU tensor when it is a view or on another device)."""
        if name in self._names:
            raise ValueError(f"{name!r} given twice")
        self._names.add(name)
        t = t.detach().to("cpu")
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.contiguous().clone()  # safetensors stores whole storages: no views, no shared memory
        nbytes = t.numel() * t.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = t
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes
        self.total_elements += t.numel()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if self._buffer:
            fname = f"part-{len(self._files) + 1:05d}.safetensors"
            save_file(self._buffer, str(self.root / fname), metadata={"format": "pt"})
            self._files.append((fname, list(self._buffer)))
            self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> WrittenCheckpoint:
        """Write the last shard, name every shard ``model-0000k-of-0000N``, write the index."""
        self._flush()
        if not self._files:
            raise ValueError("no tensors to write")
        n, weight_map = len(self._files), {}
        for k, (tmp_name, names) in enumerate(self._files, 1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            (self.root / tmp_name).rename(self.root / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {
            "metadata": {"total_parameters": self.total_elements, "total_size": self.total_bytes},
            "weight_map": weight_map,
        }
        (self.root / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return WrittenCheckpoint(self.total_bytes, len(weight_map), n)


def write_tensors(
    named: Iterable[tuple[str, torch.Tensor]], root: str | Path, *, max_shard_bytes: int = 4 << 30
) -> WrittenCheckpoint:
    """Write every (name, tensor) of ``named`` as shards + index into the existing directory ``root``."""
    writer = ShardWriter(root, max_shard_bytes)
    for name, t in named:
        writer.add(name, t)
    return writer.finish()


class NoWeights(DataError, FileNotFoundError):
    """A checkpoint directory without safetensors weights (one line naming it)."""


def unreadable(path: Path, e: Exception) -> DataError:
    """The one-line error of a weights or index file that cannot be read (truncated, corrupt)."""
    detail = " ".join(str(e).split())[:160]
    return DataError(
        f"{path}: not a readable {'index' if path.name == INDEX else 'safetensors file'} "
        f"({type(e).__name__}: {detail}): it was cut short or changed; copy or export it again"
    )


def shard_files(root: str | Path) -> list[str]:
    """The safetensors files of a checkpoint directory: those of its index, else ``*.safetensors``."""
    root = Path(root)
    index = root / INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise unreadable(index, e) from None
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise NoWeights(f"{root} has no {INDEX} and no *.safetensors files")
    return files


def scan_headers(root: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (file, shape) of every tensor of the checkpoint, from the safetensors headers only.

    Raises ValueError when a name appears in two shards.
    """
    from safetensors import SafetensorError, safe_open

    root, header = Path(root), {}
    for fname in shard_files(root):
        try:
            with safe_open(str(root / fname), framework="pt", device="cpu") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except SafetensorError as e:
            raise unreadable(root / fname, e) from None
        for name, shape in shapes.items():
            if name in header:
                raise ValueError(f"{root}: {name!r} appears in both {header[name][0]} and {fname}")
            header[name] = (fname, shape)
    return header


def read_tensors(root: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (index-aware); ValueError when a name repeats."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root, named = Path(root), {}
    for fname in shard_files(root):
        try:
            part = load_file(str(root / fname))
        except SafetensorError as e:
            raise unreadable(root / fname, e) from None
        repeated = set(part) & set(named)
        if repeated:
            raise ValueError(f"{root}: {sorted(repeated)[0]!r} appears in more than one shard")
        named.update(part)
    return named


OWNER = ".moe-rl-owner"
"""The owner file (``pid host``) of staging directories older versions made; new ones carry their
owner in their name (:func:`_staging_name`)."""


def _staging_name(out: Path, kind: str) -> Path:
    """``.<out>.<kind>-<pid>@<host>-<8 hex>`` beside ``out`` (kind ``tmp``: the staging directory;
    ``old``: the previous version set aside): its owner in its name, from the first instant to the
    last, with no owner file to write or remove."""
    return out.parent / f".{out.name}.{kind}-{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def _owner_alive(staging: Path) -> bool:
    """Whether the process that made ``staging`` may still be writing it: its name (or, from an
    older version, its owner file) names a live process of this host, or another host (not ours to
    judge); an older staging directory without an owner file yet is alive for an hour."""
    named = re.search(r"\.(?:tmp|old)-(\d+)@(.+)-[0-9a-f]{8}$", staging.name)
    if named:
        pid, host = named.groups()
    else:
        try:
            pid, host = (staging / OWNER).read_text().split()
        except FileNotFoundError:
            return time.time() - staging.stat().st_mtime < 3600
        except (OSError, ValueError):
            return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def clean_stale_staging(out: Path) -> list[Path]:
    """Tidy what an interrupted :func:`atomic_dir` into ``out`` left beside it (for a 30B export,
    tens of GB): remove staging directories whose owner has ended; when ``out`` is missing (killed
    between its two renames) put back the previous version it set aside; then remove set-aside
    versions. The removed paths."""
    removed = []
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        if p.is_dir() and not _owner_alive(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    aside = sorted(
        (p for p in out.parent.glob(f".{out.name}.old-*") if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    if aside and not out.exists() and not out.is_symlink() and not _owner_alive(aside[-1]):
        log.warning("%s was set aside by an export that did not finish: put back", aside[-1])
        aside.pop().rename(out)
    for p in aside if out.exists() else ():
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``out``; on success it replaces ``out`` by rename.

    On an exception the temp directory is removed and ``out`` is left as it was. Readers see
    either the old directory or the complete new one (a moment without either in between: a kill
    there leaves the old one set aside, which the next call puts back). What a killed earlier call
    left beside ``out`` is tidied first (:func:`clean_stale_staging`).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_staging(out)
    tmp = _staging_name(out, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        trash = _staging_name(out, "old") if out.exists() else None
        if trash is not None:
            out.rename(trash)
        try:
            tmp.rename(out)
        except BaseException:
            if trash is not None:
                trash.rename(out)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
