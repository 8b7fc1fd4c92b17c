"""Push weights by broadcast over a dedicated gloo (CPU) or nccl (GPU) process group.

A separate group (trainer = rank 0, server ranks from ``rank_offset``) is created once with
``POST /init_weights_update_group``; every bucket is announced with
``POST /update_weights_from_distributed`` {names, dtypes, shapes, group_name, flush_cache,
weight_version} from a thread (the call blocks until the server has received every tensor)
while this process broadcasts each tensor from rank 0, inside the update session of
:mod:`.session`. This is how slime drives SGLang (THUDM/slime
``slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py`` and
``slime/backends/sglang_utils/sglang_engine.py``).

Field names: ``python/sglang/srt/managers/io_struct.py`` (sgl-project/sglang),
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from moe_rl.dist import free_port, host_port
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.types import HFStateSource
from moe_rl.rollout.weight_sync.address import bound_to, tcp_url, trainer_address
from moe_rl.rollout.weight_sync.session import PushReport, WeightSyncError, push_buckets, source_tensors

logger = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (what SGLang's ``getattr(torch, dtype)`` reads back)."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError for anything else."""
    attr = getattr(torch, name.replace("torch.", ""), None) if isinstance(name, str) else None
    if not isinstance(attr, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as 'bfloat16'")
    return attr


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
    local_address: str | None = None,
) -> Any:
    """A process group outside the default one, as SGLang builds its weight-update group.

    Mirrors ``init_custom_process_group`` in sgl-project/sglang ``python/sglang/srt/utils``
    (TCP rendezvous, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``), so
    the trainer side and SGLang's side agree on store keys. Rank 0 hosts the TCPStore.
    ``local_address``: this side's address toward the peers; gloo/NCCL then use its interface.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    with bound_to(local_address, backend):
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            store,
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: Any) -> None:
    """Tear down a group made by :func:`init_custom_process_group` (errors are logged)."""
    try:
        torch.distributed.destroy_process_group(pg)
    except Exception as e:  # noqa: BLE001 - best effort teardown
        logger.warning("destroying weight-update group failed: %s", e)


def _teardown(held: list) -> None:
    """Destroy the group ``held`` holds, dropping the last reference to it in this thread."""
    destroy_process_group(held.pop())


def _in_thread(fn: Callable[[], Any], box: dict) -> threading.Thread:
    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, name="sglang-weight-update", daemon=True)
    th.start()
    return th


def _buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group tensors into buckets of about ``bucket_bytes``; yields (bucket, is_last)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if not bucket:
        raise WeightSyncError("the weight source yielded no tensors")
    yield bucket, True


class DistributedWeightSync:
    """Push by broadcast over one dedicated gloo (CPU) or nccl (GPU) group to every engine.

    The trainer is rank 0; engine ``i`` (tensor-parallel size ``tp_sizes[i]``) takes the ranks from
    ``rank_offset = 1 + sum(tp_sizes[:i])`` (SGLang: rank = rank_offset + tp_rank), as slime builds
    the group; ``world_size = 1 + sum(tp_sizes)``. ``master_address`` (None: :func:`trainer_address`
    of the engines' hosts) is where the engines reach the trainer's TCPStore. Single-engine
    callers may still pass ``world_size`` (= 1 + its TP size) and ``rank_offset``.
    """

    def __init__(
        self,
        client: SGLangClient | list[SGLangClient],
        *,
        master_address: str | None = None,
        master_port: int | None = None,
        tp_sizes: list[int] | None = None,
        rank_offset: int = 1,
        world_size: int | None = None,
        group_name: str = "moe_rl_weight_update",
        backend: str | None = None,
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
    ):
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.client = self.clients[0]
        if tp_sizes is None:
            tp_sizes = (
                [world_size - rank_offset] if world_size is not None and len(self.clients) == 1 else None
            )
            tp_sizes = tp_sizes or [1] * len(self.clients)
        if len(tp_sizes) != len(self.clients) or min(tp_sizes) < 1:
            raise ValueError(
                f"tp_sizes {tp_sizes} must give a size >= 1 for each of {len(self.clients)} engines"
            )
        self.rank_offsets = [rank_offset + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
        self.world_size = rank_offset + sum(tp_sizes)
        self.rank_offset = rank_offset
        master_address = trainer_address([c.host for c in self.clients], configured=master_address)
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._group: Any = None
        self._active_name: str | None = None
        self._connects = 0

    def _on_every_engine(
        self, call: Callable[[SGLangClient, int], Any]
    ) -> list[tuple[threading.Thread, dict]]:
        """Start ``call(client, i)`` for every engine in its own thread (the calls block on the group)."""
        out = []
        for i, c in enumerate(self.clients):
            box: dict = {}
            out.append((_in_thread(lambda c=c, i=i: call(c, i), box), box))
        return out

    def connect(self) -> None:
        """Create the group (once): every engine joins from its HTTP handler, we join as rank 0."""
        if self._group is not None:
            return
        port = self.master_port or free_port(self.master_address)
        name = self.group_name if self._connects == 0 else f"{self.group_name}-{self._connects}"
        self._connects += 1
        joins = self._on_every_engine(
            lambda c, i: c.init_weights_update_group(
                master_address=self.master_address,
                master_port=port,
                rank_offset=self.rank_offsets[i],
                world_size=self.world_size,
                group_name=name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
        )
        try:
            group = init_custom_process_group(
                backend=self.backend,
                init_method=tcp_url(self.master_address, port),
                world_size=self.world_size,
                rank=0,
                group_name=name,
                timeout=timedelta(seconds=self.timeout_s),
                local_address=self.master_address,
            )
        except Exception as e:
            for th, _ in joins:
                th.join(5.0)
            said = [box.get("error") or box.get("result") for _, box in joins]
            raise WeightSyncError(
                f"could not form weight-update group {name!r} at {host_port(self.master_address, port)} with "
                f"{[c.base_url for c in self.clients]}: {e}; servers said: {said}"
            ) from e
        failed = []
        for (th, box), c in zip(joins, self.clients):
            th.join(self.timeout_s)
            if "error" in box or th.is_alive():
                failed.append(f"{c.base_url}: {box.get('error', 'timed out')}")
        if failed:
            destroy_process_group(group)
            raise WeightSyncError(f"engines did not join weight-update group {name!r}: {'; '.join(failed)}")
        self._group, self._active_name = group, name
        logger.info(
            "weight-update group %r formed with %d engines at %s (%s, world %d, rank offsets %s)",
            name,
            len(self.clients),
            self.master_address,
            self.backend,
            self.world_size,
            self.rank_offsets,
        )

    def push(self, source: HFStateSource, version: str) -> PushReport:
        """Broadcast every tensor of ``source``; the server then serves ``version``."""
        self.connect()
        return push_buckets(
            "distributed",
            self.clients,
            version,
            _buckets(source_tensors(source, self.device), self.bucket_bytes),  # no host round trip
            lambda bucket, last: self._send_bucket(bucket, version if last else None, flush=last),
        )

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str | None, flush: bool) -> None:
        """Announce the bucket to every engine, broadcast each tensor once, wait for every engine."""
        tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
        calls = self._on_every_engine(
            lambda c, i: c.update_weights_from_distributed(
                names=[n for n, _ in bucket],
                dtypes=[dtype_name(t.dtype) for t in tensors],
                shapes=[list(t.shape) for t in tensors],
                group_name=self._active_name,
                flush_cache=flush,
                weight_version=version,
                timeout_s=self.timeout_s,
            )
        )
        deadline = time.monotonic() + self.timeout_s
        try:
            works = [self._group.broadcast(t, 0) for t in tensors]
            for w in works:
                while not w.is_completed():
                    for _, box in calls:
                        if "error" in box:
                            raise box["error"]
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"broadcast not received within {self.timeout_s:.0f} s")
                    time.sleep(0.0005)
                w.wait()
        except BaseException:
            self._drop_group(pending=True)
            for th, _ in calls:
                th.join(1.0)
            raise
        for (th, box), c in zip(calls, self.clients):
            th.join(max(1.0, deadline - time.monotonic()))
            if th.is_alive():
                self._drop_group(pending=True)
                raise TimeoutError(f"{c.base_url} did not finish the update call")
            if "error" in box:
                raise box["error"]

    def _drop_group(self, *, pending: bool = False) -> None:
        """Forget the group (a failed broadcast leaves it unusable; the next push reconnects).

        ``pending``: a broadcast of it may never complete (a bucket the server refused or never
        took). gloo's teardown joins its worker, which waits out the group's timeout (``timeout_s``,
        600 s by default) first: the push reported its error only then (30 s in
        tests/integration/test_sglang_e2e.py's failed push). That teardown runs on a daemon thread."""
        held, self._group = [self._group], None
        if held[0] is None:
            return
        if pending:  # the thread takes the only reference: the group's destructor joins there too
            threading.Thread(
                target=_teardown, args=(held,), daemon=True, name="weight-group-teardown"
            ).start()
        else:
            destroy_process_group(held.pop())

    def close(self) -> None:
        """Destroy the group on both sides (best effort)."""
        if self._group is None:
            return
        for c in self.clients:
            try:
                c.destroy_weights_update_group(self._active_name)
            except Exception as e:  # noqa: BLE001
                logger.warning("%s did not destroy weight-update group: %s", c.base_url, e)
        self._drop_group()
