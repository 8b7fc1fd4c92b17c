"""HTTP client for an SGLang server (or ``moe-rl serve``), and the ``sglang`` rollout engine.

Shape legend: B = sequences (prompts x samples), T = padded prompt+response length,
L = MoE layers, K = experts per token, N = routed rows of one sequence (total_len - 1).

Field names follow SGLang 0.5.x; where each comes from (sgl-project/sglang):
- ``python/sglang/srt/managers/io_struct.py``: GenerateReqInput (input_ids, sampling_params,
  return_logprob, return_routed_experts), UpdateWeightsFromDistributedReqInput,
  InitWeightsUpdateGroupReqInput, UpdateWeightFromDiskReqInput, UpdateWeightVersionReqInput,
  PauseGenerationReqInput (mode), BeginWeightUpdateReqInput (selector).
- ``python/sglang/srt/sampling/sampling_params.py``: SamplingParams (max_new_tokens, temperature,
  top_p, top_k, stop_token_ids, sampling_seed).
- ``python/sglang/srt/managers/tokenizer_manager.py``: meta_info keys (id, finish_reason,
  prompt_tokens, completion_tokens, weight_version, output_token_logprobs, routed_experts).
- ``python/sglang/srt/entrypoints/http_server.py``: endpoint paths and error bodies.
- ``python/sglang/api/v1/api_types.py``: LogprobEntry is a [logprob, token_id, text] triple;
  FinishReason is an object tagged by "type" (stop | length | abort).

Only the standard library does the HTTP (``http.client``): no ``requests`` dependency.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from moe_rl.rollout.types import HFStateSource, Rollouts, SamplingParams
from moe_rl.routing.codec import decode_sglang_routes, encode_routes

logger = logging.getLogger(__name__)

ROUTES_MISSING = '"routed_experts" absent: start the server with --enable-return-routed-experts'


class SGLangError(RuntimeError):
    """Base class of every error this client raises."""


class SGLangUnavailable(SGLangError):
    """The server could not be reached (down, refusing, or dropped the connection)."""


class SGLangTimeout(SGLangUnavailable):
    """The server accepted the request but did not answer within the timeout."""


class SGLangHTTPError(SGLangError):
    """The server answered with a non-2xx status; ``message`` is its own error text."""

    def __init__(self, url: str, status: int, message: str, body: Any = None):
        super().__init__(f"{url} answered HTTP {status}: {message}")
        self.url, self.status, self.message, self.body = url, status, message, body


class SGLangBadRequest(SGLangHTTPError):
    """HTTP 400: the request was rejected (never retried); carries SGLang's error message."""


class SGLangNotFound(SGLangHTTPError):
    """HTTP 404: the server does not have this endpoint (an older or newer SGLang)."""


class RoutesMissing(SGLangError):
    """Routes were asked for but the response has no ``meta_info["routed_experts"]``."""


class StaleWeightsError(SGLangError):
    """A response was produced by weights other than the version last pushed."""


@dataclass
class GenerateOutput:
    """One parsed ``/generate`` response."""

    output_ids: list[int]
    "Generated token ids (stop token included, as SGLang returns it)."
    logprobs: list[float] | None
    "Log-prob of each generated token (``meta_info.output_token_logprobs``), or None."
    finish_reason: str
    "'stop' or 'length'."
    prompt_tokens: int
    "Prompt length the server counted."
    weight_version: str | None
    "``meta_info.weight_version`` (None from servers that do not report it)."
    routed_experts: str | None
    "Base64 int32 [prompt + completion - 1, L, K] routes, or None."
    meta_info: dict = field(default_factory=dict)
    "The raw meta_info."


def _error_message(body: Any, raw: bytes) -> str:
    """SGLang's error text from any of its error bodies.

    http_server.py answers ``{"error": {"message": ...}}`` (_create_error_response),
    ``{"object": "error", "message": ..., "code": 400}`` (ErrorResponse, request validation)
    or ``{"success": false, "message": ...}`` (weight updates); /flush_cache answers text.
    """
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return raw.decode("utf-8", "replace").strip()[:2000] or "(empty body)"


class SGLangClient:
    """Thin, strict client for SGLang's native HTTP API.

    Every call has a timeout. Connection errors and 5xx answers are retried ``retries``
    times with exponential backoff (``backoff_s``, doubling); a 400 is never retried.
    Calls that change weights are never retried (a repeated broadcast would hang).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 120.0, retries: int = 3, backoff_s: float = 0.5):
        parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"SGLang base_url must look like http://host:port, got {base_url!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self.base_url = f"http://{host}:{parts.port or 80}"
        self._host, self._port = parts.hostname, parts.port or 80
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._session_supported: bool | None = None
        self._atomic_session: bool | None = None

    # ----------------------------------------------------------------- transport
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send one request; return the decoded JSON (or text) body of a 2xx answer."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = 1 + (self.retries if retries is None else retries)
        url = self.base_url + path
        payload = None if body is None else json.dumps(body).encode("utf-8")
        t0, last = time.monotonic(), None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, raw = self._send(method, path, payload, timeout)
            except TimeoutError as e:
                raise SGLangTimeout(
                    f"{url} did not answer within {timeout:.1f} s "
                    f"(timeout_s); is the server overloaded or hung?"
                ) from e
            except (ConnectionError, http.client.HTTPException, OSError) as e:
                last = e
                logger.debug("%s %s failed (attempt %d/%d): %s", method, url, attempt + 1, attempts, e)
                continue
            decoded = _decode(raw)
            if 200 <= status < 300:
                return decoded
            msg = _error_message(decoded, raw)
            if status == 400:
                raise SGLangBadRequest(url, status, msg, decoded)
            if status == 404:
                raise SGLangNotFound(url, status, msg, decoded)
            if status < 500:
                raise SGLangHTTPError(url, status, msg, decoded)
            last = SGLangHTTPError(url, status, msg, decoded)
        waited = time.monotonic() - t0
        if isinstance(last, SGLangHTTPError):
            raise SGLangHTTPError(
                url, last.status, f"{last.message} (after {attempts} attempts over {waited:.1f} s)", last.body
            )
        raise SGLangUnavailable(
            f"SGLang server at {self.base_url} is unavailable: {method} {path} "
            f"failed {attempts} times over {waited:.1f} s; last error: "
            f"{type(last).__name__}: {last}"
        )

    def _send(self, method: str, path: str, payload: bytes | None, timeout: float) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    # ----------------------------------------------------------------- status
    def health(self, *, timeout_s: float | None = None) -> bool:
        """GET /health: True on 200, False on 503 (starting or shutting down)."""
        return self._probe("/health", timeout_s)

    def health_generate(self, *, timeout_s: float | None = None) -> bool:
        """GET /health_generate: True once the server generates a token."""
        return self._probe("/health_generate", timeout_s)

    def _probe(self, path: str, timeout_s: float | None) -> bool:
        try:
            self.request("GET", path, timeout_s=timeout_s, retries=0)
            return True
        except SGLangHTTPError as e:
            if e.status == 503:
                return False
            raise

    def model_info(self) -> dict:
        """/model_info (newer SGLang) or /get_model_info (0.5.x)."""
        return self._get_either("/model_info", "/get_model_info")

    def server_info(self) -> dict:
        """/server_info (newer SGLang) or /get_server_info (0.5.x): server args + version."""
        return self._get_either("/server_info", "/get_server_info")

    def _get_either(self, new: str, old: str) -> dict:
        try:
            return self.request("GET", new)
        except SGLangNotFound:
            return self.request("GET", old)

    def get_weight_version(self) -> str:
        """GET /get_weight_version -> the version the server serves."""
        return str(self.request("GET", "/get_weight_version")["weight_version"])

    def flush_cache(self) -> None:
        """POST /flush_cache (400 while requests are running, as in SGLang)."""
        self.request("POST", "/flush_cache")

    # ----------------------------------------------------------------- generation control
    def pause_generation(self, mode: str = "abort") -> Any:
        """POST /pause_generation; ``mode`` is PauseGenerationReqInput.mode (older servers ignore it)."""
        return self.request("POST", "/pause_generation", {"mode": mode}, retries=0)

    def continue_generation(self) -> Any:
        """POST /continue_generation."""
        return self.request("POST", "/continue_generation", {})

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> Any:
        """POST /update_weight_version (UpdateWeightVersionReqInput)."""
        return self.request(
            "POST",
            "/update_weight_version",
            {"new_version": new_version, "abort_all_requests": abort_all_requests},
            retries=0,
        )

    def supports_weight_update_session(self) -> bool | None:
        """Whether /begin_weight_update exists: True/False when known, None when unknown.

        ``moe-rl serve`` advertises its atomic session as ``server_info()["weight_update_session"]``;
        SGLang 0.5.x has no such endpoints; later SGLang main has them (BeginWeightUpdateReqInput)
        without advertising them, so there they are probed, and they are not atomic.
        """
        if self._atomic_session is None:
            try:
                flag = self.server_info().get("weight_update_session")
            except SGLangHTTPError:
                flag = None
            self._atomic_session = flag is True
            if flag is not None:
                self._session_supported = bool(flag)
        return self._session_supported

    @property
    def atomic_weight_updates(self) -> bool:
        """True when a failed session leaves the server's weights untouched (``moe-rl serve``)."""
        self.supports_weight_update_session()
        return bool(self._atomic_session)

    def begin_weight_update(self, selector: str = "all") -> bool:
        """Open a weight-update session; False when the server has no such endpoint."""
        if self.supports_weight_update_session() is False:
            return False
        try:
            self.request("POST", "/begin_weight_update", {"selector": selector}, retries=0)
        except SGLangNotFound:
            self._session_supported = False
            return False
        self._session_supported = True
        return True

    def end_weight_update(self, *, abort: bool = False) -> Any:
        """Close the session. ``abort`` (ours) makes ``moe-rl serve`` discard what was staged;
        SGLang's EndWeightUpdateReqInput has no fields, so elsewhere the session is just closed."""
        body = {"abort": True} if abort and self.atomic_weight_updates else {}
        return self.request("POST", "/end_weight_update", body, retries=0)

    # ----------------------------------------------------------------- weight updates
    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None = None,
    ) -> Any:
        """POST /init_weights_update_group; blocks until the trainer joins the group."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return self.request("POST", "/init_weights_update_group", body, timeout_s=timeout_s, retries=0)

    def destroy_weights_update_group(self, group_name: str) -> Any:
        """POST /destroy_weights_update_group."""
        return self.request("POST", "/destroy_weights_update_group", {"group_name": group_name}, retries=0)

    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """POST /update_weights_from_distributed; blocks while the trainer broadcasts."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.request("POST", "/update_weights_from_distributed", body, timeout_s=timeout_s, retries=0)

    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        """POST /update_weights_from_disk (UpdateWeightFromDiskReqInput)."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.request("POST", "/update_weights_from_disk", body, timeout_s=timeout_s, retries=0)

    # ----------------------------------------------------------------- generation
    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        timeout_s: float | None = None,
    ) -> list[GenerateOutput]:
        """POST /generate for a batch of token-id prompts; one parsed output per prompt."""
        if not input_ids or not all(isinstance(p, list) and p for p in input_ids):
            raise ValueError("generate() needs a non-empty batch of non-empty token-id lists")
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        out = self.request("POST", "/generate", body, timeout_s=timeout_s)
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or len(out) != len(input_ids):
            raise SGLangError(
                f"/generate returned {type(out).__name__} of "
                f"{len(out) if isinstance(out, list) else 1} items for "
                f"{len(input_ids)} prompts"
            )
        return [
            parse_generate_response(r, want_logprobs=return_logprob, want_routes=return_routed_experts)
            for r in out
        ]


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


def parse_generate_response(resp: dict, *, want_logprobs: bool, want_routes: bool) -> GenerateOutput:
    """Parse one ``/generate`` item (see the module docstring for where each field comes from)."""
    if not isinstance(resp, dict) or not isinstance(resp.get("meta_info"), dict):
        raise SGLangError(f"/generate item without meta_info: {str(resp)[:300]}")
    meta = resp["meta_info"]
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "abort" or kind not in ("stop", "length"):
        detail = fr.get("message") if isinstance(fr, dict) else fr
        raise SGLangError(
            f"request {meta.get('id')} did not finish normally "
            f"(finish_reason={kind!r}: {detail}); was generation paused in 'abort' mode?"
        )
    triples = meta.get("output_token_logprobs")
    output_ids = resp.get("output_ids")
    if output_ids is None and triples is not None:
        output_ids = [int(t[1]) for t in triples]
    if output_ids is None:
        raise SGLangError("/generate item has neither output_ids nor output_token_logprobs")
    logprobs = None
    if want_logprobs:
        if triples is None:
            raise SGLangError("meta_info.output_token_logprobs absent although return_logprob=true")
        if [int(t[1]) for t in triples] != list(output_ids):
            raise SGLangError("output_token_logprobs token ids disagree with output_ids")
        logprobs = [float(t[0]) for t in triples]
    routes = meta.get("routed_experts")
    if want_routes and routes is None:
        raise RoutesMissing(ROUTES_MISSING)
    return GenerateOutput(
        output_ids=[int(t) for t in output_ids],
        logprobs=logprobs,
        finish_reason=kind,
        prompt_tokens=int(meta.get("prompt_tokens", -1)),
        weight_version=meta.get("weight_version"),
        routed_experts=routes,
        meta_info=meta,
    )


def to_sglang_sampling_params(sampling: SamplingParams, seed: int | None) -> dict:
    """Our SamplingParams -> SGLang's ``sampling_params`` dict for one request.

    ``sampling_seed`` is SGLang's per-request seed (sampling_params.py); SGLang honours it for
    non-greedy sampling when launched with ``--enable-deterministic-inference``.
    """
    sp: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.stop_token_ids:
        sp["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.ignore_eos:
        sp["ignore_eos"] = True
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    return sp


class SGLangEngine:
    """RolloutEngine over an SGLang server: builds ``Rollouts`` and checks weight versions.

    ``num_layers``/``topk``/``num_experts`` describe the MoE (needed to decode routes).
    ``weight_sync`` is a pusher from :mod:`moe_rl.rollout.weight_sync` (needed by
    ``update_weights``); ``launcher`` (optional) is stopped by ``close()``.
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        num_layers: int | None = None,
        topk: int | None = None,
        num_experts: int | None = None,
        pad_id: int = 0,
        weight_sync: Any = None,
        launcher: Any = None,
        weight_version: str | None = None,
    ):
        self.client, self.pad_id = client, pad_id
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts
        self.weight_sync, self.launcher = weight_sync, launcher
        self.weight_version = weight_version if weight_version is not None else client.get_weight_version()
        self._weights_uncertain: str | None = None
        self._seed_checked = False
        self.last_push = None

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> Rollouts:
        """Sample ``n`` responses per prompt (rows of a prompt adjacent; row b uses seed + b)."""
        if self._weights_uncertain:
            raise StaleWeightsError(self._weights_uncertain)
        if n < 1 or not prompts:
            raise ValueError(f"generate needs prompts and n >= 1, got {len(prompts)} prompts, n={n}")
        if sampling.return_routes and None in (self.num_layers, self.topk, self.num_experts):
            raise ValueError("return_routes needs SGLangEngine(num_layers=, topk=, num_experts=)")
        if sampling.seed is not None and not self._seed_checked:
            self._check_seeds_honoured()
        rows = [list(p) for p in prompts for _ in range(n)]
        params = [
            to_sglang_sampling_params(sampling, None if sampling.seed is None else sampling.seed + b)
            for b in range(len(rows))
        ]
        t0 = time.perf_counter()
        outs = self.client.generate(
            rows, params, return_logprob=True, return_routed_experts=sampling.return_routes
        )
        gen_s = time.perf_counter() - t0
        for b, o in enumerate(outs):
            if o.weight_version != self.weight_version:
                raise StaleWeightsError(
                    f"row {b} was generated with weight_version {o.weight_version!r} but the trainer "
                    f"last pushed {self.weight_version!r}: another process changed the server's "
                    f"weights, or a push did not take effect"
                )
        batch = self._build(rows, outs, sampling, n)
        ntok = batch.num_response_tokens
        batch.extras.update(generate_s=gen_s, tokens_per_s=ntok / max(gen_s, 1e-9), requests=len(rows))
        return batch

    def _build(
        self, rows: list[list[int]], outs: list[GenerateOutput], sampling: SamplingParams, n: int
    ) -> Rollouts:
        B = len(rows)
        T = max(len(p) + len(o.output_ids) for p, o in zip(rows, outs))
        tokens_BT = torch.full((B, T), self.pad_id, dtype=torch.int64)
        mask_BT = torch.zeros(B, T, dtype=torch.float32)
        logp_BT = torch.zeros(B, T, dtype=torch.float32)
        routes_BTLK = None
        if sampling.return_routes:
            routes_BTLK = torch.zeros(B, T, self.num_layers, self.topk, dtype=torch.int64)
        plen, tlen = [], []
        for b, (p, o) in enumerate(zip(rows, outs)):
            P, R = len(p), len(o.output_ids)
            tokens_BT[b, :P] = torch.tensor(p)
            tokens_BT[b, P : P + R] = torch.tensor(o.output_ids, dtype=torch.int64)
            mask_BT[b, P : P + R] = 1.0
            logp_BT[b, P : P + R] = torch.tensor(o.logprobs, dtype=torch.float32)
            plen.append(P)
            tlen.append(P + R)
            if routes_BTLK is not None:
                routes_NLK = decode_sglang_routes(o.routed_experts, self.num_layers, self.topk)
                if routes_NLK.shape[0] != P + R - 1:
                    raise SGLangError(
                        f"row {b}: routed_experts has {routes_NLK.shape[0]} rows, expected "
                        f"prompt {P} + completion {R} - 1 = {P + R - 1}"
                    )
                routes_BTLK[b, : P + R - 1] = routes_NLK
        if routes_BTLK is not None:
            routes_BTLK = encode_routes(routes_BTLK, self.num_experts)
        return Rollouts(
            tokens_BT=tokens_BT,
            prompt_lens_B=torch.tensor(plen),
            total_lens_B=torch.tensor(tlen),
            response_mask_BT=mask_BT,
            logprobs_BT=logp_BT,
            finish_reasons=[o.finish_reason for o in outs],
            weight_version=self.weight_version,
            prompt_index_B=torch.arange(B) // n,
            routes_BTLK=routes_BTLK,
            pad_id=self.pad_id,
        )

    def _check_seeds_honoured(self) -> None:
        """SGLang ignores sampling_seed unless launched with --enable-deterministic-inference."""
        self._seed_checked = True
        try:
            deterministic = self.client.server_info().get("enable_deterministic_inference")
        except SGLangError:
            deterministic = None
        if deterministic is False:
            logger.warning(
                "%s ignores sampling seeds: launch SGLang with --enable-deterministic-inference "
                "for reproducible rollouts",
                self.client.base_url,
            )

    def update_weights(self, source: HFStateSource, version: str) -> str:
        """Push ``source`` with the configured weight sync; the server then serves ``version``."""
        if self.weight_sync is None:
            raise ValueError("SGLangEngine(weight_sync=...) is needed to push weights")
        try:
            self.last_push = self.weight_sync.push(source, version)
        except Exception as e:
            if getattr(e, "server_may_be_mixed", False):
                self._weights_uncertain = (
                    f"the push of {version!r} failed midway on a server without "
                    f"atomic weight-update sessions; push again before generating"
                )
            raise
        self._weights_uncertain = None
        self.weight_version = version
        return version

    def close(self) -> None:
        """Destroy the weight-update group and stop a launched server."""
        if self.weight_sync is not None and hasattr(self.weight_sync, "close"):
            self.weight_sync.close()
        if self.launcher is not None:
            self.launcher.stop()
