"""The weight-update session every push runs inside, and what a push reports.

pause generation -> begin the atomic session (``moe-rl serve``; absent on SGLang 0.5.x) ->
apply (the transport's work) -> set ``weight_version`` -> end the session -> continue generation.
A failure aborts the session, continues generation and raises :class:`WeightSyncError` saying
what the server now serves. The transports are :mod:`.distributed` and :mod:`.disk`.

Field names: ``python/sglang/srt/managers/io_struct.py`` (sgl-project/sglang),
UpdateWeightVersionReqInput, PauseGenerationReqInput, BeginWeightUpdateReqInput.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from moe_rl.rollout.sglang_client import SGLangClient, SGLangError

logger = logging.getLogger(__name__)


class WeightSyncError(SGLangError):
    """A push failed. ``server_may_be_mixed`` is True only when the server has no atomic
    update session and some buckets were already applied."""

    server_may_be_mixed: bool = False


@dataclass
class PushReport:
    """What one push moved and how long it took."""

    method: str
    "distributed | disk"
    version: str
    "weight_version the server now serves."
    num_tensors: int
    "HF tensors pushed."
    num_buckets: int
    "HTTP update calls (distributed) or safetensors shards (disk)."
    bytes: int
    "Payload bytes."
    seconds: float
    "Wall time of the whole push."
    paused_s: float
    "Time generation was paused on the server."
    write_s: float = 0.0
    "Disk only: time spent writing the checkpoint (before pausing)."
    session: bool = False
    "Whether an atomic begin/end weight-update session was used."

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


def run_update_session(
    client: SGLangClient,
    version: str,
    apply: Callable[[], None],
    applied_any: Callable[[], bool] = lambda: True,
) -> tuple[float, bool]:
    """pause -> begin session -> apply -> set weight_version -> end session -> continue.

    On failure the session is aborted (``moe-rl serve`` then keeps its previous weights and
    version), generation is continued, and WeightSyncError says what the server now serves.
    Returns (seconds generation was paused, whether a session was used).
    """
    t0 = time.perf_counter()
    opened = used_session = False
    error = None
    try:
        client.pause_generation()
        opened = used_session = client.begin_weight_update()
        apply()
        client.update_weight_version(version, abort_all_requests=False)
        if opened:
            client.end_weight_update()
            opened = False
    except BaseException as e:  # noqa: BLE001 - re-raised below as WeightSyncError
        error = e
        if opened:
            try:
                client.end_weight_update(abort=True)
            except Exception as e2:  # noqa: BLE001
                logger.warning("aborting the weight-update session failed: %s", e2)
    try:
        client.continue_generation()
    except Exception as e:  # noqa: BLE001
        error = error or e
    paused_s = time.perf_counter() - t0
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt / SystemExit: cleaned up above, not a push failure
    if error is not None:
        raise _push_failed(client, version, error, applied_any()) from error
    served = client.get_weight_version()
    if served != version:
        raise WeightSyncError(
            f"pushed weights {version!r} to {client.base_url} but it serves weight_version {served!r}"
        )
    return paused_s, used_session


def _push_failed(client: SGLangClient, version: str, error: BaseException, applied: bool) -> WeightSyncError:
    try:
        served = repr(client.get_weight_version())
    except Exception:  # noqa: BLE001
        served = "unknown (server unreachable)"
    mixed = applied and not client.atomic_weight_updates
    state = (
        f"the server may hold a mix of old and new weights (no atomic update session); it reports "
        f"weight_version {served}"
        if mixed
        else f"the server kept its previous weights and serves weight_version {served}"
    )
    err = WeightSyncError(
        f"pushing weights {version!r} to {client.base_url} failed: {type(error).__name__}: {error}. {state}"
    )
    err.server_may_be_mixed = mixed
    return err
