"""HTTP client for one SGLang server, router or ``moe-rl serve`` (httpx).

What it sends and reads follows SGLang's contract (:mod:`moe_rl.rollout.sglang_protocol`: versions,
errors, the ``/generate`` body and response).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from moe_rl.dist import host_port
from moe_rl.rollout.sglang_protocol import (
    GenerateOutput,
    SGLangBadRequest,
    SGLangError,
    SGLangHTTPError,
    SGLangNotFound,
    SGLangTimeout,
    SGLangUnavailable,
    generate_body,
    parse_generate_response,
)

logger = logging.getLogger(__name__)

SESSION_ENDPOINT = "/begin_weight_update"


def _error_message(body: Any, raw: bytes) -> str:
    """SGLang's error text from any of its error bodies.

    http_server.py answers ``{"error": {"message": ...}}`` (_create_error_response),
    ``{"object": "error", "message": ..., "code": 400}`` (ErrorResponse, request validation),
    ``{"success": false, "message": ...}`` (weight updates) or ``{"detail": ...}`` (HTTPException,
    FastAPI); /flush_cache answers text.
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


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


def _split(url: str):
    return urlsplit(url if "://" in url else f"http://{url}")


def url_host(url: str) -> str:
    """The host of ``url`` (``host:port`` or ``http://host:port``), IPv6 without brackets; "" if none."""
    return _split(url).hostname or ""


def normalize_url(base_url: str) -> str:
    """``host:port`` or ``http://host:port[/]`` -> ``http://host:port``; ValueError otherwise."""
    parts = _split(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"SGLang base_url must look like http://host:port, got {base_url!r}")
    return f"http://{host_port(parts.hostname, parts.port or 80)}"


def raise_for_status(url: str, status: int, raw: bytes) -> Any:
    """The decoded body of a 2xx answer; the matching SGLangHTTPError otherwise."""
    decoded = _decode(raw)
    if 200 <= status < 300:
        return decoded
    msg = _error_message(decoded, raw)
    cls = {400: SGLangBadRequest, 404: SGLangNotFound}.get(status, SGLangHTTPError)
    raise cls(url, status, msg, decoded)


class SGLangClient:
    """Strict client for SGLang's native HTTP API (one server, or a router in front of several).

    Every call has a timeout. Connection errors and 5xx answers are retried ``retries`` times with
    exponential backoff (``backoff_s``, doubling); a 4xx is never retried, nor is a call that
    changes weights (a repeated broadcast would hang). ``api_key`` is sent as
    ``Authorization: Bearer`` (SGLang's ``--api-key`` / ``--admin-api-key``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = normalize_url(base_url)
        self.transport = transport
        "httpx transport of every request (None: the network; tests pass an httpx.MockTransport)."
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http: httpx.Client | None = None
        self._session_supported: bool | None = None
        self._atomic_session: bool | None = None

    @property
    def host(self) -> str:
        return url_host(self.base_url)

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
                    f"{url} did not answer within {timeout:.1f} s (timeout_s); is the server overloaded or hung?"
                ) from e
            except (ConnectionError, OSError) as e:
                last = e
                logger.debug("%s %s failed (attempt %d/%d): %s", method, url, attempt + 1, attempts, e)
                continue
            try:
                return raise_for_status(url, status, raw)
            except SGLangHTTPError as e:
                if status < 500:
                    raise
                last = e
        waited = time.monotonic() - t0
        if isinstance(last, SGLangHTTPError):
            raise SGLangHTTPError(
                url, last.status, f"{last.message} (after {attempts} attempts over {waited:.1f} s)", last.body
            )
        raise SGLangUnavailable(
            f"SGLang server at {self.base_url} is unavailable: {method} {path} failed {attempts} times "
            f"over {waited:.1f} s; last error: {type(last).__name__}: {last}"
        )

    def _send(self, method: str, path: str, payload: bytes | None, timeout: float) -> tuple[int, bytes]:
        """One HTTP exchange (the seam tests replace): (status, raw body); TimeoutError/ConnectionError."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.base_url, headers=self.headers, transport=self.transport)
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            resp = self._http.request(method, path, content=payload, headers=headers, timeout=timeout)
        except httpx.TimeoutException as e:
            raise TimeoutError(str(e) or type(e).__name__) from e
        except httpx.TransportError as e:
            raise ConnectionError(str(e) or type(e).__name__) from e
        return resp.status_code, resp.content

    def close(self) -> None:
        """Close the connection pool."""
        if self._http is not None:
            self._http.close()
            self._http = None

    # ----------------------------------------------------------------- status
    def health(self, *, timeout_s: float | None = None) -> bool:
        """GET /health: True on 200, False on 503 (starting or shutting down)."""
        return self._probe("/health", timeout_s)

    def health_generate(self, *, timeout_s: float | None = None) -> bool:
        """GET /health_generate: True once the server generates a token (503 while paused)."""
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
        """/model_info (/get_model_info is deprecated in every supported version)."""
        return self._get_either("/model_info", "/get_model_info")

    def server_info(self) -> dict:
        """/server_info (/get_server_info is deprecated in every supported version)."""
        return self._get_either("/server_info", "/get_server_info")

    def _get_either(self, new: str, old: str) -> dict:
        try:
            return self.request("GET", new)
        except SGLangNotFound:
            return self.request("GET", old)

    def get_weight_version(self) -> str:
        """The version the server serves: ``/model_info["weight_version"]``.

        ``/get_weight_version`` answers 404 on every supported SGLang; it is read only from a
        server whose model info carries no weight version (pre-0.5 SGLang, old doubles).
        """
        info = self.model_info()
        if isinstance(info, dict) and info.get("weight_version") is not None:
            return str(info["weight_version"])
        return str(self.request("GET", "/get_weight_version")["weight_version"])

    def flush_cache(self) -> None:
        """POST /flush_cache (400 while requests are running, as in SGLang)."""
        self.request("POST", "/flush_cache")

    # ----------------------------------------------------------------- generation control
    def pause_generation(self, mode: str = "abort") -> Any:
        """POST /pause_generation; ``mode`` abort returns in-flight requests as aborted."""
        return self.request("POST", "/pause_generation", {"mode": mode}, retries=0)

    def continue_generation(self) -> Any:
        """POST /continue_generation."""
        return self.request("POST", "/continue_generation", {})

    def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> Any:
        """POST /abort_request (AbortReq): one request by ``rid``, or all of them."""
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        return self.request("POST", "/abort_request", body, retries=0)

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> Any:
        """POST /update_weight_version (UpdateWeightVersionReqInput)."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return self.request("POST", "/update_weight_version", body, retries=0)

    def get_weights_by_name(self, name: str, *, truncate_size: int = 100) -> Any:
        """POST /get_weights_by_name (GetWeightsByNameReqInput): the parameter's first
        ``truncate_size`` rows as nested lists (SGLang: only models that implement it)."""
        return self.request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """POST /release_memory_occupation (needs --enable-memory-saver; the server must be idle)."""
        return self.request("POST", "/release_memory_occupation", {"tags": tags}, retries=0)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        """POST /resume_memory_occupation (``tags``: weights, kv_cache; None: all)."""
        return self.request("POST", "/resume_memory_occupation", {"tags": tags}, retries=0)

    # ----------------------------------------------------------------- update session
    def supports_weight_update_session(self) -> bool | None:
        """Whether /begin_weight_update exists: True/False when known, None when unknown.

        ``moe-rl serve`` advertises its atomic session as ``server_info()["weight_update_session"]``;
        SGLang 0.5.11 has no such endpoint; 0.5.23 has it (and requires it around distributed and
        tensor updates) without advertising it, so there it is probed.
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
            self.request("POST", SESSION_ENDPOINT, {"selector": selector}, retries=0)
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
        load_format: str | None = None,
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
        if load_format is not None:
            body["load_format"] = load_format
        return self.request("POST", "/update_weights_from_distributed", body, timeout_s=timeout_s, retries=0)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """POST /update_weights_from_tensor: one base64 payload per TP rank of the server."""
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.request("POST", "/update_weights_from_tensor", body, timeout_s=timeout_s, retries=0)

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
        """POST /generate for a batch of token-id prompts in one request (tests, probes);
        rollouts send one request per sample (:mod:`moe_rl.rollout.sglang_engine`)."""
        if not input_ids or not all(isinstance(p, list) and p for p in input_ids):
            raise ValueError("generate() needs a non-empty batch of non-empty token-id lists")
        body = generate_body(input_ids, sampling_params, return_logprob, return_routed_experts)
        out = self.request("POST", "/generate", body, timeout_s=timeout_s)
        if isinstance(out, dict):
            out = [out]
        if not isinstance(out, list) or len(out) != len(input_ids):
            raise SGLangError(
                f"/generate returned {type(out).__name__} of {len(out) if isinstance(out, list) else 1} "
                f"items for {len(input_ids)} prompts"
            )
        return [
            parse_generate_response(r, want_logprobs=return_logprob, want_routes=return_routed_experts)
            for r in out
        ]
