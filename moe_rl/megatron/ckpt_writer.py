"""megatron-core's checkpoint writer (``dist_checkpointing.strategies.filesystem_async``), made to
survive a signal to the process group and to report what its workers met.

- :func:`signal_proof_writer_queue`: the writer hands its results back through a multiprocessing
  Manager queue whose server process it starts at the first save; moe-rl starts that server
  itself, ignoring SIGTERM and SIGINT and ending with its parent.
- :func:`guarded_writer`: megatron-core 0.19 writes in threads of the saving process and
  loses a worker's exception on the way back: ``write_preloaded_data_multiproc``'s
  ``check_local_output`` logs it, then asserts the result is a list, and the ``AssertionError``
  whose text is the exception's class (``<class 'OSError'>``) becomes the save's ``RuntimeError``,
  unchained. A full disk then read as a traceback with no errno and no path. moe-rl keeps each
  failure a writer returns (a wrapper around ``FileSystemWriterAsync.write_preloaded_data``) and
  raises the first one from megatron-core's exception, as megatron-core 0.16 raises it (its
  workers are forked processes whose exception comes back whole).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import queue
import signal
import threading
from contextlib import contextmanager
from multiprocessing.managers import SyncManager

from moe_rl.errors import wrapped_exceptions

_WRITER_MANAGER = None
_FAILURES: list[BaseException] = []
"""The exceptions writer workers of this process returned during the current save (appended from
the writer threads: list.append is atomic)."""


def _writer_server_init() -> None:
    """In the writer queue's server process: survive SIGTERM / SIGINT, end with the parent."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()

    def exit_with_parent() -> None:
        parent.join()
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()


def signal_proof_writer_queue() -> None:
    """megatron-core's checkpoint writer hands its results back through a multiprocessing
    Manager queue, whose server process it starts at the first save (``filesystem_async.
    _get_write_results_queue``, megatron-core 0.16.1; ``get_write_results_queue`` from 0.17, the
    same module-level ``_results_queue``). A SIGTERM sent to the whole process group
    (Slurm's time limit or ``scancel``, ``kill -- -PGID``) ended that server, and the save the
    signal asked for failed with ``BrokenPipeError``. Start the queue here instead, with a server
    that ignores SIGTERM and SIGINT and exits when its parent process ends. Idempotent; nothing
    is done where megatron-core has no such queue."""
    global _WRITER_MANAGER

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", "absent") is not None:  # made already, or not this layout
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(_writer_server_init)
    fa._results_queue, _WRITER_MANAGER = manager.Queue(), manager


def _keep(result) -> None:
    """Keep the exception of a writer's result ``(index, results or exception)``."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], BaseException):
        _FAILURES.append(result[1])


class _Tap:
    """A writer thread's results queue, its results seen on the way in (:func:`_keep`)."""

    def __init__(self, inner: queue.Queue):
        self.inner = inner

    def put(self, item, *args, **kwargs):
        _keep(item)
        return self.inner.put(item, *args, **kwargs)


def record_writer_failures() -> None:
    """Wrap ``FileSystemWriterAsync.write_preloaded_data`` (a staticmethod; its signature kept,
    which megatron-core inspects) so that a failure it reports is kept in :data:`_FAILURES`: the
    main worker returns ``(index, exception)``, a writer thread puts it on its results queue.
    Writers in forked processes (megatron-core 0.16) are not seen, nor need to be. Idempotent;
    nothing is done where megatron-core has no such writer."""
    try:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    except ImportError:
        return
    write = FileSystemWriterAsync.write_preloaded_data
    if getattr(write, "moe_rl_records_failures", False):
        return

    @functools.wraps(write)
    def recording(*args, **kwargs):
        if isinstance(kwargs.get("results_queue"), queue.Queue):  # a thread of this process
            kwargs["results_queue"] = _Tap(kwargs["results_queue"])
        out = write(*args, **kwargs)
        _keep(out)
        return out

    recording.moe_rl_records_failures = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(recording)


@contextmanager
def guarded_writer():
    """Around ``dist_checkpointing.save``: both adaptations made (idempotent); if the save fails
    and a writer worker's own exception was kept (:func:`record_writer_failures`) but is not among
    what megatron-core raised (:func:`~moe_rl.errors.wrapped_exceptions`), that exception is
    raised from megatron-core's."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    signal_proof_writer_queue()
    record_writer_failures()
    _FAILURES.clear()
    try:
        yield
    except (Exception, CheckpointException) as e:
        raised = {id(x) for x in wrapped_exceptions(e)}
        lost = [f for f in _FAILURES if id(f) not in raised]
        if lost:
            raise lost[0] from e
        raise
    finally:
        _FAILURES.clear()
