"""Colocated push: ``POST /update_weights_from_tensor`` with flattened buckets (CUDA IPC on GPU).

When SGLang shares the trainer's GPUs (launched with ``--enable-memory-saver``), the trainer does
not broadcast: it hands SGLang handles to tensors it already holds, sent with
``load_format="flattened_bucket"`` inside the begin/end session, as slime does
(``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``).

The bucket is SGLang's ``FlattenedTensorBucket`` layout (``srt/weight_sync/tensor_bucket.py``,
the same in 0.5.11 and 0.5.23): ``{"flattened_tensor": <1-D uint8>, "metadata": [...]}``, every
tensor's bytes concatenated, and per tensor an object with the attributes ``name``, ``shape``
(``torch.Size``), ``dtype`` (``torch.dtype``), ``start_idx``, ``end_idx``, ``numel`` (byte offsets
and byte count). SGLang's model runner (``_update_weights_from_flattened_bucket``) reads these as
attributes (``meta.name``); a dict there raises AttributeError inside the scheduler. With
``sglang`` importable the bucket is built by SGLang's own ``FlattenedTensorBucket`` (its
``FlattenedTensorMetadata`` objects); without it, by the same code here with
``types.SimpleNamespace`` metadata, which SGLang's ``SafeUnpickler`` admits in both versions.

Serializers (each gives one payload per TP rank of an engine, ``serialized_named_tensors``; rank
``r`` deserializes entry ``r`` only):

- ``ipc`` (GPU): SGLang's ``MultiprocessingSerializer`` (``ForkingPickler``: CUDA IPC handles,
  base64) over tensors on the trainer's GPU (no CPU copy), after SGLang's
  ``monkey_patch_torch_reductions()`` (devices travel as UUIDs, so every SGLang rank opens the
  right GPU). The patch is undone afterwards when this module installed it: patched, torch's
  ``ForkingPickler`` fails on CPU tensors (IndexError), which other code in the trainer may send.
  Every rank of every engine gets its own serialization: CUDA IPC counts references per
  serialization, and deserializing one payload twice breaks that count (SGLang's
  ``deserialize_own_rank``). Each one is built by the trainer rank on that engine rank's own GPU
  (``payload_ranks``, as slime): a handle opens only on a GPU its reader sees. CPU tensors are
  refused: ``ForkingPickler`` passes them as file descriptors, which an unrelated process cannot
  open.
- ``bytes`` (CPU, ``moe-rl serve``): a plain pickle (base64) that carries the values, readable by
  SGLang's own ``MultiprocessingSerializer.deserialize`` in any process and by
  :func:`deserialize_bytes` (``moe-rl serve``, restricted unpickler, no code runs). The same text
  goes to every rank: it holds no handles.
"""

from __future__ import annotations

import base64
import functools
import io
import logging
import pickle
import types
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_rl import dist
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.types import HFStateSource
from moe_rl.rollout.weight_sync.session import PushReport, WeightSyncError, push_buckets, source_tensors

logger = logging.getLogger(__name__)

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
"Where SGLang's metadata class lives (what a payload built with sglang importable names)."


@functools.cache
def sglang_parts() -> types.SimpleNamespace | None:
    """SGLang's ``FlattenedTensorBucket``, ``MultiprocessingSerializer`` and
    ``monkey_patch_torch_reductions``, or None when ``sglang`` is not importable here."""
    try:
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        try:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:  # before sglang.srt.utils became a package
            from sglang.srt.patch_torch import monkey_patch_torch_reductions
    except ImportError as e:
        logger.debug("sglang is not importable (%s): building flattened buckets here", e)
        return None
    return types.SimpleNamespace(
        FlattenedTensorBucket=FlattenedTensorBucket,
        MultiprocessingSerializer=MultiprocessingSerializer,
        monkey_patch_torch_reductions=monkey_patch_torch_reductions,
    )


# ----------------------------------------------------------------- the bucket layout
def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """(name, tensor) pairs -> ``{"flattened_tensor": 1-D uint8, "metadata": [...]}``, SGLang's
    ``FlattenedTensorBucket`` layout (byte offsets), on the tensors' device."""
    if not named:
        raise ValueError("a flattened bucket needs at least one tensor")
    offset = 0
    for name, t in named:  # SGLang views each slice as its dtype: keep every start aligned
        if offset % t.element_size():
            raise ValueError(f"{name!r} ({t.dtype}) would start at byte {offset}: put one dtype per bucket")
        offset += t.numel() * t.element_size()
    named = [(name, t.detach()) for name, t in named]
    parts = sglang_parts()
    if parts is not None:
        b = parts.FlattenedTensorBucket(named_tensors=named)
        return {"flattened_tensor": b.get_flattened_tensor(), "metadata": b.get_metadata()}
    flats, meta, start = [], [], 0
    for name, t in named:
        flat = t.flatten().view(torch.uint8)
        n = flat.numel()
        meta.append(
            types.SimpleNamespace(
                name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + n, numel=n
            )
        )
        flats.append(flat)
        start += n
    return {"flattened_tensor": torch.cat(flats), "metadata": meta}


def unflatten_bucket(bucket: dict) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`flatten_bucket` (views into the flat tensor), as SGLang's
    ``FlattenedTensorBucket.reconstruct_tensors``; ValueError names what does not fit."""
    flat = bucket["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor: expected a 1-D uint8 tensor (SGLang's FlattenedTensorBucket)")
    out = []
    for m in bucket["metadata"]:
        try:
            name, shape, dtype = m.name, torch.Size(m.shape), m.dtype
            start, end, numel = int(m.start_idx), int(m.end_idx), int(m.numel)
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"bucket metadata {m!r}: not a FlattenedTensorMetadata ({e})") from e
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise ValueError(f"bucket metadata {m!r}: name must be a str and dtype a torch.dtype")
        nbytes = shape.numel() * dtype.itemsize
        if not 0 <= start <= end <= flat.numel() or end - start != nbytes or numel != nbytes:
            raise ValueError(
                f"{name!r}: bytes [{start}, {end}) numel {numel} do not hold {list(shape)} {dtype} "
                f"in a bucket of {flat.numel()} bytes"
            )
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


# ----------------------------------------------------------------- bytes (values, any process)
def _save_function(pickler: pickle._Pickler, obj) -> None:
    """pickle's own rule for a function (a reference by name), but torch's CPU storage loader
    always by torch's name: megatron-core 0.19 swaps ``torch.storage._load_from_bytes`` for its
    own at import (``megatron.core.safe_globals.safe_load_from_bytes``, the same bytes read
    ``weights_only``), so a storage pickled in the trainer named megatron-core, which SGLang's
    ``SafeUnpickler`` and :func:`deserialize_bytes` refuse and a server without it cannot import."""
    if obj is torch.storage._load_from_bytes:
        pickler.save("torch.storage")
        pickler.save("_load_from_bytes")
        pickler.write(pickle.STACK_GLOBAL)
        pickler.memoize(obj)
    else:
        pickle._Pickler.save_global(pickler, obj)


class _BytesPickler(pickle._Pickler):
    """pickle's Python pickler (a function's rule can be replaced there, not in the C one), with
    :func:`_save_function`. The bucket is one large bytes object and a list of metadata: the
    bytes go to the buffer as one write, as the C pickler writes them."""

    dispatch = {**pickle._Pickler.dispatch, types.FunctionType: _save_function}


def serialize_bytes(bucket: dict) -> str:
    """CPU serializer: a plain pickle of the bucket with its values on the CPU, base64; its storage
    loader named ``torch.storage._load_from_bytes`` whatever megatron-core did (:func:`_save_function`)."""
    buf = io.BytesIO()
    data = {"flattened_tensor": bucket["flattened_tensor"].detach().cpu(), "metadata": bucket["metadata"]}
    _BytesPickler(buf, protocol=4).dump(data)
    del data
    return base64.b64encode(buf.getbuffer()).decode("ascii")  # the buffer itself: no copy of the pickle


@dataclass
class _Metadata:
    """What SGLang's ``FlattenedTensorMetadata`` unpickles into here (``moe-rl serve`` has no sglang)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _load_storage(data: bytes):
    """``torch.storage._load_from_bytes`` without running code (``weights_only``), as SGLang 0.5.23."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


class _BucketUnpickler(pickle.Unpickler):
    """Admits only what :func:`serialize_bytes` writes: CPU tensors, sizes, dtypes, metadata."""

    GLOBALS = {
        ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _load_storage,
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): OrderedDict,
        ("types", "SimpleNamespace"): types.SimpleNamespace,
        SGLANG_METADATA: _Metadata,
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.GLOBALS:
            return self.GLOBALS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a 'bytes' weight payload (CPU servers take the 'bytes' serializer)"
        )


def deserialize_bytes(payload: str) -> dict:
    """Inverse of :func:`serialize_bytes` (restricted unpickler: no code runs)."""
    data = _BucketUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if not isinstance(data, dict) or not {"flattened_tensor", "metadata"} <= data.keys():
        raise ValueError("expected {'flattened_tensor': ..., 'metadata': [...]} (a flattened bucket)")
    return data


# ----------------------------------------------------------------- ipc (CUDA handles)
@contextmanager
def torch_reductions_patched(parts: types.SimpleNamespace):
    """SGLang's ``monkey_patch_torch_reductions()`` for the block; undone after it if it was not
    installed before (patched, ``ForkingPickler`` fails on CPU tensors)."""
    from torch.multiprocessing import reductions

    installed_here = not hasattr(reductions, "_reduce_tensor_original")
    parts.monkey_patch_torch_reductions()
    try:
        yield
    finally:
        if installed_here and hasattr(reductions, "_reduce_tensor_original"):
            reductions.reduce_tensor = reductions._reduce_tensor_original
            reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
            del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
            reductions.init_reductions()


def serialize_ipc(bucket: dict, copies: int = 1) -> list[str]:
    """GPU serializer: ``copies`` separate SGLang ``MultiprocessingSerializer`` payloads (one per
    TP rank: CUDA IPC counts references per serialization) of a bucket on the GPU."""
    flat = bucket["flattened_tensor"]
    if not flat.is_cuda:
        raise ValueError(
            f"the 'ipc' serializer sends CUDA IPC handles; this bucket is on {flat.device} "
            "(ForkingPickler would pass CPU tensors as file descriptors): use serializer='bytes'"
        )
    parts = sglang_parts()
    if parts is None:
        raise RuntimeError("the 'ipc' serializer needs sglang importable in the trainer (as slime does)")
    with torch_reductions_patched(parts):
        return [parts.MultiprocessingSerializer.serialize(bucket, output_str=True) for _ in range(copies)]


def _bytes_payloads(bucket: dict, copies: int = 1) -> list[str]:
    return [serialize_bytes(bucket)] * copies  # values, no handles: one text serves every rank


SERIALIZERS = {"bytes": _bytes_payloads, "ipc": serialize_ipc}
"name -> (bucket, copies) -> ``copies`` payloads."


# ----------------------------------------------------------------- buckets and the push
def dtype_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Buckets of about ``bucket_bytes`` holding one dtype each; yields (bucket, is_last)."""
    prev: list[tuple[str, torch.Tensor]] | None = None
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0][1].dtype):
            if prev is not None:
                yield prev, False
            prev, bucket, size = bucket, [], 0
        bucket.append((name, t))
        size += nbytes
    if not bucket:
        raise WeightSyncError("the weight source yielded no tensors")
    if prev is not None:
        yield prev, False
    yield bucket, True


class TensorWeightSync:
    """Colocated push to every engine with ``/update_weights_from_tensor`` (see the module docstring).

    ``tp_sizes[i]``: TP ranks of engine ``i`` (one payload each). ``serializer``: ipc (GPU) |
    bytes (CPU). ``device``: where the buckets are built (default: the current GPU for ipc, the
    CPU for bytes).

    ``payload_ranks[i][j]``: the trainer rank whose bucket engine ``i``'s TP rank ``j`` reads, the
    one on that rank's GPU (:func:`moe_rl.rollout.factory.colocated_payload_ranks`), as slime
    does: a CUDA IPC handle opens only on a GPU its reader sees, and engine ``i >= 1`` (or a TP
    rank of one engine across the GPUs of a node) does not see trainer rank 0's. Every trainer
    rank then builds each bucket on its own GPU and serializes it once, the payloads are gathered
    to the rank that calls the engines (:meth:`push`; the others call :meth:`contribute`), and each
    rank keeps its bucket until the engines read it. None: this process builds every payload (one
    process; the ``bytes`` serializer, whose payloads carry values).
    """

    def __init__(
        self,
        client: SGLangClient | list[SGLangClient],
        *,
        tp_sizes: list[int] | None = None,
        serializer: str | None = None,
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
        payload_ranks: list[list[int]] | None = None,
    ):
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.tp_sizes = tp_sizes or [1] * len(self.clients)
        if len(self.tp_sizes) != len(self.clients) or min(self.tp_sizes) < 1:
            raise ValueError(f"tp_sizes={self.tp_sizes}: one TP size >= 1 per engine ({len(self.clients)})")
        if payload_ranks is not None and [len(r) for r in payload_ranks] != self.tp_sizes:
            raise ValueError(
                f"payload_ranks={payload_ranks}: one trainer rank per TP rank of each engine {self.tp_sizes}"
            )
        serializer = serializer or ("ipc" if torch.cuda.is_available() else "bytes")
        if serializer not in SERIALIZERS:
            raise ValueError(f"serializer {serializer!r}: use one of {sorted(SERIALIZERS)}")
        if device is None and serializer == "ipc" and not torch.cuda.is_available():
            raise ValueError("serializer='ipc' sends CUDA IPC handles and needs a GPU here: use 'bytes'")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if serializer == "ipc" else "cpu"
        self.device = torch.device(device)
        self.serializer, self._serialize = serializer, SERIALIZERS[serializer]
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.payload_ranks = payload_ranks
        self._kept: dict | None = None  # this rank's last bucket, alive until the engines read it

    def _payloads(self, named: list[tuple[str, torch.Tensor]]) -> list[list[str]] | None:
        """Each engine's payloads of one bucket (None on a rank that does not call the engines).
        With ``payload_ranks`` collective: every rank builds and serializes its own bucket."""
        bucket = flatten_bucket(named)
        if self.payload_ranks is None:
            self._keep(bucket)
            return [self._serialize(bucket, tp) for tp in self.tp_sizes]
        me = dist.rank()
        serves = any(me in ranks for ranks in self.payload_ranks)
        every = dist.gather_object(self._serialize(bucket, 1)[0] if serves else None)
        self._keep(bucket)  # the previous one was read: its gather needed the caller past its send
        if every is None:
            return None
        return [[every[r] for r in ranks] for ranks in self.payload_ranks]

    def _keep(self, bucket: dict | None) -> None:
        """Hold ``bucket`` (dropping the one held); free what the engines have let go of (slime too)."""
        self._kept = bucket
        if self.serializer == "ipc":
            torch.cuda.ipc_collect()

    def _done(self) -> None:
        if self.payload_ranks is not None:
            dist.barrier()  # every engine read every bucket: the last one may go
        self._keep(None)

    def push(self, source: HFStateSource, version: str) -> PushReport:
        """Send every bucket to every engine inside the session; they then serve ``version``. With
        ``payload_ranks``, collective with :meth:`contribute` on the other ranks: after a failure
        the remaining buckets are still built and gathered (the other ranks wait in those
        gathers), then the failure is raised."""
        failed: list[Exception] = []

        def send(named: list[tuple[str, torch.Tensor]], last: bool) -> None:
            payloads = self._payloads(named)
            if failed:
                if last:
                    raise failed[0]
                return
            try:
                for c, p in zip(self.clients, payloads):
                    c.update_weights_from_tensor(
                        p,
                        load_format="flattened_bucket",
                        flush_cache=last,
                        weight_version=version if last else None,
                        timeout_s=self.timeout_s,
                    )
            except Exception as e:
                if self.payload_ranks is None or last:
                    raise
                failed.append(e)

        buckets = dtype_buckets(source_tensors(source, self.device), self.bucket_bytes)
        try:
            return push_buckets("tensor", self.clients, version, buckets, send)
        finally:
            if self.payload_ranks is not None:
                for named, _ in buckets:  # what a failure left unbuilt: the other ranks wait in these gathers
                    self._payloads(named)
            self._done()

    def contribute(self, source: HFStateSource) -> None:
        """A trainer rank that does not call the engines: its part of :meth:`push` (the source's
        collectives, and with ``payload_ranks`` its payload of every bucket)."""
        if self.payload_ranks is None:
            for _ in source_tensors(source, self.device):
                pass
            return
        for named, _ in dtype_buckets(source_tensors(source, self.device), self.bucket_bytes):
            self._payloads(named)
        self._done()

    def close(self) -> None:
        """Nothing to release."""
