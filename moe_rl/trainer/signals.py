"""SIGTERM, SIGINT and SIGHUP as a request to stop at the next safe point, not a crash.

:class:`StopSignals` installs handlers that only record the signal; the SFT and RL loops ask
:meth:`StopSignals.requested` after each step (after the optimizer step, every rank agreeing),
write a checkpoint if the weights pass the checks, log one line and end the run. A second
signal while that checkpoint is written is noted and ignored, so the save completes (a
checkpoint is written into a temp directory and renamed, so even a SIGKILL leaves the previous
one intact).

SIGHUP is what a closed terminal or SSH session sends: without a handler it would end the run
with no checkpoint and no line.

Exit code: ``moe-rl train`` exits with 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT, 129 for SIGHUP), the shell's convention for "ended by this signal", after the clean save. A zero
would tell ``moe-rl train ... && moe-rl export ...`` chains and job scripts that training
finished when it did not; Slurm requeues a preempted job whatever its exit code, and the
next job continues with ``--resume``.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from moe_rl.errors import StopRequested as StopRequested  # re-exported: where callers found it

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """Context manager: while inside, SIGTERM / SIGINT / SIGHUP set :attr:`signum` instead of ending the
    process; the previous handlers are restored on exit. Outside the main thread (where Python
    cannot install handlers) it installs nothing and never reports a signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        "The first signal received (None: none)."
        self.acted = False
        "Whether a step loop acted on it (stopped with :class:`StopRequested`): then it is not handed on."
        self._old: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning(
                "%s received: stopping after this step with a checkpoint", signal.Signals(signum).name
            )
        else:
            log.warning("%s received again: still writing the checkpoint", signal.Signals(signum).name)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        installed, self._old = bool(self._old), {}
        if installed and exc_type is None and self.signum is not None and not self.acted:
            # the run ended (its last step and save) before any step loop acted on the signal:
            # hand it on to the handler outside (a comparison stops starting runs; a command
            # ends with 128 + it), never drop it
            log.warning("%s: the run had finished its last step; stopping", signal.Signals(self.signum).name)
            signal.raise_signal(self.signum)

    def requested(self, group=None) -> int:
        """The signal any rank of ``group`` got (the highest number), 0 for none; a collective,
        every rank must ask."""
        from moe_rl import dist

        return int(dist.max_over(int(self.signum or 0), group))
