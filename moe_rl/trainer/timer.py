"""Phase timing of a training step: one timer, nested records, no hand arithmetic.

``timer.record("train")`` times a phase; a record opened inside another (a flip probe inside
"train") is charged to the inner phase only, so the phases of one step add up to the step. A
phase recorded several times in one step (the probe after every minibatch) accumulates.

Subclasses measure more per phase by overriding :meth:`StepTimer.read` (more clocks, e.g. CPU
seconds) and the :meth:`StepTimer.on_enter` / :meth:`StepTimer.on_exit` hooks (e.g. peak memory);
``benchmarks/throughput.py`` does both.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimer:
    """Exclusive wall seconds per phase of one step (``seconds["train"]`` excludes nested probes)."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = {}
        'phase -> clock name -> exclusive amount (clock "s": wall seconds).'
        self._open: list[tuple[str, dict[str, float], dict[str, float]]] = []

    def read(self) -> dict[str, float]:
        """The clocks, read now: ``{"s": wall seconds}`` (subclasses add more)."""
        return {"s": time.perf_counter()}

    def on_enter(self, phase: str) -> None:
        """Called as ``phase`` opens (after the enclosing phase, if any, was paused)."""

    def on_exit(self, phase: str) -> None:
        """Called as ``phase`` closes (before the enclosing phase resumes)."""

    @contextmanager
    def record(self, phase: str) -> Iterator[None]:
        """Charge the time spent in this block, less nested records, to ``phase``."""
        self.on_enter(phase)
        start = self.read()
        inner = dict.fromkeys(start, 0.0)
        self._open.append((phase, start, inner))
        try:
            yield
        finally:
            self._open.pop()
            end = self.read()
            spent = {k: end[k] - start[k] for k in start}
            total = self.totals.setdefault(phase, dict.fromkeys(start, 0.0))
            for k, v in spent.items():
                total[k] += v - inner[k]
            if self._open:  # the enclosing phase does not count this block
                outer = self._open[-1][2]
                for k, v in spent.items():
                    outer[k] += v
            self.on_exit(phase)

    @property
    def phase(self) -> str | None:
        """The innermost phase open now (None between phases)."""
        return self._open[-1][0] if self._open else None

    @property
    def seconds(self) -> dict[str, float]:
        """Exclusive wall seconds per phase."""
        return {p: t["s"] for p, t in self.totals.items()}

    def total(self, clock: str = "s") -> float:
        """The sum over phases: the time of everything recorded, each moment counted once."""
        return sum(t[clock] for t in self.totals.values())
