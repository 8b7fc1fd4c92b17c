"""The weight-update session every push runs inside, and what a push reports.

pause generation -> begin the session (SGLang 0.5.23 requires it around distributed and tensor
updates; absent on 0.5.11; atomic on ``moe-rl serve``; never around disk loads) -> apply (the
transport's work) -> set ``weight_version`` -> end the session -> continue generation, on every
engine, then each engine's ``/model_info`` weight version is checked.
A failure aborts the session, continues generation and raises :class:`WeightSyncError` saying
what the server now serves. The transports are :mod:`.distributed` and :mod:`.disk`.

Field names: ``python/sglang/srt/managers/io_struct.py`` (sgl-project/sglang),
UpdateWeightVersionReqInput, PauseGenerationReqInput, BeginWeightUpdateReqInput.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_protocol import SGLangError
from moe_rl.rollout.types import HFStateSource

logger = logging.getLogger(__name__)


class WeightSyncError(SGLangError):
    """A push failed. ``server_may_be_mixed`` is True only when the server has no atomic
    update session and some buckets were already applied."""

    server_may_be_mixed: bool = False


@dataclass
class PushReport:
    """What one push moved and how long it took."""

    method: str
    "distributed | disk | tensor"
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


def push_buckets(
    method: str,
    clients: list[SGLangClient],
    version: str,
    buckets: Iterable[tuple[list[tuple[str, torch.Tensor]], bool]],
    send: Callable[[list[tuple[str, torch.Tensor]], bool], None],
) -> PushReport:
    """Send every ``(bucket, is_last)`` with ``send`` inside the update session
    (:func:`run_update_session`) and report what moved; the buckets are read lazily, in it."""
    stats = {"tensors": 0, "buckets": 0, "bytes": 0}

    def apply() -> None:
        for bucket, last in buckets:
            send(bucket, last)
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)
            stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)

    t0 = time.perf_counter()
    paused_s, session = run_update_session(clients, version, apply, applied_any=lambda: stats["buckets"] > 0)
    report = PushReport(
        method=method,
        version=version,
        num_tensors=stats["tensors"],
        num_buckets=stats["buckets"],
        bytes=stats["bytes"],
        seconds=time.perf_counter() - t0,
        paused_s=paused_s,
        session=session,
    )
    logger.info(
        "pushed %s by %s: %d tensors, %.1f MB in %.2f s (%d buckets)",
        version,
        method,
        report.num_tensors,
        report.bytes / 1e6,
        report.seconds,
        report.num_buckets,
    )
    return report


def _as_list(clients: SGLangClient | list[SGLangClient]) -> list[SGLangClient]:
    return list(clients) if isinstance(clients, (list, tuple)) else [clients]


def run_update_session(
    clients: SGLangClient | list[SGLangClient],
    version: str,
    apply: Callable[[], None],
    applied_any: Callable[[], bool] = lambda: True,
    *,
    session: bool = True,
) -> tuple[float, bool]:
    """pause -> [begin session] -> apply -> set weight_version -> [end session] -> continue, on every engine.

    ``session``: open SGLang's begin/end weight-update session where the server has one (current
    SGLang requires it around distributed and tensor updates; disk loads run without it). On
    failure the sessions are aborted (``moe-rl serve`` then keeps its previous weights and
    version), generation is continued, and WeightSyncError says what each engine now serves.
    Afterwards every engine must report ``version`` (read from ``/model_info``).
    Returns (seconds generation was paused, whether a session was used).
    """
    clients = _as_list(clients)
    t0 = time.perf_counter()
    opened: list[SGLangClient] = []
    error = None
    try:
        for c in clients:
            c.pause_generation()
        if session:
            opened = [c for c in clients if c.begin_weight_update()]
        apply()
        for c in clients:
            c.update_weight_version(version, abort_all_requests=False)
        while opened:
            opened[0].end_weight_update()
            opened.pop(0)
    except BaseException as e:  # noqa: BLE001 - re-raised below as WeightSyncError
        error = e
        for c in opened:
            try:
                c.end_weight_update(abort=True)
            except Exception as e2:  # noqa: BLE001
                logger.warning("aborting the weight-update session on %s failed: %s", c.base_url, e2)
    for c in clients:
        try:
            c.continue_generation()
        except Exception as e:  # noqa: BLE001
            error = error or e
    paused_s = time.perf_counter() - t0
    if error is not None and not isinstance(error, Exception):
        raise error  # KeyboardInterrupt / SystemExit: cleaned up above, not a push failure
    if error is not None:
        raise _push_failed(clients, version, error, applied_any()) from error
    for c in clients:
        served = c.get_weight_version()
        if served != version:
            raise WeightSyncError(
                f"pushed weights {version!r} to {c.base_url} but it serves weight_version {served!r}"
            )
    return paused_s, session and bool(clients) and clients[0].supports_weight_update_session() is True


def _push_failed(
    clients: list[SGLangClient], version: str, error: BaseException, applied: bool
) -> WeightSyncError:
    states, mixed = [], False
    for c in clients:
        try:
            served = repr(c.get_weight_version())
        except Exception:  # noqa: BLE001
            served = "unknown (server unreachable)"
        c_mixed = applied and not c.atomic_weight_updates
        mixed |= c_mixed
        states.append(
            f"{c.base_url} may hold a mix of old and new weights (no atomic update session); it reports "
            f"weight_version {served}"
            if c_mixed
            else f"{c.base_url} kept its previous weights and serves weight_version {served}"
        )
    where = clients[0].base_url if len(clients) == 1 else f"{len(clients)} engines"
    err = WeightSyncError(
        f"pushing weights {version!r} to {where} failed: {type(error).__name__}: {error}. "
        + "; ".join(states)
    )
    err.server_may_be_mixed = mixed
    return err


def source_tensors(source: HFStateSource, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``source.hf_tensors()`` on ``device``: asked of the source where it takes ``device=``
    (:class:`~moe_rl.megatron.hf.PolicyHFSource`: no CPU copy on a GPU), else moved here."""
    try:
        takes_device = "device" in inspect.signature(source.hf_tensors).parameters
    except (TypeError, ValueError):
        takes_device = False
    tensors = source.hf_tensors(device=device) if takes_device else source.hf_tensors()
    for name, t in tensors:
        yield name, (t if t.device == device else t.to(device))
