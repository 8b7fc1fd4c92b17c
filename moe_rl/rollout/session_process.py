"""A server process this one launched in a session of its own (SGLang, its router).

``start_new_session``: a Ctrl-C in the terminal does not reach it, so it is stopped here, by its
process group (whose id is the PID we started; never by name): SIGTERM, then SIGKILL after a grace
period. :meth:`SessionProcess.stop` also runs when the launching process ends short of a kill (an
exception, ``sys.exit``): a trainer that failed before it stopped its router left it serving on its
port, orphaned, for an hour. A forked child inherits the at-exit handler and does not act on it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)


class SessionProcess:
    """What :mod:`moe_rl.rollout.sglang_launcher` and :mod:`moe_rl.rollout.sglang_router` share:
    the launch into a log file, and the stop. ``stop_grace_s``: the SIGTERM-to-SIGKILL wait."""

    kind = "server"
    stop_grace_s = 30.0
    proc: subprocess.Popen | None = None
    _log: IO[bytes] | None = None

    def _launch(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        """Start ``cmd`` in its own session, its output appended to ``log_path``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        logger.info("launching %s (log %s)", " ".join(cmd), log_path)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        atexit.register(self._stop_at_exit, os.getpid())

    def _stop_at_exit(self, owner: int) -> None:
        """:meth:`stop` as the launching process ends (not in a forked child that inherited it)."""
        if os.getpid() == owner:
            self.stop()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the process group (id = its PID), SIGKILL after ``grace_s`` (default
        ``stop_grace_s``); its exit code, or None when nothing was running."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        proc, self.proc = self.proc, None
        atexit.unregister(self._stop_at_exit)
        code = None
        if proc is not None:
            code = proc.poll()
            if code is None:
                _killpg(proc.pid, signal.SIGTERM)
                try:
                    code = proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "%s pid %d ignored SIGTERM for %.0f s; killing", self.kind, proc.pid, grace_s
                    )
                    _killpg(proc.pid, signal.SIGKILL)
                    code = proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group start_new_session made; its id is the PID we started
    except (ProcessLookupError, PermissionError):
        pass
