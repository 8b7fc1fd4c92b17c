"""Metric sinks: JSONL (one object per step) and TensorBoard, written by rank 0 only; the policy's
samples (:mod:`moe_rl.trainer.samples`) beside them in ``samples.jsonl``."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

SAMPLES = "samples.jsonl"
"What the policy generated (:mod:`moe_rl.trainer.samples`), one JSON object a line."
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
        self._samples_fd: int | None = None
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

    def samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """Append ``{"step", "kind", "time", **tags, **row}`` for each of ``rows`` to ``samples.jsonl``
        (created on first use), all in one ``write`` to a file opened with ``O_APPEND`` (one system
        call at the end of the file, as metrics.jsonl's rows are flushed one at a time); and the rows
        as one text entry ``samples/<kind>`` in TensorBoard.
        Rows are never cut: a resumed attempt's rows follow (its ``attempt`` tag tells them apart)."""
        if not self.enabled or not rows:
            return
        from moe_rl.trainer.samples import samples_text

        now = time.time()
        lines = [
            json.dumps({"step": step, "kind": kind, "time": now, **self.tags, **row}, ensure_ascii=False)
            for row in rows
        ]
        data = ("\n".join(lines) + "\n").encode("utf-8")
        if self._samples_fd is None:
            self._samples_fd = os.open(self.out_dir / SAMPLES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        view = memoryview(data)
        while view:  # one write() for a regular file; a short one (never seen) is finished
            view = view[os.write(self._samples_fd, view) :]
        if self._tb is not None:
            self._tb.add_text(f"samples/{kind}", samples_text(rows), step)
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
        if self._samples_fd is not None:
            os.close(self._samples_fd)
            self._samples_fd = None
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path, stage: str | None = None) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (optionally one stage's)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row for row in rows if stage is None or row.get("stage") == stage]


def read_samples(out_dir: str | Path, kind: str | None = None) -> list[dict]:
    """The rows of a run folder's ``samples.jsonl`` (optionally one ``kind``: rollout | eval)."""
    path = Path(out_dir) / SAMPLES
    rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    return [row for row in rows if kind is None or row.get("kind") == kind]


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
