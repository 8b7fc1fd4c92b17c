"""Push weights through HF safetensors on a filesystem the server can read.

The checkpoint (shards + ``model.safetensors.index.json``, :mod:`moe_rl.hf_io`) is written into a
temp directory renamed into place while generation keeps running; then every engine loads it
with ``POST /update_weights_from_disk`` {model_path, weight_version}, paused but outside any
begin/end session (SGLang does not wrap disk loads in one; see :mod:`.session`).

Field names: ``python/sglang/srt/managers/io_struct.py`` (sgl-project/sglang),
UpdateWeightFromDiskReqInput.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from moe_rl.hf_io import INDEX, WrittenCheckpoint, atomic_dir, write_tensors
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.types import HFStateSource
from moe_rl.rollout.weight_sync.session import PushReport, WeightSyncError, run_update_session

logger = logging.getLogger(__name__)

_UNSAFE_IN_DIR_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def write_hf_checkpoint(
    named: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 4 << 30,
    metadata_from: str | Path | None = None,
) -> WrittenCheckpoint:
    """Write HF-named safetensors shards + index to ``out_dir`` atomically (temp dir, rename).

    Copies ``*.json`` (config, generation config, tokenizer) from ``metadata_from`` when given.
    """
    try:
        with atomic_dir(out_dir) as tmp:
            written = write_tensors(named, tmp, max_shard_bytes=max_shard_bytes)
            if metadata_from is not None:
                for f in Path(metadata_from).glob("*.json"):
                    if f.name != INDEX:
                        shutil.copy2(f, tmp / f.name)
    except ValueError as e:  # a name given twice, or no tensors at all
        raise WeightSyncError(f"the weight source is not a checkpoint: {e}") from e
    return written


class DiskWeightSync:
    """Push through HF safetensors on a filesystem every server can read.

    ``client`` is one SGLangClient or a list of them (one per engine). ``server_root_dir`` is the same directory as the server sees it (default: ``root_dir``).
    The last ``keep_last`` checkpoints this object wrote are kept; older ones are deleted.
    """

    def __init__(
        self,
        client: SGLangClient | list[SGLangClient],
        root_dir: str | Path,
        *,
        server_root_dir: str | Path | None = None,
        max_shard_bytes: int = 4 << 30,
        keep_last: int = 2,
        metadata_from: str | Path | None = None,
        timeout_s: float = 600.0,
    ):
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.client, self.root = self.clients[0], Path(root_dir)
        self.server_root = Path(server_root_dir) if server_root_dir is not None else self.root
        self.max_shard_bytes, self.keep_last = max_shard_bytes, max(1, keep_last)
        self.metadata_from, self.timeout_s = metadata_from, timeout_s
        self._written: list[Path] = []

    def push(self, source: HFStateSource, version: str) -> PushReport:
        """Write the checkpoint (generation keeps running), then load it on the server."""
        t0 = time.perf_counter()
        name = _UNSAFE_IN_DIR_NAME.sub("_", version) or "weights"
        written = write_hf_checkpoint(
            source.hf_tensors(),
            self.root / name,
            max_shard_bytes=self.max_shard_bytes,
            metadata_from=self.metadata_from,
        )
        write_s = time.perf_counter() - t0
        server_path = str(self.server_root / name)
        self._remember(self.root / name)

        def apply() -> None:
            for c in self.clients:
                c.update_weights_from_disk(server_path, weight_version=version, timeout_s=self.timeout_s)

        paused_s, session = run_update_session(self.clients, version, apply, session=False)
        report = PushReport(
            method="disk",
            version=version,
            num_tensors=written.num_tensors,
            num_buckets=written.num_shards,
            bytes=written.num_bytes,
            seconds=time.perf_counter() - t0,
            paused_s=paused_s,
            write_s=write_s,
            session=session,
        )
        logger.info(
            "pushed %s via %s: %d tensors, %.1f MB, write %.2f s, load %.2f s",
            version,
            server_path,
            written.num_tensors,
            written.num_bytes / 1e6,
            write_s,
            paused_s,
        )
        return report

    def _remember(self, path: Path) -> None:
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    def close(self) -> None:
        """Nothing to release (checkpoints stay on disk)."""
