"""Colocated push: ``POST /update_weights_from_tensor`` with flattened buckets (CUDA IPC on GPU).

When SGLang shares the trainer's GPUs (launched with ``--enable-memory-saver``), the trainer does
not broadcast: it hands SGLang handles to tensors it already holds. Each bucket is one flat tensor
per dtype plus its metadata (name, shape, dtype, start, end), SGLang's ``FlattenedTensorBucket``,
sent with ``load_format="flattened_bucket"`` inside the begin/end session, one serialized payload
per TP rank of the engine (``serialized_named_tensors``), as slime does
(``slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py``).

Serializers: ``ipc`` (GPU) is SGLang's own ``MultiprocessingSerializer`` (CUDA IPC handles; needs
``sglang`` importable in the trainer, as slime requires); ``bytes`` (CPU, ``moe-rl serve``) carries
the tensor values themselves (``torch.save``, base64). Only a GPU exercises ``ipc``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Iterator

import torch

from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.types import HFStateSource
from moe_rl.rollout.weight_sync.distributed import dtype_name, parse_dtype
from moe_rl.rollout.weight_sync.session import PushReport, WeightSyncError, push_buckets


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """Tensors of one dtype -> {"flattened_tensor": 1-D, "metadata": [{name, shape, dtype, start_idx, end_idx, numel}]}."""
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    meta, start = [], 0
    for name, t in named:
        meta.append(
            {
                "name": name,
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "start_idx": start,
                "end_idx": start + t.numel(),
                "numel": t.numel(),
            }
        )
        start += t.numel()
    flat = torch.cat([t.detach().reshape(-1) for _, t in named]) if named else torch.empty(0)
    return {"flattened_tensor": flat, "metadata": meta}


def unflatten_bucket(bucket: dict) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`flatten_bucket` (views into the flat tensor)."""
    flat = bucket["flattened_tensor"]
    out = []
    for m in bucket["metadata"]:
        t = flat[m["start_idx"] : m["end_idx"]].view(m["shape"])
        if t.dtype != parse_dtype(m["dtype"]):
            raise ValueError(f"{m['name']}: metadata dtype {m['dtype']} but bucket holds {t.dtype}")
        out.append((m["name"], t))
    return out


def serialize_bytes(bucket: dict) -> str:
    """CPU serializer: the bucket's values, ``torch.save`` then base64."""
    buf = io.BytesIO()
    torch.save({"flattened_tensor": bucket["flattened_tensor"].cpu(), "metadata": bucket["metadata"]}, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_bytes(payload: str) -> dict:
    """Inverse of :func:`serialize_bytes` (``weights_only``: no code runs)."""
    return torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=True)


def serialize_ipc(bucket: dict) -> str:  # pragma: no cover - GPU only
    """GPU serializer: SGLang's MultiprocessingSerializer (CUDA IPC handles, base64 text)."""
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer.serialize(bucket, output_str=True)


SERIALIZERS = {"bytes": serialize_bytes, "ipc": serialize_ipc}


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

    ``tp_sizes[i]``: TP ranks of engine ``i`` (one payload each). ``serializer``: ipc (GPU) | bytes (CPU).
    """

    def __init__(
        self,
        client: SGLangClient | list[SGLangClient],
        *,
        tp_sizes: list[int] | None = None,
        serializer: str | None = None,
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
    ):
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.tp_sizes = tp_sizes or [1] * len(self.clients)
        serializer = serializer or ("ipc" if torch.cuda.is_available() else "bytes")
        if serializer not in SERIALIZERS:
            raise ValueError(f"serializer {serializer!r}: use one of {sorted(SERIALIZERS)}")
        self.serializer, self._serialize = serializer, SERIALIZERS[serializer]
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s

    def push(self, source: HFStateSource, version: str) -> PushReport:
        """Send every bucket to every engine inside the session; they then serve ``version``."""

        def send(bucket: list[tuple[str, torch.Tensor]], last: bool) -> None:
            payload = self._serialize(flatten_bucket(bucket))
            for c, tp in zip(self.clients, self.tp_sizes):
                c.update_weights_from_tensor(
                    [payload] * tp,
                    load_format="flattened_bucket",
                    flush_cache=last,
                    weight_version=version if last else None,
                    timeout_s=self.timeout_s,
                )

        return push_buckets(
            "tensor", self.clients, version, dtype_buckets(source.hf_tensors(), self.bucket_bytes), send
        )

    def close(self) -> None:
        """Nothing to release."""
