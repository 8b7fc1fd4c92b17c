"""SGLang's HTTP contract as moe-rl drives it: the supported versions, the errors, and the
``/generate`` request body and response (:class:`GenerateOutput`).

Field names follow SGLang as pinned by tests/integration/test_sglang_wheels.py against the wheels of the
oldest and newest supported versions (``SUPPORTED_SGLANG``); where each comes from
(sgl-project/sglang):
- ``python/sglang/srt/managers/io_struct.py``: GenerateReqInput (input_ids, sampling_params, rid,
  return_logprob, return_routed_experts), InitWeightsUpdateGroupReqInput,
  UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput,
  UpdateWeightVersionReqInput, PauseGenerationReqInput (mode), BeginWeightUpdateReqInput (selector),
  AbortReq (rid, abort_all), Release/ResumeMemoryOccupationReqInput (tags).
- ``python/sglang/srt/entrypoints/http_server.py``: endpoint paths, error bodies, the ``--api-key`` /
  ``--admin-api-key`` bearer header; ``/get_weight_version`` answers 404 ("use /model_info").
- ``python/sglang/api/v1/api_types.py``: LogprobEntry is a [logprob, token_id, text] triple;
  FinishReason is an object tagged by "type" (stop | length | abort).

Tokens are read from the ``output_token_logprobs`` triples (as slime and verl do); ``output_ids``,
when present, must agree with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

from moe_rl.errors import Unavailable
from moe_rl.rollout.types import SamplingParams

SUPPORTED_SGLANG = ">=0.5.11,<0.6"
"""Versions moe-rl drives. 0.5.11 is the first release that both accepts
``--enable-return-routed-experts`` (sgl-project/sglang#12162) and base64-encodes ``routed_experts``
when launched with ``--skip-tokenizer-init``; 0.6 may change the native API. Tested wheels:
``TESTED_SGLANG``."""
TESTED_SGLANG = ("0.5.11", "0.5.23")
"The oldest and newest supported versions, whose wheels the contract tests read."

ROUTES_MISSING = '"routed_experts" absent: start the server with --enable-return-routed-experts'


class SGLangError(RuntimeError):
    """Base class of every error this client raises."""


class SGLangUnavailable(SGLangError, Unavailable):
    """The server could not be reached (down, refusing, or dropped the connection); the command
    line shows it as one line (:class:`moe_rl.errors.Unavailable`)."""


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


class SGLangVersionError(SGLangError):
    """The installed SGLang is outside ``SUPPORTED_SGLANG``."""


def check_sglang_version(version: str | None) -> str:
    """``version`` (default: the installed sglang's) if inside ``SUPPORTED_SGLANG``, else raise."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        try:
            version = dist_version("sglang")
        except PackageNotFoundError as e:
            raise SGLangVersionError(
                f"sglang is not installed: pip install 'sglang{SUPPORTED_SGLANG}' (or moe-rl[sglang])"
            ) from e
    try:
        ok = Version(version) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        ok = False
    if not ok:
        raise SGLangVersionError(
            f"sglang {version} is installed but moe-rl supports sglang{SUPPORTED_SGLANG}: older releases "
            f"reject --enable-return-routed-experts (before sgl-project/sglang#12162) or, with "
            f"--skip-tokenizer-init, return routed_experts unencoded (before 0.5.11); "
            f"pip install 'sglang{SUPPORTED_SGLANG}'"
        )
    return version


@dataclass
class GenerateOutput:
    """One parsed ``/generate`` response."""

    output_ids: list[int]
    "Generated token ids (stop token included, as SGLang returns it), read from the logprob triples."
    logprobs: list[float] | None
    "Log-prob of each generated token (``meta_info.output_token_logprobs``), or None."
    finish_reason: str
    "'stop', 'length', or 'abort' (only where the caller allows aborted rows)."
    prompt_tokens: int
    "Prompt length the server counted."
    weight_version: str | None
    "``meta_info.weight_version`` (None from servers that do not report it)."
    routed_experts: str | None
    "Base64 int32 [prompt + completion - 1, L, K] routes, or None."
    meta_info: dict = field(default_factory=dict)
    "The raw meta_info."


def generate_body(
    input_ids: Any, sampling_params: Any, return_logprob: bool, return_routed_experts: bool, rid: Any = None
) -> dict:
    """A GenerateReqInput body (``return_routed_experts`` only when asked: older servers reject it)."""
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
    }
    if rid is not None:
        body["rid"] = rid
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


def parse_generate_response(
    resp: dict, *, want_logprobs: bool, want_routes: bool, allow_abort: bool = False
) -> GenerateOutput:
    """Parse one ``/generate`` item (see the module docstring for where each field comes from).

    ``allow_abort``: a request aborted by ``/abort_request`` (a straggler at the step deadline)
    is returned with what it generated so far and finish_reason 'abort'.
    """
    if not isinstance(resp, dict) or not isinstance(resp.get("meta_info"), dict):
        raise SGLangError(f"/generate item without meta_info: {str(resp)[:300]}")
    meta = resp["meta_info"]
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind not in ("stop", "length") and not (allow_abort and kind == "abort"):
        detail = fr.get("message") if isinstance(fr, dict) else fr
        raise SGLangError(
            f"request {meta.get('id')} did not finish normally (finish_reason={kind!r}: {detail}); "
            f"was generation paused in 'abort' mode or the request aborted?"
        )
    triples = meta.get("output_token_logprobs")
    output_ids = resp.get("output_ids")
    if triples is not None:
        from_triples = [int(t[1]) for t in triples]
        if output_ids is not None and list(output_ids) != from_triples:
            raise SGLangError("output_token_logprobs token ids disagree with output_ids")
        output_ids = from_triples
    elif want_logprobs:
        raise SGLangError("meta_info.output_token_logprobs absent although return_logprob=true")
    if output_ids is None:
        raise SGLangError("/generate item has neither output_ids nor output_token_logprobs")
    routes = meta.get("routed_experts")
    if want_routes and routes is None and output_ids:
        raise RoutesMissing(ROUTES_MISSING)
    logprobs = None
    if want_logprobs:
        bad = [i for i, t in enumerate(triples) if not isinstance(t[0], (int, float))]
        if bad:  # SGLang's JSON writes a non-finite log-prob as null
            raise SGLangError(
                f"request {meta.get('id')}: output_token_logprobs has {len(bad)} non-numeric (null, i.e. "
                f"non-finite) log-probs, first at token {bad[0]}: the engine's weights or numerics "
                "are broken; check the server log"
            )
        logprobs = [float(t[0]) for t in triples]
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
