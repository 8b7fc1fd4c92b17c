"""The SGLang endpoints of ``moe-rl serve`` around a RolloutEngine + WeightSink, without HTTP.

:class:`SGLangProtocolApp` maps ``(method, path, JSON body)`` to ``(status, body)``. Generation
waits while generation is paused or a weight-update session is open; an open session stages
every update and ``/end_weight_update`` applies all of it or nothing (see :mod:`moe_rl.serve`).
meta_info keys: ``python/sglang/srt/managers/tokenizer_manager.py`` (sgl-project/sglang).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

import moe_rl
from moe_rl.hf_io import read_tensors
from moe_rl.rollout.types import SamplingParams
from moe_rl.rollout.weight_sync.distributed import (
    destroy_process_group,
    init_custom_process_group,
    parse_dtype,
)
from moe_rl.routing.codec import decode_routes, encode_sglang_routes
from moe_rl.serve.protocol import (
    BadRequest,
    check_kind,
    error_response,
    get_field,
    to_sampling,
    update_result,
    validate_hf_tensors,
)

logger = logging.getLogger(__name__)


@dataclass
class _Session:
    """An open weight-update session: what it staged, and why it failed (if it did)."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    version: str | None = None
    failed: str | None = None


class SGLangProtocolApp:
    """The endpoints; ``handle()`` maps (method, path, JSON body) to (status, body)."""

    def __init__(
        self,
        engine: Any,
        *,
        model_path: str = "moe-rl-embedded",
        weight_version: str = "default",
        enable_return_routed_experts: bool = False,
        server_args: dict | None = None,
        group_timeout_s: float = 600.0,
    ):
        self.engine, self.model_path = engine, model_path
        self.enable_routes = enable_return_routed_experts
        self.server_args = dict(server_args or {})
        self.group_timeout_s = group_timeout_s
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()
        self.paused, self.active = False, 0
        self.session: _Session | None = None
        self.groups: dict[str, Any] = {}
        self._set_version(weight_version)
        self.routes: dict[str, tuple[tuple[str, ...], Any]] = {
            "/generate": (("POST", "PUT"), self.generate),
            "/health": (("GET",), self.health),
            "/health_generate": (("GET",), self.health_generate),
            "/get_model_info": (("GET",), self.model_info),
            "/model_info": (("GET",), self.model_info),
            "/get_server_info": (("GET",), self.server_info),
            "/server_info": (("GET",), self.server_info),
            "/get_weight_version": (("GET",), self.get_weight_version),
            "/flush_cache": (("GET", "POST"), self.flush_cache),
            "/pause_generation": (("POST",), self.pause_generation),
            "/continue_generation": (("POST",), self.continue_generation),
            "/begin_weight_update": (("POST",), self.begin_weight_update),
            "/end_weight_update": (("POST",), self.end_weight_update),
            "/init_weights_update_group": (("POST",), self.init_weights_update_group),
            "/destroy_weights_update_group": (("POST",), self.destroy_weights_update_group),
            "/update_weights_from_distributed": (("POST",), self.update_weights_from_distributed),
            "/update_weights_from_disk": (("POST",), self.update_weights_from_disk),
            "/update_weight_version": (("POST",), self.update_weight_version),
        }

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        route = self.routes.get(path.split("?", 1)[0])
        if route is None:
            return 404, {"detail": "Not Found"}
        if method not in route[0]:
            return 405, {"detail": "Method Not Allowed"}
        if body is not None and not isinstance(body, dict) and path != "/generate":
            return 400, error_response("body: expected a JSON object")
        try:
            return route[1](body or {})
        except BadRequest as e:
            return 400, error_response(str(e))
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500
            logger.exception("%s %s failed", method, path)
            return 500, {"error": {"message": f"{type(e).__name__}: {e}"}}

    # ----------------------------------------------------------------- gating
    def _enter_generation(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.paused and self.session is None)
            self.active += 1

    def _leave_generation(self) -> None:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def _drain(self) -> None:
        """Wait for in-flight generations (call with ``self.cond`` held)."""
        self.cond.wait_for(lambda: self.active == 0)

    def _set_version(self, version: str) -> None:
        self.version = version
        try:
            self.engine.weight_version = version
        except AttributeError:
            pass

    # ----------------------------------------------------------------- generation
    def generate(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict):
            raise BadRequest("body: expected a JSON object")
        if body.get("text") is not None or body.get("input_ids") is None:
            raise BadRequest(
                "body.input_ids: field required (moe-rl serve runs like "
                "--skip-tokenizer-init: send token ids, not text)"
            )
        if body.get("stream"):
            raise BadRequest("body.stream: streaming is not supported by moe-rl serve")
        ids = body["input_ids"]
        single = check_kind(ids, "list[int]")
        batch = [ids] if single else ids
        if not batch or not check_kind(batch, "list[list[int]]") or not all(batch):
            raise BadRequest("body.input_ids: expected a non-empty list of token ids or a batch of them")
        sps = body.get("sampling_params") or {}
        if isinstance(sps, list):
            if len(sps) != len(batch):
                raise BadRequest(f"body.sampling_params: {len(sps)} entries for {len(batch)} prompts")
            parsed = [to_sampling(sp, f"body.sampling_params[{i}]") for i, sp in enumerate(sps)]
        else:
            parsed = [to_sampling(sps, "body.sampling_params")] * len(batch)
        want_lp = body.get("return_logprob") or False
        want_lp = want_lp if isinstance(want_lp, list) else [bool(want_lp)] * len(batch)
        want_routes = get_field(body, "return_routed_experts", "bool", False) and self.enable_routes
        rids = body.get("rid") or [uuid.uuid4().hex for _ in batch]
        rids = [rids] if isinstance(rids, str) else rids
        self._enter_generation()
        try:
            with self.engine_lock:
                version = self.version
                outs = self._run(batch, parsed, want_routes)
        except ValueError as e:
            return 400, {"error": {"message": str(e)}}
        finally:
            self._leave_generation()
        items = [self._item(o, rids[i], version, want_lp[i]) for i, o in enumerate(outs)]
        return 200, items[0] if single else items

    def _run(
        self, batch: list[list[int]], parsed: list[tuple[SamplingParams, int | None]], want_routes: bool
    ) -> list[dict]:
        """Call the engine once per run of requests with equal params and consecutive seeds."""
        outs: list[dict] = []
        i = 0
        while i < len(batch):
            params, seed0 = parsed[i]
            j = i + 1
            while (
                j < len(batch)
                and parsed[j][0] == params
                and (
                    (seed0 is None and parsed[j][1] is None)
                    or (seed0 is not None and parsed[j][1] == seed0 + (j - i))
                )
            ):
                j += 1
            sp = dataclasses.replace(params, seed=seed0, return_routes=want_routes)
            t0 = time.perf_counter()
            rollouts = self.engine.generate(batch[i:j], 1, sp)
            dt = time.perf_counter() - t0
            for b in range(j - i):
                P, T = int(rollouts.prompt_lens_B[b]), int(rollouts.total_lens_B[b])
                out = {
                    "output_ids": rollouts.tokens_BT[b, P:T].tolist(),
                    "logprobs": rollouts.logprobs_BT[b, P:T].tolist(),
                    "finish": rollouts.finish_reasons[b],
                    "prompt_tokens": P,
                    "max_new_tokens": params.max_new_tokens,
                    "latency": dt,
                }
                if want_routes and rollouts.routes_BTLK is not None:
                    out["routes"] = encode_sglang_routes(decode_routes(rollouts.routes_BTLK[b, : T - 1]))
                outs.append(out)
            i = j
        return outs

    def _item(self, o: dict, rid: str, version: str, want_lp: bool) -> dict:
        """One response as SGLang's tokenizer_manager builds it (skip_tokenizer_init: no text)."""
        ids = o["output_ids"]
        if o["finish"] == "stop":
            fr = {"type": "stop", "matched": ids[-1] if ids else None}
        else:
            fr = {"type": "length", "length": o["max_new_tokens"]}
        meta = {
            "id": rid,
            "finish_reason": fr,
            "prompt_tokens": o["prompt_tokens"],
            "weight_version": version,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "e2e_latency": o["latency"],
        }
        if want_lp:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(o["logprobs"], ids)]
        if "routes" in o:
            meta["routed_experts"] = o["routes"]
        return {"output_ids": ids, "meta_info": meta}

    def health(self, body: dict) -> tuple[int, Any]:
        return 200, None

    def health_generate(self, body: dict) -> tuple[int, Any]:
        """Generate one token like SGLang's /health_generate (200 at once while updating)."""
        with self.cond:
            if self.paused or self.session is not None:
                return 200, None
            self.active += 1
        try:
            with self.engine_lock:
                self.engine.generate([[0]], 1, SamplingParams(max_new_tokens=1, temperature=0.0))
            return 200, None
        except Exception as e:  # noqa: BLE001 - unhealthy
            logger.error("health_generate failed: %s", e)
            return 503, None
        finally:
            self._leave_generation()

    # ----------------------------------------------------------------- info
    def model_info(self, body: dict) -> tuple[int, Any]:
        return 200, {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.version,
        }

    def server_info(self, body: dict) -> tuple[int, Any]:
        return 200, {
            **self.server_args,
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "skip_tokenizer_init": True,
            "weight_version": self.version,
            "enable_return_routed_experts": self.enable_routes,
            "max_context_length": int(getattr(self.engine, "max_context_length", 0) or 0),
            "internal_states": [{}],
            "version": f"moe-rl-{moe_rl.__version__}",
            "weight_update_session": True,
        }

    def get_weight_version(self, body: dict) -> tuple[int, Any]:
        return 200, {"weight_version": self.version}

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        if hasattr(self.engine, "flush_cache"):
            with self.engine_lock:
                self.engine.flush_cache()
        return 200, "Cache flushed.\n"

    # ----------------------------------------------------------------- pause / session
    def pause_generation(self, body: dict) -> tuple[int, Any]:
        get_field(body, "mode", "str", "abort")
        with self.cond:
            self.paused = True
            self._drain()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def begin_weight_update(self, body: dict) -> tuple[int, Any]:
        get_field(body, "selector", "str", "all")
        with self.cond:
            if self.session is not None:
                return update_result(False, "A weight update session is already open")
            self.session = _Session()
            self._drain()
        return update_result(True, "Weight update session opened.")

    def end_weight_update(self, body: dict) -> tuple[int, Any]:
        abort = get_field(body, "abort", "bool", False)
        with self.cond:
            session = self.session
        if session is None:
            return update_result(False, "No open weight update session: call /begin_weight_update first")
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
                self.session = None
                self.cond.notify_all()

    # ----------------------------------------------------------------- weight updates
    def _apply(self, named: dict[str, torch.Tensor], version: str | None) -> tuple[bool, str]:
        """Validate against ``hf_param_meta()``; stage in the session or load all-or-nothing."""
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

    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        addr = get_field(body, "master_address", "str")
        port = get_field(body, "master_port", "int")
        rank_offset = get_field(body, "rank_offset", "int")
        world_size = get_field(body, "world_size", "int")
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
                init_method=f"tcp://{addr}:{port}",
                world_size=world_size,
                rank=rank_offset,
                group_name=name,
                timeout=timedelta(seconds=self.group_timeout_s),
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
            return update_result(False, f"Receiving broadcast tensors failed: {e}")
        ok, msg = self._apply(received, version)
        return update_result(ok, msg)

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        path = get_field(body, "model_path", "str")
        version = get_field(body, "weight_version", "str", None)
        get_field(body, "flush_cache", "bool", True)
        try:
            named = read_tensors(path)
        except (OSError, ValueError) as e:
            return update_result(False, f"Failed to read {path}: {e}", num_paused_requests=0)
        ok, msg = self._apply(named, version)
        return update_result(ok, msg, num_paused_requests=0)

    def update_weight_version(self, body: dict) -> tuple[int, Any]:
        version = get_field(body, "new_version", "str")
        get_field(body, "abort_all_requests", "bool", True)
        with self.cond:
            if self.session is not None:
                self.session.version = version
                msg = f"Weight version {version} staged in the open weight update session"
                return update_result(True, msg, new_version=version)
        with self.engine_lock:
            self._set_version(version)
        return update_result(True, f"Weight version updated to {version}", new_version=version)
