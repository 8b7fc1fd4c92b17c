"""Where a run is, for the person waiting on it (rank 0): the phase, step / total, seconds per step
and the time left, so that slow can be told from stuck.

- Every phase change is named in one log line (``phase: sft, 300 steps``; ``phase: rl step-0
  checkpoint and held-out evaluation``); phases without steps say what they do.
- A stepped phase (``sft``, ``rl``) shows, on a terminal, a tqdm bar (its rate and ETA are
  tqdm's); elsewhere (a log file, Slurm, CI, a child of ``moe-rl compare``) one plain line every
  ``train.log_every`` steps (the first, then every N-th), and the last:
  ``sft step 12/300 | 0.83 s/step | ETA 3:59 | loss ...``.
  Seconds per step are the phase's wall time so far over its steps so far (evaluations included).
- ``<out_dir>/progress.json`` holds the same (phase, step, total, s/step, ETA, the shown fields),
  rewritten atomically at every change while the run lives (removed when it ends, as a lock file
  is): ``moe-rl compare`` reads it for its status lines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
"Written into ``train.out_dir`` by rank 0 at every phase change and step."


def clock(seconds: float) -> str:
    """``M:SS`` (``H:MM:SS`` from an hour)."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def stderr_is_terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Progress:
    """One run's progress (module docstring); a no-op where ``enabled`` is false (ranks > 0)."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, log_every: int = 1):
        self.out_dir, self.enabled, self.log_every = Path(out_dir), enabled, max(1, log_every)
        self.name: str | None = None
        self.total = self.first = 0
        self.t0 = time.monotonic()
        self._bar = None

    def phase(self, name: str, what: str = "") -> None:
        """A phase without steps begins (building the policy, the step-0 evaluation, saving)."""
        if not self.enabled:
            return
        self._close_bar()
        self.name, self.total, self.first, self.t0 = name, 0, 0, time.monotonic()
        log.info("phase: %s%s", name, f" ({what})" if what else "")
        self._write({"phase": name, "what": what})

    def stage(self, name: str, total: int, done: int = 0) -> None:
        """A stepped phase begins: ``total`` steps, ``done`` of them already (a resumed run)."""
        if not self.enabled:
            return
        self._close_bar()
        self.name, self.total, self.first, self.t0 = name, total, done, time.monotonic()
        left = f", {total - done} to go" if done else ""
        log.info("phase: %s, %d steps%s", name, total, left)
        self._write({"phase": name, "step": done, "total": total})

    def step(self, step: int, fields: dict[str, str]) -> None:
        """Step ``step`` (0-based) of the current stepped phase ended; ``fields``: label -> value."""
        if not self.enabled:
            return
        done = step + 1
        per = (time.monotonic() - self.t0) / max(done - self.first, 1)
        eta = per * (self.total - done)
        self._write(
            {"phase": self.name, "step": done, "total": self.total, "s_per_step": per, "eta_s": eta, **fields}
        )
        if stderr_is_terminal():
            self._bar_step(done, fields)
        elif step % self.log_every == 0 or done == self.total or done == self.first + 1:
            shown = " ".join(f"{k} {v}" for k, v in fields.items())
            log.info(
                "%s step %d/%d | %.2f s/step | ETA %s | %s",
                self.name,
                done,
                self.total,
                per,
                clock(eta),
                shown,
            )

    def close(self) -> None:
        self._close_bar()

    def remove(self) -> None:
        """The run ended (however): ``progress.json`` goes (a run killed outright leaves it, and the
        next start of the run replaces it)."""
        self._close_bar()
        if self.enabled:
            (self.out_dir / PROGRESS_FILE).unlink(missing_ok=True)

    def _bar_step(self, done: int, fields: dict[str, str]) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, initial=done - 1, desc=self.name, unit="step", dynamic_ncols=True
            )
        self._bar.update(1)
        self._bar.set_postfix(fields, refresh=False)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _write(self, doc: dict) -> None:
        """``progress.json``, replaced atomically (a reader never sees half a file)."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.out_dir / f".{PROGRESS_FILE}.{os.getpid()}"
            tmp.write_text(json.dumps({**doc, "time": time.time()}))
            os.replace(tmp, self.out_dir / PROGRESS_FILE)
        except OSError as e:  # progress is a courtesy: never stop a run for it
            log.debug("progress.json not written: %s", e)


def read_progress_file(out_dir: str | Path) -> dict:
    """A run's ``progress.json`` (``{}`` when there is none, or it cannot be read)."""
    try:
        doc = json.loads((Path(out_dir) / PROGRESS_FILE).read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}
