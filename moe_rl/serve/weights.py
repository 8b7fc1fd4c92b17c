"""The weight-update and memory endpoints of ``moe-rl serve`` (a mixin of SGLangProtocolApp).

As current SGLang (0.5.23, ``srt/managers/scheduler_components/weight_updater.py``):
``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` run only inside a
begin/end session, a second ``/begin_weight_update`` and an ``/end_weight_update`` without one fail
with SGLang's messages, and ``/update_weights_from_disk`` needs no session. Ours: the session is
atomic (staged, applied all or nothing at ``/end_weight_update``; ``{"abort": true}`` discards),
and a disk load inside a session is staged too. Tensors with a NaN or infinite value are refused
(400 naming the tensor; in a session the session fails and nothing is applied), so the served
weights stay finite. A session abandoned past ``--moe-rl-stall-timeout`` is discarded
(:mod:`.stall`) and the next session call names the abort. ``/release_memory_occupation`` needs an idle
server, and generating while memory is released fails, as it cannot work in SGLang.
``/update_weights_from_tensor`` takes ``load_format="flattened_bucket"`` payloads of the ``bytes``
serializer (:mod:`moe_rl.rollout.weight_sync.tensor`): SGLang's ``FlattenedTensorBucket`` layout,
one uint8 tensor and per-tensor metadata with byte offsets, whether the trainer built it with
SGLang's own classes or without sglang, read by a restricted unpickler (no code runs); CUDA IPC
(``ipc``) payloads need a GPU server and are refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from moe_rl.hf_io import read_tensors
from moe_rl.rollout.weight_sync.address import route_address, tcp_url
from moe_rl.rollout.weight_sync.distributed import (
    destroy_process_group,
    init_custom_process_group,
    parse_dtype,
)
from moe_rl.rollout.weight_sync.tensor import deserialize_bytes, unflatten_bucket
from moe_rl.serve.protocol import BadRequest, get_field, get_number, update_result, validate_hf_tensors

logger = logging.getLogger(__name__)

SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"SGLang's GPU_MEMORY_ALL_TYPES (srt/constants.py)."


@dataclass
class _Session:
    """An open weight-update session: what it staged, and why it failed (if it did)."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    failed: str | None = None


def error_body(message: str) -> dict:
    """SGLang's _create_error_response body."""
    return {"error": {"message": message}}


class WeightEndpoints:
    """Needs from the app: engine, engine_lock, cond, session, groups, version, released,
    group_timeout_s, enable_memory_saver, _drain(), _set_version(), abort_all(), and from
    :class:`~moe_rl.serve.stall.StallGuard` _expire_locked() and last_abort_note()."""

    # ----------------------------------------------------------------- session
    def begin_weight_update(self, body: dict) -> tuple[int, Any]:
        get_field(body, "selector", "str", "all")
        with self.cond:
            self._expire_locked()
            if self.session is not None:
                return update_result(False, SESSION_ALREADY_OPEN)
            self.session, self.session_abort = _Session(), None
            self._drain()
        return update_result(True, "Success")

    def end_weight_update(self, body: dict) -> tuple[int, Any]:
        abort = get_field(body, "abort", "bool", False)
        with self.cond:
            self._expire_locked()
            session = self.session
        if session is None:
            return update_result(False, NO_SESSION + self.last_abort_note())
        try:
            if abort:
                return update_result(
                    True,
                    f"Session aborted: {len(session.staged)} staged tensors discarded, "
                    f"weights and weight_version {self.version!r} unchanged.",
                )
            if session.failed:
                return update_result(
                    False, f"Nothing applied, the session had a failed update: {session.failed}"
                )
            with self.engine_lock:
                try:
                    if session.staged:
                        self.engine.load_hf_tensors(session.staged.items())
                except ValueError as e:
                    return update_result(False, f"Nothing applied: {e}")
                if session.version is not None:
                    self._set_version(session.version)
            return update_result(
                True, f"Applied {len(session.staged)} tensors; weight_version is {self.version!r}."
            )
        finally:
            with self.cond:
                if self.session is session:
                    self.session = None
                self.cond.notify_all()

    def _require_session(self, op: str) -> tuple[int, dict] | None:
        with self.cond:
            self._expire_locked()
            if self.session is None:
                return update_result(False, OUTSIDE_SESSION.format(op=op) + self.last_abort_note())
        return None

    # ----------------------------------------------------------------- apply
    def _apply(self, named: dict[str, torch.Tensor], version: str | None) -> tuple[bool, str]:
        """Validate against ``hf_param_meta()``; stage in the session or load all-or-nothing."""
        if "weights" in self.released:
            return False, "the weights' memory is released: call /resume_memory_occupation first"
        try:
            validate_hf_tensors(named, self.engine.hf_param_meta())
        except ValueError as e:
            with self.cond:
                if self.session is not None:
                    self.session.failed = str(e)
            return False, f"Weights rejected, nothing loaded: {e}"
        with self.cond:
            if self.session is not None:
                if self.session.failed:
                    return False, f"Session already failed: {self.session.failed}"
                self.session.staged.update(named)
                self.session.version = version or self.session.version
                return True, f"Staged {len(named)} tensors in the open weight update session."
        with self.engine_lock:
            try:
                self.engine.load_hf_tensors(named.items())
            except ValueError as e:
                return False, f"Weights rejected, nothing loaded: {e}"
            if version is not None:
                self._set_version(version)
        msg = f"Succeeded to update {len(named)} parameters."
        return True, msg + (f" Weight version updated to {version}." if version is not None else "")

    def _maybe_abort_all(self, body: dict) -> None:
        if get_field(body, "abort_all_requests", "bool", False):
            self.abort_all()

    # ----------------------------------------------------------------- distributed
    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        addr = get_field(body, "master_address", "str")
        port = get_number(body, "master_port", "int", lo=1, hi=65535)
        world_size = get_number(body, "world_size", "int", lo=2)
        rank_offset = get_number(body, "rank_offset", "int", lo=1, hi=world_size - 1)
        name = get_field(body, "group_name", "str", "weight_update_group")
        backend = get_field(body, "backend", "str", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            return update_result(
                False, "backend 'nccl' needs CUDA and this server runs on CPU: use backend='gloo'"
            )
        if name in self.groups:
            destroy_process_group(self.groups.pop(name)[0])
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        try:
            pg = init_custom_process_group(
                backend=backend,
                init_method=tcp_url(addr, port),
                world_size=world_size,
                rank=rank_offset,
                group_name=name,
                timeout=timedelta(seconds=self.group_timeout_s),
                local_address=route_address(addr),
            )
            self.groups[name] = (pg, device)
        except Exception as e:  # noqa: BLE001 - reported to the trainer
            return update_result(False, f"Failed to init group {name!r}: {e}")
        return update_result(True, f"Succeeded to initialize custom process group {name}.")

    def destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        name = get_field(body, "group_name", "str", "weight_update_group")
        if name not in self.groups:
            return update_result(False, f"No weight update group named {name!r}")
        destroy_process_group(self.groups.pop(name)[0])
        return update_result(True, f"Destroyed group {name}.")

    def update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        names = get_field(body, "names", "list[str]")
        dtypes = get_field(body, "dtypes", "list[str]")
        shapes = get_field(body, "shapes", "list[list[int]]")
        name = get_field(body, "group_name", "str", "weight_update_group")
        get_field(body, "flush_cache", "bool", True)
        version = get_field(body, "weight_version", "str", None)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(
                f"body.names/dtypes/shapes: lengths {len(names)}/{len(dtypes)}/{len(shapes)} differ"
            )
        try:
            torch_dtypes = [parse_dtype(d) for d in dtypes]
        except ValueError as e:
            raise BadRequest(f"body.dtypes: {e}") from e
        meta = self.engine.hf_param_meta()
        for i, (n, shape) in enumerate(zip(names, shapes)):  # before a byte is allocated
            if n not in meta:
                raise BadRequest(f"body.names[{i}]={n!r} is not a weight of the served model")
            if list(shape) != list(meta[n][0]):
                raise BadRequest(f"body.shapes[{i}]={list(shape)}: {n!r} is {list(meta[n][0])} here")
        refused = self._require_session("update_weights_from_distributed")
        if refused:
            return refused
        self._maybe_abort_all(body)
        if name not in self.groups:
            return update_result(
                False, f"No weight update group named {name!r}: call /init_weights_update_group first"
            )
        group, device = self.groups[name]
        received: dict[str, torch.Tensor] = {}
        try:
            for n, dt, shape in zip(names, torch_dtypes, shapes):
                t = torch.empty(shape, dtype=dt, device=device)
                group.broadcast(t, 0).wait()
                received[n] = t
        except Exception as e:  # noqa: BLE001 - the group is broken; the trainer sees the error
            return update_result(False, f"Failed to receive weights: {e}")
        return update_result(*self._apply(received, version))

    # ----------------------------------------------------------------- tensor (colocated) and disk
    def update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        payloads = get_field(body, "serialized_named_tensors", "list[str]")
        load_format = get_field(body, "load_format", "str", None)
        get_field(body, "flush_cache", "bool", True)
        version = get_field(body, "weight_version", "str", None)
        if load_format != "flattened_bucket":
            raise BadRequest(f"body.load_format={load_format!r}: moe-rl serve reads only 'flattened_bucket'")
        if len(payloads) != 1:
            raise BadRequest(
                f"body.serialized_named_tensors: {len(payloads)} payloads for a server of TP size 1"
            )
        refused = self._require_session("update_weights_from_tensor")
        if refused:
            return refused
        self._maybe_abort_all(body)
        try:
            named = dict(unflatten_bucket(deserialize_bytes(payloads[0])))  # SGLang's bucket layout
        except Exception as e:  # noqa: BLE001 - a payload this CPU server cannot read
            return update_result(
                False, f"Cannot read the payload (CPU servers take the 'bytes' serializer): {e}"
            )
        return update_result(*self._apply(named, version))

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        path = get_field(body, "model_path", "str")
        version = get_field(body, "weight_version", "str", None)
        get_field(body, "flush_cache", "bool", True)
        self._maybe_abort_all(body)
        try:
            named = read_tensors(path)
        except (OSError, ValueError) as e:
            return update_result(False, f"Failed to read {path}: {e}", num_paused_requests=0)
        ok, msg = self._apply(named, version)
        return update_result(ok, msg, num_paused_requests=0)

    def get_weights_by_name(self, body: dict) -> tuple[int, Any]:
        """SGLang's GetWeightsByNameReqInput: the served parameter's first ``truncate_size`` rows as
        nested float lists (what SGLang's models that implement it return), or 400 "Get parameter
        by name failed" for a name it does not hold."""
        name = get_field(body, "name", "str")
        rows = get_number(body, "truncate_size", "int", 100, lo=0)
        with self.engine_lock:
            t = self.engine.served_tensor(name) if hasattr(self.engine, "served_tensor") else None
        if t is None:
            return 400, error_body("Get parameter by name failed")
        return 200, t.float().tolist()[:rows]

    def update_weight_version(self, body: dict) -> tuple[int, Any]:
        version = get_field(body, "new_version", "str")
        if get_field(body, "abort_all_requests", "bool", False):
            self.abort_all()
        with self.cond:
            if self.session is not None:
                self.session.version = version
                return update_result(True, f"Weight version updated to {version}", new_version=version)
        with self.engine_lock:
            self._set_version(version)
        return update_result(True, f"Weight version updated to {version}", new_version=version)

    # ----------------------------------------------------------------- memory (colocated)
    def _tags(self, body: dict) -> list[str]:
        tags = get_field(body, "tags", "list[str]", None) or list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise BadRequest(f"body.tags: unknown {unknown}; SGLang's are {list(MEMORY_TAGS)}")
        return tags

    def release_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = self._tags(body)
        if not self.enable_memory_saver:
            return 400, error_body(
                "release_memory_occupation needs a server launched with --enable-memory-saver"
            )
        with self.cond:
            if self.active:
                return 400, error_body("release_memory_occupation should be called only when server is idle.")
            self.released.update(tags)
        return 200, None

    def resume_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = self._tags(body)
        with self.cond:
            missing = [t for t in tags if t not in self.released]
            if missing:
                return 400, error_body(f"KeyError: {missing[0]!r} was not released")
            self.released.difference_update(tags)
            self.cond.notify_all()
        return 200, None
