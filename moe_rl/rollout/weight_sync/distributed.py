"""Push trainer weights (HF names) to an SGLang server or ``moe-rl serve``.

Two ways, both inside the same update session (see :func:`run_update_session`):

- distributed: a separate gloo/nccl process group (trainer = rank 0, server ranks from
  ``rank_offset``) is created once with ``POST /init_weights_update_group``; every bucket is
  announced with ``POST /update_weights_from_distributed`` {names, dtypes, shapes, group_name,
  flush_cache, weight_version} from a thread (the call blocks until the server has received
  every tensor) while this process broadcasts each tensor from rank 0. This is how slime
  drives SGLang (THUDM/slime ``slime/backends/megatron_utils/update_weight/
  update_weight_from_distributed.py`` and ``slime/backends/sglang_utils/sglang_engine.py``).
- disk: HF-named safetensors shards (+ ``model.safetensors.index.json``) are written to a temp
  directory renamed into place, then ``POST /update_weights_from_disk`` {model_path,
  weight_version} loads them.

Field names: ``python/sglang/srt/managers/io_struct.py`` (sgl-project/sglang),
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
UpdateWeightFromDiskReqInput, UpdateWeightVersionReqInput.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from moe_rl.rollout.sglang_client import SGLangClient, SGLangError
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


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (what SGLang's ``getattr(torch, dtype)`` reads back)."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError for anything else."""
    attr = getattr(torch, name.replace("torch.", ""), None) if isinstance(name, str) else None
    if not isinstance(attr, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as 'bfloat16'")
    return attr


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_custom_process_group(
    *, backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> Any:
    """A process group outside the default one, as SGLang builds its weight-update group.

    Mirrors ``init_custom_process_group`` in sgl-project/sglang ``python/sglang/srt/utils``
    (TCP rendezvous, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``), so
    the trainer side and SGLang's side agree on store keys. Rank 0 hosts the TCPStore.
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


def _in_thread(fn: Callable[[], Any], box: dict) -> threading.Thread:
    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=run, name="sglang-weight-update", daemon=True)
    th.start()
    return th


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
    """Push by broadcast over a dedicated gloo (CPU) or nccl (GPU) group; trainer is rank 0.

    ``world_size`` is 1 + the server's tensor-parallel size; the server's ranks start at
    ``rank_offset`` (SGLang: rank = rank_offset + tp_rank).
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        rank_offset: int = 1,
        world_size: int = 2,
        group_name: str = "moe_rl_weight_update",
        backend: str | None = None,
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
    ):
        self.client, self.master_address, self.master_port = client, master_address, master_port
        self.rank_offset, self.world_size, self.group_name = rank_offset, world_size, group_name
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

    def connect(self) -> None:
        """Create the group (once): the server joins from its HTTP handler, we join as rank 0."""
        if self._group is not None:
            return
        port = self.master_port or free_port(self.master_address)
        name = self.group_name if self._connects == 0 else f"{self.group_name}-{self._connects}"
        self._connects += 1
        box: dict = {}
        th = _in_thread(
            lambda: self.client.init_weights_update_group(
                master_address=self.master_address,
                master_port=port,
                rank_offset=self.rank_offset,
                world_size=self.world_size,
                group_name=name,
                backend=self.backend,
                timeout_s=self.timeout_s,
            ),
            box,
        )
        try:
            group = init_custom_process_group(
                backend=self.backend,
                init_method=f"tcp://{self.master_address}:{port}",
                world_size=self.world_size,
                rank=0,
                group_name=name,
                timeout=timedelta(seconds=self.timeout_s),
            )
        except Exception as e:
            th.join(5.0)
            raise WeightSyncError(
                f"could not form weight-update group {name!r} at "
                f"{self.master_address}:{port} with {self.client.base_url}: {e}; "
                f"server said: {box.get('error') or box.get('result')}"
            ) from e
        th.join(self.timeout_s)
        if "error" in box or th.is_alive():
            destroy_process_group(group)
            raise WeightSyncError(
                f"{self.client.base_url} did not join weight-update group {name!r}: "
                f"{box.get('error', 'timed out')}"
            )
        self._group, self._active_name = group, name
        logger.info(
            "weight-update group %r formed with %s (%s, world %d)",
            name,
            self.client.base_url,
            self.backend,
            self.world_size,
        )

    def push(self, source: HFStateSource, version: str) -> PushReport:
        """Broadcast every tensor of ``source``; the server then serves ``version``."""
        self.connect()
        stats = {"tensors": 0, "buckets": 0, "bytes": 0}

        def apply() -> None:
            for bucket, last in _buckets(source.hf_tensors(), self.bucket_bytes):
                self._send_bucket(bucket, version if last else None, flush=last)
                stats["buckets"] += 1
                stats["tensors"] += len(bucket)
                stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)

        t0 = time.perf_counter()
        paused_s, session = run_update_session(
            self.client, version, apply, applied_any=lambda: stats["buckets"] > 0
        )
        report = PushReport(
            method="distributed",
            version=version,
            num_tensors=stats["tensors"],
            num_buckets=stats["buckets"],
            bytes=stats["bytes"],
            seconds=time.perf_counter() - t0,
            paused_s=paused_s,
            session=session,
        )
        logger.info(
            "pushed %s: %d tensors, %.1f MB in %.2f s (%d buckets)",
            version,
            report.num_tensors,
            report.bytes / 1e6,
            report.seconds,
            report.num_buckets,
        )
        return report

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str | None, flush: bool) -> None:
        tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
        box: dict = {}
        th = _in_thread(
            lambda: self.client.update_weights_from_distributed(
                names=[n for n, _ in bucket],
                dtypes=[dtype_name(t.dtype) for t in tensors],
                shapes=[list(t.shape) for t in tensors],
                group_name=self._active_name,
                flush_cache=flush,
                weight_version=version,
                timeout_s=self.timeout_s,
            ),
            box,
        )
        deadline = time.monotonic() + self.timeout_s
        try:
            works = [self._group.broadcast(t, 0) for t in tensors]
            for w in works:
                while not w.is_completed():
                    if "error" in box:
                        raise box["error"]
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"broadcast not received within {self.timeout_s:.0f} s")
                    time.sleep(0.0005)
                w.wait()
        except BaseException:
            self._drop_group()
            th.join(1.0)
            raise
        th.join(max(1.0, deadline - time.monotonic()))
        if th.is_alive():
            self._drop_group()
            raise TimeoutError(f"{self.client.base_url} did not finish the update call")
        if "error" in box:
            raise box["error"]

    def _drop_group(self) -> None:
        """A failed broadcast leaves the group unusable: forget it, reconnect next push."""
        if self._group is not None:
            destroy_process_group(self._group)
        self._group = None

    def close(self) -> None:
        """Destroy the group on both sides (best effort)."""
        if self._group is None:
            return
        try:
            self.client.destroy_weights_update_group(self._active_name)
        except Exception as e:  # noqa: BLE001
            logger.warning("server did not destroy weight-update group: %s", e)
        self._drop_group()


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def write_hf_checkpoint(
    named: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    max_shard_bytes: int = 4 << 30,
    metadata_from: str | Path | None = None,
) -> tuple[int, int, int]:
    """Write HF-named safetensors shards + index to ``out_dir`` atomically (temp dir, rename).

    Copies ``*.json`` (config, generation config, tokenizer) from ``metadata_from`` when given.
    Returns (bytes, tensors, shards).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        total = shard_bytes = shards = 0

        def flush() -> None:
            nonlocal shard, shard_bytes, shards
            if shard:
                shards += 1
                fname = f"model-{shards:05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
                shard, shard_bytes = {}, 0

        for name, t in named:
            if name in weight_map or name in shard:
                raise WeightSyncError(f"the weight source yielded {name!r} twice")
            t = t.detach().to("cpu")
            if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.contiguous().clone()
            nbytes = t.numel() * t.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()
            shard[name] = t
            shard_bytes += nbytes
            total += nbytes
        flush()
        if not weight_map:
            raise WeightSyncError("the weight source yielded no tensors")
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        if metadata_from is not None:
            for f in Path(metadata_from).glob("*.json"):
                if f.name != "model.safetensors.index.json":
                    shutil.copy2(f, tmp / f.name)
        _replace_dir(tmp, out)
        return total, len(weight_map), shards
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(src: Path, dst: Path) -> None:
    trash = None
    if dst.exists():
        trash = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, trash)
    os.rename(src, dst)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def validate_hf_tensors(
    named: dict[str, torch.Tensor], meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> None:
    """Every name known, every shape and dtype equal to the served ones; ValueError names the first."""
    for name, t in named.items():
        if name not in meta:
            raise ValueError(f"{name!r} is not a weight of the served model")
        shape, dtype = meta[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name!r}: shape {list(t.shape)} does not match the served {list(shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name!r}: dtype {t.dtype} does not match the served {dtype}")


def read_hf_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (index-aware)."""
    from safetensors.torch import load_file

    root = Path(path)
    index = root / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else sorted(p.name for p in root.glob("*.safetensors"))
    )
    if not files:
        raise ValueError(f"no *.safetensors in {root}")
    named: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(root / f))
        dup = set(part) & set(named)
        if dup:
            raise ValueError(f"{sorted(dup)[0]!r} appears in more than one shard")
        named.update(part)
    return named


class DiskWeightSync:
    """Push through HF safetensors on a filesystem the server can read.

    ``server_root_dir`` is the same directory as the server sees it (default: ``root_dir``).
    The last ``keep_last`` checkpoints this object wrote are kept; older ones are deleted.
    """

    def __init__(
        self,
        client: SGLangClient,
        root_dir: str | Path,
        *,
        server_root_dir: str | Path | None = None,
        max_shard_bytes: int = 4 << 30,
        keep_last: int = 2,
        metadata_from: str | Path | None = None,
        timeout_s: float = 600.0,
    ):
        self.client, self.root = client, Path(root_dir)
        self.server_root = Path(server_root_dir) if server_root_dir is not None else self.root
        self.max_shard_bytes, self.keep_last = max_shard_bytes, max(1, keep_last)
        self.metadata_from, self.timeout_s = metadata_from, timeout_s
        self._written: list[Path] = []

    def push(self, source: HFStateSource, version: str) -> PushReport:
        """Write the checkpoint (generation keeps running), then load it on the server."""
        t0 = time.perf_counter()
        name = _SAFE.sub("_", version) or "weights"
        nbytes, ntensors, nshards = write_hf_checkpoint(
            source.hf_tensors(),
            self.root / name,
            max_shard_bytes=self.max_shard_bytes,
            metadata_from=self.metadata_from,
        )
        write_s = time.perf_counter() - t0
        server_path = str(self.server_root / name)
        self._remember(self.root / name)
        paused_s, session = run_update_session(
            self.client,
            version,
            lambda: self.client.update_weights_from_disk(
                server_path, weight_version=version, timeout_s=self.timeout_s
            ),
        )
        report = PushReport(
            method="disk",
            version=version,
            num_tensors=ntensors,
            num_buckets=nshards,
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            paused_s=paused_s,
            write_s=write_s,
            session=session,
        )
        logger.info(
            "pushed %s via %s: %d tensors, %.1f MB, write %.2f s, load %.2f s",
            version,
            server_path,
            ntensors,
            nbytes / 1e6,
            write_s,
            paused_s,
        )
        return report

    def _remember(self, path: Path) -> None:
        if path in self._written:
            self._written.remove(path)
        self._written.append(path)
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)

    def close(self) -> None:
        """Nothing to release (checkpoints stay on disk)."""
