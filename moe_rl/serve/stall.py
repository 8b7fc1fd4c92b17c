"""Abandoned update sessions and pauses, and health, for ``moe-rl serve`` (a mixin of SGLangProtocolApp).

A trainer that dies between ``/pause_generation`` and ``/continue_generation``, or between
``/begin_weight_update`` and ``/end_weight_update``, would leave every ``/generate`` waiting
forever. Each admin request (:data:`STALL_PATHS`) marks the server busy while it runs and then
touches a clock; when no admin request has run for ``limits.stall_timeout_s`` seconds
(``--moe-rl-stall-timeout``) the open session is discarded (the served weights and
weight_version stay as they were) and the pause is lifted. The abort is logged as a warning,
listed under ``moe_rl_aborts`` in ``/server_info`` and named by the next ``/end_weight_update``
or in-session update, which then fail with SGLang's no-session message plus the reason.

Health, as SGLang (``srt/entrypoints/http_server.py``): ``/health`` is liveness (200 while the
process serves; SGLang's with ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``); ``/health_generate``
generates one token and answers 503 while generation is paused, an update session is open, memory
is released, or the engine stays busy past ``limits.health_timeout_s`` (SGLang's
HEALTH_CHECK_TIMEOUT, 20 s). Ours: the 503 carries ``{"status": "unhealthy", "reason": ...}``
(SGLang sends no body; clients read only the status).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from moe_rl.rollout.types import SamplingParams

logger = logging.getLogger(__name__)

STALL_PATHS = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/begin_weight_update",
        "/end_weight_update",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)
"Requests of a weight push: each one keeps an open session or pause alive."
MAX_ABORTS_KEPT = 20


class StallGuard:
    """Needs from the app: cond, engine, engine_lock, limits, paused, session, released, active, version."""

    def _init_stall(self) -> None:
        self.admin_busy = 0
        self.admin_touched = time.monotonic()
        self.aborts: list[dict[str, Any]] = []
        "The aborted sessions and pauses, newest last (``/server_info`` ``moe_rl_aborts``)."
        self.session_abort: str | None = None
        "Why the last session was aborted, until the next /begin_weight_update."

    def _admin_begin(self) -> None:
        with self.cond:
            self.admin_busy += 1
            self.admin_touched = time.monotonic()

    def _admin_end(self) -> None:
        with self.cond:
            self.admin_busy -= 1
            self.admin_touched = time.monotonic()
            self.cond.notify_all()

    def _stalled_s(self) -> float | None:
        """Seconds until an open session or pause is due for abort (0: now), None when none can be."""
        if self.admin_busy or not (self.paused or self.session is not None):
            return None
        return max(0.0, self.admin_touched + self.limits.stall_timeout_s - time.monotonic())

    def _expire_locked(self) -> None:
        """Abort the session and the pause when due (call with ``self.cond`` held)."""
        if self._stalled_s() != 0.0:
            return
        idle = time.monotonic() - self.admin_touched
        what = []
        if self.session is not None:
            what.append(f"weight-update session ({len(self.session.staged)} staged tensors discarded)")
            self.session = None
        if self.paused:
            what.append("generation pause")
            self.paused = False
        message = (
            f"{' and '.join(what)} aborted after {idle:.0f} s without an admin request "
            f"(--moe-rl-stall-timeout {self.limits.stall_timeout_s:g}); weights and weight_version "
            f"{self.version!r} unchanged"
        )
        logger.warning("moe-rl serve: %s", message)
        self.aborts = [*self.aborts, {"time": time.time(), "message": message}][-MAX_ABORTS_KEPT:]
        if "session" in what[0]:
            self.session_abort = message
        self.cond.notify_all()

    def _wait_open(self, ready) -> None:
        """Wait (``self.cond`` held) until ``ready()``, aborting a stalled session or pause when due."""
        while True:
            self._expire_locked()
            if ready():
                return
            due = self._stalled_s()
            self.cond.wait(timeout=None if due is None else max(due, 0.01))

    def last_abort_note(self) -> str:
        """`` (<why the session was aborted>)`` after an abort of the last session, else empty."""
        return f" ({self.session_abort})" if self.session_abort else ""

    # ----------------------------------------------------------------- health
    def health(self, body: dict) -> tuple[int, Any]:
        return 200, None

    def _unhealthy(self) -> str | None:
        """Why generation cannot run now, or None (then counted as active: call _leave_health)."""
        with self.cond:
            self._expire_locked()
            if self.paused:
                return "generation is paused (/pause_generation); /continue_generation resumes it"
            if self.session is not None:
                return "a weight-update session is open; /end_weight_update closes it"
            if self.released:
                return f"memory {sorted(self.released)} is released; /resume_memory_occupation restores it"
            self.active += 1
        return None

    def _leave_health(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def ready(self, body: dict) -> tuple[int, Any]:
        """SGLang's /ready: 503 while paused."""
        with self.cond:
            self._expire_locked()
            paused = self.paused
        return (503, {"status": "unhealthy", "reason": "generation is paused"}) if paused else (200, None)

    def health_generate(self, body: dict) -> tuple[int, Any]:
        """Generate one token like SGLang's /health_generate: 503 with the reason when it cannot."""
        reason = self._unhealthy()
        if reason:
            return 503, {"status": "unhealthy", "reason": reason}
        timeout = self.limits.health_timeout_s
        try:
            if not self.engine_lock.acquire(timeout=timeout):
                reason = f"the engine stayed busy for {timeout:g} s (--moe-rl-health-timeout)"
                logger.error("health_generate: %s", reason)
                return 503, {"status": "unhealthy", "reason": reason}
            try:
                self.engine.generate([[0]], 1, SamplingParams(max_new_tokens=1, temperature=0.0))
            finally:
                self.engine_lock.release()
            return 200, None
        except Exception as e:  # noqa: BLE001 - unhealthy
            logger.error("health_generate failed: %s", e)
            return 503, {"status": "unhealthy", "reason": f"generation failed: {type(e).__name__}: {e}"}
        finally:
            self._leave_health()
