"""Metric sinks: JSONL (one object per step) and TensorBoard, written by rank 0 only."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ABANDONED = "metrics.abandoned.jsonl"
"Rows a resume or a rollback cut from ``metrics.jsonl`` (the steps it ran again), kept here."


def _jsonable(v: object) -> object:
    """Numbers as floats (non-finite ones as null, which JSON can hold); anything else as is."""
    if isinstance(v, (int, float)):
        return float(v) if math.isfinite(v) else None
    return v


class MetricsSink:
    """Append ``{"step", "stage", "time", **tags, **metrics}`` to ``metrics.jsonl`` and TensorBoard.

    ``tags`` (set by the run): ``run``, the run's id (a ``--fresh`` start in a reused folder gets a
    new one), and ``attempt``, how many times this run continued from a checkpoint (a ``--resume``
    or a sentinel rollback; each cuts the rows it abandons first), so a report can tell two runs
    and the attempts of one apart."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self._f = None
        self._tb = None
        self.tags: dict[str, object] = {}
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._f = (self.out_dir / "metrics.jsonl").open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except Exception as e:  # tensorboard missing or broken: keep the JSONL
                log.warning("TensorBoard disabled: %s", e)

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        self._f.write(
            json.dumps({"step": step, "stage": stage, "time": time.time(), **self.tags, **clean}) + "\n"
        )
        self._f.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float):
                    self._tb.add_scalar(f"{stage}/{k}", v, step)
            self._tb.flush()

    def offset(self) -> int:
        """Bytes of ``metrics.jsonl`` written so far (0 on a disabled sink): saved with a checkpoint."""
        if self._f is None:
            return 0
        self._f.flush()
        return self._f.tell()

    def truncate(self, offset: int) -> int:
        """Cut ``metrics.jsonl`` back to ``offset`` bytes (the rows of steps a resume or a rollback
        runs again); the number of rows removed. They are not lost: they are appended to
        ``metrics.abandoned.jsonl`` (with their ``attempt``). A file already shorter is left alone."""
        if self._f is None:
            return 0
        self._f.flush()
        path = self.out_dir / "metrics.jsonl"
        data = path.read_bytes()
        if len(data) <= offset:
            return 0
        removed = data[offset:].count(b"\n")
        with (self.out_dir / ABANDONED).open("ab") as f:
            f.write(data[offset:])
            f.flush()
            os.fsync(f.fileno())
        with path.open("r+b") as f:
            f.truncate(offset)
        return removed

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path, stage: str | None = None) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (optionally one stage's)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row for row in rows if stage is None or row.get("stage") == stage]


def read_every_attempt(out_dir: str | Path, stage: str | None = None) -> list[dict]:
    """Every row a run folder's attempts wrote, in the order written: the rows resumes and rollbacks
    abandoned (``metrics.abandoned.jsonl``), then ``metrics.jsonl``'s."""
    out_dir = Path(out_dir)
    abandoned = read_metrics(out_dir / ABANDONED, stage) if (out_dir / ABANDONED).exists() else []
    return abandoned + read_metrics(out_dir / "metrics.jsonl", stage)


def newest_run(rows: list[dict]) -> list[dict]:
    """The rows of the run that wrote last (its ``run`` tag; rows written before runs were tagged
    count as one earlier run)."""
    if not rows:
        return rows
    last = rows[-1].get("run")
    return [r for r in rows if r.get("run") == last]
