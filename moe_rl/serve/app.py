"""The SGLang endpoints of ``moe-rl serve`` around a RolloutEngine + WeightSink, without HTTP.

:class:`SGLangProtocolApp` maps ``(method, path, JSON body)`` to ``(status, body)``. Generation
waits while generation is paused or a weight-update session is open; concurrent requests share
engine calls (:mod:`.batcher`). Behaviour follows current SGLang where a client can see it
(``srt/entrypoints/http_server.py``, ``srt/managers/tokenizer_manager.py``, sgl-project/sglang
0.5.23): ``/get_weight_version`` answers 404 (use ``/model_info``); ``/health_generate`` and
``/ready`` answer 503 while paused; ``/pause_generation`` in mode ``abort`` (the default) aborts
in-flight and queued requests, which return finish_reason ``abort``; ``/abort_request`` aborts by
rid or all; ``abort_all_requests`` of the update endpoints is honoured. The weight-update and
memory endpoints are in :mod:`.weights`; health and the abort of an abandoned session or pause
in :mod:`.stall`. meta_info keys: ``srt/managers/tokenizer_manager.py``.
A ``/generate`` over the limits of :class:`~moe_rl.serve.limits.ServeLimits` (prompts, tokens,
the model's context length, SGLang's message) is refused with 400 before it waits or runs; a
``rid`` already in flight too (SGLang's "Duplicate request ID detected").
With a tokenizer, ``/generate`` takes ``text`` and answers with ``text`` (:mod:`.text`), and the
OpenAI endpoints of :mod:`.openai` run through :meth:`SGLangProtocolApp.generate`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

import moe_rl
from moe_rl.rollout.types import SamplingParams
from moe_rl.routing.codec import decode_routes, encode_sglang_routes
from moe_rl.serve.batcher import Batcher
from moe_rl.serve.limits import FLAGS, ServeLimits, limit_message
from moe_rl.serve.openai import OpenAIEndpoints
from moe_rl.serve.protocol import (
    BadRequest,
    ModelNotFound,
    check_kind,
    error_response,
    get_field,
    model_not_found,
    text_options,
    to_sampling,
)
from moe_rl.serve.stall import STALL_PATHS, StallGuard
from moe_rl.serve.text import ServeTokenizer
from moe_rl.serve.weights import WeightEndpoints, error_body

logger = logging.getLogger(__name__)

DEPRECATED_WEIGHT_VERSION = (
    "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
)
"SGLang's 404 detail for the removed weight-version endpoints (http_server.py, 0.5.11 on)."


class SGLangProtocolApp(StallGuard, WeightEndpoints, OpenAIEndpoints):
    """The endpoints; ``handle()`` maps (method, path, JSON body) to (status, body).

    ``tokenizer`` (a :class:`~moe_rl.tasks.tokenizer.Tokenizer`, or None as with SGLang's
    ``--skip-tokenizer-init``): with one, ``/generate`` takes ``text`` and answers with ``text``,
    ``sampling_params.stop`` strings work, and the OpenAI endpoints (:mod:`.openai`) serve."""

    def __init__(
        self,
        engine: Any,
        *,
        model_path: str = "moe-rl-embedded",
        weight_version: str = "default",
        enable_return_routed_experts: bool = False,
        enable_memory_saver: bool = False,
        server_args: dict | None = None,
        group_timeout_s: float = 600.0,
        batch_window_s: float = 0.005,
        limits: ServeLimits | None = None,
        tokenizer: Any = None,
    ):
        self.engine, self.model_path = engine, model_path
        self.text = ServeTokenizer(tokenizer) if tokenizer is not None else None
        self.limits = limits or ServeLimits()
        self.enable_routes, self.enable_memory_saver = enable_return_routed_experts, enable_memory_saver
        self.server_args = dict(server_args or {})
        self.group_timeout_s = group_timeout_s
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()
        self.paused, self.active = False, 0
        self.session = None
        self.groups: dict[str, Any] = {}
        self.released: set[str] = set()
        self.inflight: dict[str, bool] = {}
        "rid -> aborted, for every request between arrival and answer."
        self.served = 0
        "/generate requests answered (``server_info()['internal_states'][0]``)."
        self._set_version(weight_version)
        self._init_stall()
        self.batcher = Batcher(
            self._run_locked,
            window_s=batch_window_s,
            max_rows=self.limits.max_running_requests,
            max_tokens=self.limits.max_total_tokens,
        )
        self.routes: dict[str, tuple[tuple[str, ...], Any]] = {
            "/generate": (("POST", "PUT"), self.generate),
            "/health": (("GET",), self.health),
            "/health_generate": (("GET",), self.health_generate),
            "/ready": (("GET",), self.ready),
            "/get_model_info": (("GET",), self.model_info),
            "/model_info": (("GET",), self.model_info),
            "/get_server_info": (("GET",), self.server_info),
            "/server_info": (("GET",), self.server_info),
            "/get_weight_version": (("GET",), self.removed_weight_version),
            "/weight_version": (("GET",), self.removed_weight_version),
            "/flush_cache": (("GET", "POST"), self.flush_cache),
            "/pause_generation": (("POST",), self.pause_generation),
            "/continue_generation": (("POST",), self.continue_generation),
            "/abort_request": (("POST",), self.abort_request),
            "/begin_weight_update": (("POST",), self.begin_weight_update),
            "/end_weight_update": (("POST",), self.end_weight_update),
            "/init_weights_update_group": (("POST",), self.init_weights_update_group),
            "/destroy_weights_update_group": (("POST",), self.destroy_weights_update_group),
            "/update_weights_from_distributed": (("POST",), self.update_weights_from_distributed),
            "/update_weights_from_tensor": (("POST",), self.update_weights_from_tensor),
            "/update_weights_from_disk": (("POST",), self.update_weights_from_disk),
            "/update_weight_version": (("POST",), self.update_weight_version),
            "/get_weights_by_name": (("GET", "POST"), self.get_weights_by_name),
            "/release_memory_occupation": (("GET", "POST"), self.release_memory_occupation),
            "/resume_memory_occupation": (("GET", "POST"), self.resume_memory_occupation),
            "/v1/models": (("GET",), self.v1_models),
            "/v1/completions": (("POST",), self.v1_completions),
            "/v1/chat/completions": (("POST",), self.v1_chat_completions),
        }

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        route = self.routes.get(path.split("?", 1)[0])
        if route is None:
            return 404, {"detail": "Not Found"}
        if method not in route[0]:
            return 405, {"detail": "Method Not Allowed"}
        if body is not None and not isinstance(body, dict) and path != "/generate":
            return 400, error_response("body: expected a JSON object")
        admin = path in STALL_PATHS
        if admin:
            self._admin_begin()
        try:
            return route[1](body or {})
        except BadRequest as e:
            return 400, error_response(str(e))
        except ModelNotFound as e:
            return 404, model_not_found(str(e))
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500
            logger.exception("%s %s failed", method, path)
            return 500, error_body(f"{type(e).__name__}: {e}")
        finally:
            if admin:
                self._admin_end()

    # ----------------------------------------------------------------- gating and aborts
    def _enter_generation(self, rids: list[str]) -> None:
        """Register ``rids`` (BadRequest for one already in flight) and wait for an open gate."""
        with self.cond:
            dup = [r for r in rids if r in self.inflight] or [r for i, r in enumerate(rids) if r in rids[:i]]
            if dup:
                raise BadRequest(f"Duplicate request ID detected: {dup[0]}")
            for rid in rids:
                self.inflight[rid] = False
            self._wait_open(
                lambda: (not self.paused and self.session is None) or all(self.inflight[r] for r in rids)
            )
            self.active += 1

    def _leave_generation(self, rids: list[str]) -> list[bool]:
        with self.cond:
            self.active -= 1
            aborted = [self.inflight.pop(rid, False) for rid in rids]
            self.cond.notify_all()
        return aborted

    def _drain(self) -> None:
        """Wait for in-flight generations (call with ``self.cond`` held)."""
        self.cond.wait_for(lambda: self.active == 0)

    def abort_all(self) -> None:
        with self.cond:
            for rid in self.inflight:
                self.inflight[rid] = True
            self.cond.notify_all()

    def _set_version(self, version: str) -> None:
        self.version = version
        try:
            self.engine.weight_version = version
        except AttributeError:
            pass

    # ----------------------------------------------------------------- generation
    def generate(self, body: Any) -> tuple[int, Any]:
        single, batch, parsed, want_lp, want_routes, rids, opts = self._parse_generate(body)
        refused = self._over_limits(batch, parsed)
        if refused:
            return 400, error_body(refused)
        if self.released & {"weights", "kv_cache"}:
            return 400, error_body(
                f"memory {sorted(self.released)} is released: call /resume_memory_occupation"
            )
        self._enter_generation(rids)
        outs, version = None, self.version
        try:
            with self.cond:
                skip = all(self.inflight[r] for r in rids)
            if not skip:
                version, outs = self.batcher.submit(batch, parsed, want_routes)
        except ValueError as e:
            return 400, error_body(str(e))
        finally:
            aborted = self._leave_generation(rids)
            self.served += 1
        items = [
            self._item(
                self._with_text(outs[i] if outs else None, opts[i]),
                rids[i],
                version,
                want_lp[i],
                aborted[i],
                parsed[i][0],
            )
            for i in range(len(batch))
        ]
        return 200, items[0] if single else items

    def _prompts(self, body: dict) -> tuple[bool, list[list[int]]]:
        """(single, token ids of each prompt) of ``input_ids`` or, with a tokenizer, ``text``."""
        text, ids = body.get("text"), body.get("input_ids")
        if text is not None and ids is not None:
            raise BadRequest("body.text: send either text or input_ids, not both")
        if text is None:
            if ids is None:
                need = "input_ids or text" if self.text else "input_ids"
                raise BadRequest(f"body.{need.split()[0]}: field required (send {need})")
            single = check_kind(ids, "list[int]")
            batch = [ids] if single else ids
            if not batch or not check_kind(batch, "list[list[int]]") or not all(batch):
                raise BadRequest("body.input_ids: expected a non-empty list of token ids or a batch of them")
            return single, batch
        if self.text is None:
            raise BadRequest(
                "body.text: this server has no tokenizer (started with --skip-tokenizer-init, or its "
                "engine has none): send token ids in body.input_ids"
            )
        single = isinstance(text, str)
        texts = [text] if single else text
        if not texts or not check_kind(texts, "list[str]"):
            raise BadRequest("body.text: expected a string or a non-empty list of strings")
        batch = [self.text.encode(t) for t in texts]
        for i, p in enumerate(batch):
            if not p:
                raise BadRequest(f"body.text{'' if single else f'[{i}]'}: encodes to no tokens")
        return single, batch

    def vocab_size(self) -> int | None:
        """The served model's vocabulary (token ids are in ``[0, vocab_size)``), if the engine says."""
        size = getattr(self.engine, "vocab_size", None)
        if size is None:
            size = getattr(getattr(getattr(self.engine, "policy", None), "cfg", None), "vocab_size", None)
        return size if isinstance(size, int) else None

    def check_token_ids(self, batch: list[list[int]], where: str) -> None:
        """Every token id of ``batch`` is one of the model's (400 naming the first that is not)."""
        vocab = self.vocab_size()
        for i, p in enumerate(batch):
            bad = next((t for t in p if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:
                top = f"{vocab - 1}" if vocab is not None else "..."
                raise BadRequest(f"{where}[{i}]: token id {bad} is not one of the model's (0..{top})")

    def _parse_generate(self, body: Any) -> tuple:
        """(single, prompts, [(params, seed)], [want logprobs], want routes, rids,
        [(stop strings, trim, skip special tokens)]) of a /generate body; the number of prompts is
        checked before any is parsed further, every number's range before any work."""
        if not isinstance(body, dict):
            raise BadRequest("body: expected a JSON object")
        if body.get("stream"):
            raise BadRequest("body.stream: streaming is not supported by moe-rl serve")
        count = body.get("text") if body.get("text") is not None else body.get("input_ids")
        if isinstance(count, list) and count and isinstance(count[0], (list, str)):
            if len(count) > self.limits.max_running_requests:
                raise BadRequest(
                    limit_message("number of prompts", len(count), "max_running_requests", self.limits)
                )
        single, batch = self._prompts(body)
        self.check_token_ids(batch, "body.input_ids" if body.get("text") is None else "body.text")
        sps = body.get("sampling_params") or {}
        with_text = self.text is not None
        if isinstance(sps, list):
            if len(sps) != len(batch):
                raise BadRequest(f"body.sampling_params: {len(sps)} entries for {len(batch)} prompts")
            wheres = [f"body.sampling_params[{i}]" for i in range(len(sps))]
        else:
            sps, wheres = [sps] * len(batch), ["body.sampling_params"] * len(batch)
        parsed = [to_sampling(sp, w, with_text) for sp, w in zip(sps, wheres)]
        for (params, _), w in zip(parsed, wheres):
            self.check_token_ids([list(params.stop_token_ids)], f"{w}.stop_token_ids")
        opts = [text_options(sp, w) for sp, w in zip(sps, wheres)]
        want_lp = body.get("return_logprob") or False
        want_lp = want_lp if isinstance(want_lp, list) else [bool(want_lp)] * len(batch)
        if len(want_lp) != len(batch):
            raise BadRequest(f"body.return_logprob: {len(want_lp)} entries for {len(batch)} prompts")
        want_routes = get_field(body, "return_routed_experts", "bool", False) and self.enable_routes
        rids = body.get("rid") or [uuid.uuid4().hex for _ in batch]
        rids = [rids] if isinstance(rids, str) else rids
        if not check_kind(rids, "list[str]") or len(rids) != len(batch):
            raise BadRequest(f"body.rid: expected a string per prompt ({len(batch)}), got {str(rids)[:80]}")
        if want_routes and any(o[0] for o in opts):
            raise BadRequest(
                "body.sampling_params.stop: stop strings cannot be combined with return_routed_experts "
                "(the routes would cover the dropped tokens); use stop_token_ids"
            )
        return single, batch, parsed, want_lp, want_routes, rids, opts

    def _with_text(self, o: dict | None, opts: tuple[tuple[str, ...], bool, bool]) -> dict | None:
        """``o`` with ``text`` (and cut at its first stop string) when the server has a tokenizer."""
        if self.text is None or o is None:
            return o
        stops, trim, skip = opts
        keep, text, matched = self.text.cut_at_stop(o["output_ids"], stops, skip, trim)
        if matched is None and o["finish"] == "stop" and trim and o["output_ids"]:
            text = self.text.decode(o["output_ids"][:-1], skip)  # SGLang trims the stop token too
        o = {**o, "text": text}
        if matched is not None:
            o.update(
                output_ids=o["output_ids"][:keep],
                logprobs=o["logprobs"][:keep],
                finish="stop",
                matched=matched,
            )
        return o

    def _over_limits(
        self, batch: list[list[int]], parsed: list[tuple[SamplingParams, int | None]]
    ) -> str | None:
        """Why the server refuses this batch (tokens, context length), or None."""
        lim = self.limits  # the number of prompts: refused before they are parsed (_parse_generate)
        total = sum(len(p) + sp.max_new_tokens for p, (sp, _) in zip(batch, parsed))
        if total > lim.max_total_tokens:
            return limit_message("prompt + max_new_tokens tokens", total, "max_total_tokens", lim)
        context = int(getattr(self.engine, "max_context_length", 0) or 0)
        for i, (p, (sp, _)) in enumerate(zip(batch, parsed)):
            if context and len(p) + sp.max_new_tokens > context:  # SGLang's tokenizer_manager message
                return (
                    f"Requested token count exceeds the model's maximum context length of {context} "
                    f"tokens. You requested a total of {len(p) + sp.max_new_tokens} tokens: {len(p)} "
                    f"tokens from the input messages and {sp.max_new_tokens} tokens for the completion "
                    f"(prompt {i}). Please reduce the number of tokens in the input messages or the "
                    "completion to fit within the limit."
                )
        return None

    def _run_locked(
        self, batch: list[list[int]], parsed: list[tuple[SamplingParams, int | None]], want_routes: bool
    ) -> tuple[str, list[dict]]:
        with self.engine_lock:
            return self.version, self._run(batch, parsed, want_routes)

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
                    "latency": dt,
                }
                if want_routes and rollouts.routes_BTLK is not None:
                    out["routes"] = encode_sglang_routes(decode_routes(rollouts.routes_BTLK[b, : T - 1]))
                outs.append(out)
            i = j
        return outs

    def _item(
        self, o: dict | None, rid: str, version: str, want_lp: bool, aborted: bool, params: SamplingParams
    ) -> dict:
        """One response as SGLang's tokenizer_manager builds it (``text`` first when ``o`` has one).

        ``o`` None: aborted before it ran (no tokens). An aborted request keeps what it generated
        (this engine cannot stop mid-call, so that is everything) with finish_reason abort.
        """
        o = o or {"output_ids": [], "logprobs": [], "finish": "abort", "prompt_tokens": 0, "latency": 0.0}
        if self.text is not None:
            o.setdefault("text", "")
        ids = o["output_ids"]
        if aborted:
            fr = {
                "type": "abort",
                "message": "Abort in waiting queue" if not ids else "Abort",
                "status_code": 200,
            }
        elif o["finish"] == "stop":
            fr = {"type": "stop", "matched": o.get("matched", ids[-1] if ids else None)}
        else:
            fr = {"type": "length", "length": params.max_new_tokens}
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
        if "text" in o:  # SGLang's order: text, output_ids, meta_info
            return {"text": o["text"], "output_ids": ids, "meta_info": meta}
        return {"output_ids": ids, "meta_info": meta}

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
        """SGLang's server_info, plus ``moe_rl_limits`` (flag -> value), ``moe_rl_state`` and
        ``moe_rl_aborts`` (aborted stalled sessions and pauses, newest last)."""
        with self.cond:
            self._expire_locked()
            state = {
                "paused": self.paused,
                "update_session_open": self.session is not None,
                "released": sorted(self.released),
                "active_generations": self.active,
            }
            aborts = list(self.aborts)
        return 200, {
            **self.server_args,
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "skip_tokenizer_init": self.text is None,
            "weight_version": self.version,
            "enable_return_routed_experts": self.enable_routes,
            "enable_memory_saver": self.enable_memory_saver,
            "max_context_length": int(getattr(self.engine, "max_context_length", 0) or 0),
            "internal_states": [{"generate_requests": self.served}],
            "version": f"moe-rl-{moe_rl.__version__}",
            "weight_update_session": True,
            "max_running_requests": self.limits.max_running_requests,
            "max_total_tokens": self.limits.max_total_tokens,
            "moe_rl_limits": {FLAGS[f]: getattr(self.limits, f) for f in FLAGS},
            "moe_rl_state": state,
            "moe_rl_aborts": aborts,
        }

    def removed_weight_version(self, body: dict) -> tuple[int, Any]:
        return 404, {"detail": DEPRECATED_WEIGHT_VERSION}

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        if hasattr(self.engine, "flush_cache"):
            with self.engine_lock:
                self.engine.flush_cache()
        return 200, "Cache flushed.\n"

    # ----------------------------------------------------------------- pause / abort
    def pause_generation(self, body: dict) -> tuple[int, Any]:
        mode = get_field(body, "mode", "str", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"body.mode={mode!r}: expected abort, retract or in_place")
        with self.cond:
            self.paused = True
            if mode == "abort":
                for rid in self.inflight:
                    self.inflight[rid] = True
                self.cond.notify_all()
            self._drain()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, body: dict) -> tuple[int, Any]:
        """SGLang's AbortReq: ``rid`` or ``abort_all``; unknown rids are ignored (200, empty body)."""
        rid = get_field(body, "rid", "str", "")
        if get_field(body, "abort_all", "bool", False):
            self.abort_all()
        elif rid:
            with self.cond:
                for r in self.inflight:  # by prefix, as SGLang's scheduler matches AbortReq.rid
                    if r.startswith(rid):
                        self.inflight[r] = True
                self.cond.notify_all()
        return 200, None
