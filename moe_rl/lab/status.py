"""The terminal lines of ``moe-rl compare`` (and ``moe-rl demo``): one per run as it starts and as
it ends, and every ``every`` seconds a status line of the running ones, each with its phase, step /
total, seconds per step and time left (from the run's ``progress.json``,
:mod:`moe_rl.trainer.progress`), its reward and held-out accuracy (from its ``metrics.jsonl``), and
the comparison's time left once a run has ended.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

from moe_rl.trainer.progress import clock, read_progress_file

STATUS_EVERY = 20.0
"Seconds between two status lines."


def read_progress(path: Path, stage: str) -> dict:
    """The newest ``stage`` progress of a run's ``metrics.jsonl`` while it is written: steps done,
    reward and loss of the last step, the latest held-out accuracy (a half-written or unreadable
    line is skipped; no file: ``{}``)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return {}
    out: dict = {}
    for raw in lines:
        try:
            r = json.loads(raw)
            step = int(r["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if r.get("stage") == stage:
            out["done"] = step + 1
            for key, name in (("reward/mean", "reward"), ("loss", "loss")):
                if r.get(key) is not None:
                    out[name] = r[key]
        if r.get("stage") in ("rl", "rl_eval") and r.get("eval/accuracy") is not None:
            out["acc"] = r["eval/accuracy"]
    return out


def fmt(v, spec: str = ".3f") -> str:
    """``v`` formatted, or ``-`` when there is none (None, nan)."""
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def run_status(label: str, run_dir: Path, stage: str, steps: int) -> str:
    """One running run's part of the status line: ``GRPO seed 0: rl 12/30, 2.10 s/step, ETA 0:37,
    reward 0.312, held-out acc 27.0%``, or the phase it is in (``starting``, ``rl step-0
    evaluation``, ``rl final evaluation``)."""
    where = read_progress_file(run_dir)
    p = read_progress(run_dir / "metrics.jsonl", stage)
    phase = where.get("phase")
    if phase == stage and "s_per_step" in where:
        text = f"{stage} {where['step']}/{where['total']}, {where['s_per_step']:.2f} s/step, ETA {clock(where['eta_s'])}"
    elif phase in (None, "start"):
        text = "starting (process groups, the policy and its weights)"
    elif phase == stage:
        text = f"{stage} {p.get('done', where.get('step', 0))}/{steps}, first step running"
    else:
        text = phase
    if stage == "sft":
        text += f", loss {fmt(p.get('loss'))}"
    elif p.get("done") or p.get("acc") is not None:
        text += f", reward {fmt(p.get('reward'))}, held-out acc {fmt(p.get('acc'), '.1%')}"
    return f"{label}: {text}"


class StatusLines:
    """The terminal lines (module docstring); ``jobs`` runs at a time, ``total`` runs in all."""

    def __init__(self, total: int, every: float = STATUS_EVERY, stream=None, jobs: int = 1):
        self.total, self.every, self.jobs = total, every, max(1, jobs)
        self.stream = stream if stream is not None else sys.stdout
        self.t0 = time.monotonic()
        self.ended = 0
        self.walls: list[float] = []
        self.running: dict[str, tuple[Path, str, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self, text: str) -> None:
        with self._lock:
            print(f"[{clock(time.monotonic() - self.t0)}] {text}", file=self.stream, flush=True)

    def started(
        self, label: str, run_dir: Path, stage: str, steps: int, log_file: Path, *, quiet=False
    ) -> None:
        """``label`` runs (``quiet``: no line, e.g. a run an earlier invocation may have finished)."""
        with self._lock:
            self.running[label] = (run_dir, stage, steps)
        if not quiet:
            self.line(f"{label}: started ({steps} {stage.upper()} steps; output: {log_file})")

    def ended_run(self, label: str, text: str, *, counts: bool = True, wall_s: float | None = None) -> None:
        """``label`` ended (``wall_s``: the seconds it trained in this invocation, for the ETA)."""
        with self._lock:
            self.running.pop(label, None)
            self.ended += counts
            if counts and wall_s:
                self.walls.append(wall_s)
        self.line(f"{label}: {text}" + (f" [{self.ended}/{self.total} runs]" if counts else ""))

    def eta(self) -> float | None:
        """Seconds until the last run ends: the runs not yet ended, ``jobs`` at a time, at the mean
        wall time of those that ended in this invocation (None before one has)."""
        if not self.walls:
            return None
        left = self.total - self.ended
        return math.ceil(left / self.jobs) * sum(self.walls) / len(self.walls)

    def status(self) -> str | None:
        """The status line of the running runs (None when none runs)."""
        with self._lock:
            running = dict(self.running)
        if not running:
            return None
        eta = self.eta()
        head = f"{self.ended}/{self.total} runs ended" + (f", ETA {clock(eta)}" if eta is not None else "")
        return head + " | " + " | ".join(run_status(label, *where) for label, where in running.items())

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            text = self.status()
            if text:
                self.line(text)

    def __enter__(self) -> StatusLines:
        self._thread = threading.Thread(target=self._loop, name="compare-status", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
