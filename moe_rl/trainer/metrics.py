"""The metric sink: JSONL (one object per step) and the trackers ``train.loggers`` names
(:mod:`moe_rl.trainer.trackers`: TensorBoard, W&B, MLflow), written by rank 0 only; the policy's
samples (:mod:`moe_rl.trainer.samples`) beside them in ``samples.jsonl``."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from moe_rl.names import DEFAULT_LOGGERS
from moe_rl.trainer.trackers import TrackedRun, Tracker, flatten, make_tracker

log = logging.getLogger(__name__)

SAMPLES = "samples.jsonl"
"What the policy generated (:mod:`moe_rl.trainer.samples`), one JSON object a line."
ABANDONED = "metrics.abandoned.jsonl"
"Rows a resume or a rollback cut from ``metrics.jsonl`` (the steps it ran again), kept here."


def complete_lines(data: bytes) -> list[bytes]:
    """The lines of a JSONL file's ``data`` but a row a crash left half-written at its end (a last
    line without its newline that is not JSON: a full disk mid-row). Rows are one ``write`` each,
    newline included, so only the last one can be torn."""
    lines = data.splitlines()
    if lines and not data.endswith(b"\n") and not _is_json(lines[-1]):
        lines.pop()
    return lines


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def end_torn_row(path: Path) -> None:
    """Before appending to ``path``: a last row without its newline gets one, or, when it is half a
    row (a crash mid-write), is removed with a warning; the next row would be glued to it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    with path.open("r+b") as f:
        if _is_json(data[start:]):
            f.seek(len(data))
            f.write(b"\n")
            return
        f.truncate(start)
    log.warning(
        "%s ended in half a row (%d bytes, a crash while it was written): removed", path, len(data) - start
    )


def _jsonable(v: object) -> object:
    """Numbers as floats (non-finite ones as null, which JSON can hold); anything else as is."""
    if isinstance(v, (int, float)):
        return float(v) if math.isfinite(v) else None
    return v


class MetricsSink:
    """Append ``{"step", "stage", "time", **tags, **metrics}`` to ``metrics.jsonl`` and send the
    metrics to the trackers of ``loggers`` (``train.loggers``: :mod:`moe_rl.trainer.trackers`).

    ``tags`` (set by the run): ``run``, the run's id (a ``--fresh`` start in a reused folder gets a
    new one), and ``attempt``, how many times this run continued from a checkpoint (a ``--resume``
    or a sentinel rollback; each cuts the rows it abandons first), so a report can tell two runs
    and the attempts of one apart.

    ``recipe``: the resolved recipe as a mapping (``to_dict``): the trackers' hparams / config /
    params and the YAML they keep. The trackers start at the first row (the tags are set by then);
    one that fails is warned about once and dropped, ``metrics.jsonl`` keeps every row."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        enabled: bool = True,
        loggers: Sequence[str] = DEFAULT_LOGGERS,
        recipe: dict | None = None,
    ):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self._f = None
        self._samples_fd: int | None = None
        self.loggers = tuple(n for n in loggers if n != "jsonl")
        "The trackers' names (``jsonl`` is this sink's own file, always written)."
        self.recipe = recipe
        self.trackers: list[Tracker] | None = None
        "The running trackers (None: not started yet; a failed one is removed)."
        self.tags: dict[str, object] = {}
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        end_torn_row(self.out_dir / "metrics.jsonl")
        self._f = (self.out_dir / "metrics.jsonl").open("a")

    def _start_trackers(self) -> list[Tracker]:
        if self.trackers is not None:
            return self.trackers
        import yaml

        self.trackers = []
        parts = [
            self.out_dir.resolve().name,
            str(self.tags.get("run", "")),
            f"a{self.tags.get('attempt', 0)}",
        ]
        run = TrackedRun(
            out_dir=self.out_dir,
            name="-".join(p for p in parts if p),
            tags=dict(self.tags),
            params=flatten(self.recipe) if self.recipe else {},
            recipe_yaml=yaml.safe_dump(self.recipe, sort_keys=False) if self.recipe else None,
            samples=self.out_dir / SAMPLES,
        )
        for name in self.loggers:
            tracker = make_tracker(name)
            self.trackers.append(tracker)
            self._call(tracker, "start", lambda t: t.start(run))
        return self.trackers

    def _call(self, tracker: Tracker, what: str, fn: Callable[[Tracker], object]) -> None:
        """``fn(tracker)``; if it raises: one warning, and the tracker is closed and dropped."""
        try:
            fn(tracker)
        except Exception as e:  # a tracker never stops training
            log.warning(
                "train.loggers: %s failed to %s (%s: %s): it is off for the rest of this run; "
                "metrics.jsonl keeps every row",
                tracker.name,
                what,
                type(e).__name__,
                e,
            )
            if tracker in self.trackers:
                self.trackers.remove(tracker)
            if what != "close":
                try:
                    tracker.close()
                except Exception:
                    log.debug("closing the failed tracker %s", tracker.name, exc_info=True)

    def log(self, step: int, stage: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        self._f.write(
            json.dumps({"step": step, "stage": stage, "time": time.time(), **self.tags, **clean}) + "\n"
        )
        self._f.flush()
        numbers = {k: v for k, v in clean.items() if isinstance(v, float)}
        for tracker in list(self._start_trackers()):
            self._call(tracker, f"log {stage} step {step}", lambda t: t.log(step, stage, numbers))

    def samples(self, step: int, kind: str, rows: list[dict]) -> None:
        """Append ``{"step", "kind", "time", **tags, **row}`` for each of ``rows`` to ``samples.jsonl``
        (created on first use), all in one ``write`` to a file opened with ``O_APPEND`` (one system
        call at the end of the file, as metrics.jsonl's rows are flushed one at a time); and the rows
        to the trackers (TensorBoard: one text entry ``samples/<kind>``; W&B: a table).
        Rows are never cut: a resumed attempt's rows follow (its ``attempt`` tag tells them apart)."""
        if not self.enabled or not rows:
            return
        now = time.time()
        tagged = [{"step": step, "kind": kind, "time": now, **self.tags, **row} for row in rows]
        lines = [json.dumps(row, ensure_ascii=False) for row in tagged]
        data = ("\n".join(lines) + "\n").encode("utf-8")
        if self._samples_fd is None:
            self._samples_fd = os.open(self.out_dir / SAMPLES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        view = memoryview(data)
        while view:  # one write() for a regular file; a short one (never seen) is finished
            view = view[os.write(self._samples_fd, view) :]
        for tracker in list(self._start_trackers()):
            self._call(tracker, f"write {kind} samples", lambda t: t.samples(step, kind, tagged))

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
        """Close ``metrics.jsonl`` and ``samples.jsonl`` first (nothing of them waits on a
        tracker), then each tracker (each flushes what it holds; one that fails is warned about)."""
        if self._f is not None:
            self._f.close()
        if self._samples_fd is not None:
            os.close(self._samples_fd)
            self._samples_fd = None
        for tracker in list(self.trackers or ()):
            self._call(tracker, "close", lambda t: t.close())
        self.trackers = []  # closed: a row written after this goes to metrics.jsonl only


def read_metrics(path: str | Path, stage: str | None = None) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (optionally one stage's); a last row a crash left half-written
    is not one (:func:`complete_lines`)."""
    rows = [json.loads(line) for line in complete_lines(Path(path).read_bytes()) if line.strip()]
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
