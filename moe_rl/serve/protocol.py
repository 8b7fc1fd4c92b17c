"""SGLang request checks and responses, apart from the HTTP app (no engine, no sockets).

``sampling_params`` fields and defaults: ``python/sglang/srt/sampling/sampling_params.py`` and
``python/sglang/api/v1/api_types.py``; error bodies: ``python/sglang/srt/entrypoints/http_server.py``
(sgl-project/sglang, 0.5.x). Malformed requests raise :class:`BadRequest` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from moe_rl.rollout.types import SamplingParams

# SGLang SamplingParams fields (api/v1/api_types.py _FIELDS_SamplingParams); anything else is a 400.
_SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
)
# Accepted only at their neutral value (no penalties or grammars; ``stop`` needs the tokenizer).
_NEUTRAL = {
    "stop": None,
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
}
_TOP_K_ALL = 1 << 30  # sampling_params.py TOP_K_ALL: "whole vocabulary"
_MISSING = object()


class BadRequest(ValueError):
    """A malformed request; the message names the field."""


class ModelNotFound(LookupError):
    """An OpenAI request for a model this server does not serve: answered 404 as OpenAI answers it
    (:func:`model_not_found`), which OpenAI clients raise as ``NotFoundError``."""


def model_not_found(message: str) -> dict:
    """OpenAI's error object for an unknown ``model`` (status 404)."""
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def check_kind(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "num":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "dict":
        return isinstance(value, dict)
    if kind.startswith("list[") and isinstance(value, list):
        return all(check_kind(v, kind[5:-1]) for v in value)
    return False


def get_field(body: dict, name: str, kind: str, default: Any = _MISSING, where: str = "body") -> Any:
    """``body[name]`` checked against ``kind`` (None means the default, as in SGLang)."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise BadRequest(f"{where}.{name}: field required")
        return default
    if not check_kind(value, kind):
        raise BadRequest(f"{where}.{name}: expected {kind}, got {json.dumps(value)[:80]}")
    return value


MAX_SEED = 2**63 - 1
"The largest sampling seed (a CPU generator's seed is a 64-bit integer; row j samples with seed + j)."
GREEDY_BELOW = 1e-6
"A temperature below this samples greedily, as SGLang's sampling_params.py (_SAMPLING_EPS)."


def get_number(
    body: dict,
    name: str,
    kind: str,
    default: Any = _MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    above: bool = False,
    where: str = "body",
) -> Any:
    """``body[name]`` as :func:`get_field` reads it, then within ``[lo, hi]`` (``above``: ``> lo``);
    a :class:`BadRequest` naming the field and its range otherwise (before any work is done)."""
    value = get_field(body, name, kind, default, where)
    if value is None:
        return value
    low_ok = lo is None or (value > lo if above else value >= lo)
    if not (low_ok and (hi is None or value <= hi)):
        low = "" if lo is None else f"{'>' if above else '>='} {lo:g}"
        high = "" if hi is None else f"<= {hi:g}" if isinstance(hi, float) else f"<= {hi}"
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        raise BadRequest(
            f"{where}.{name}={shown}: expected a number {' and '.join(x for x in (low, high) if x)}"
        )
    return value


def error_response(message: str) -> dict:
    """SGLang's ErrorResponse for request validation errors (http_server.py, status 400)."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def update_result(ok: bool, message: str, **extra: Any) -> tuple[int, dict]:
    """SGLang's weight-update answer: 200 {"success": true, ...} or 400 {"success": false, ...}."""
    return (200 if ok else 400), {"success": ok, "message": message, **extra}


def to_sampling(sp: dict, where: str, with_text: bool = False) -> tuple[SamplingParams, int | None]:
    """One SGLang ``sampling_params`` dict -> (our SamplingParams without seed, sampling_seed).

    ``with_text``: the server has a tokenizer, so ``stop`` strings are allowed (:func:`text_options`)."""
    if not isinstance(sp, dict):
        raise BadRequest(f"{where}: expected an object")
    for key, value in sp.items():
        if key not in _SAMPLING_FIELDS:
            raise BadRequest(
                f"{where}.{key}: unknown sampling parameter (SGLang's are: {', '.join(_SAMPLING_FIELDS)})"
            )
        if key == "stop" and with_text:
            continue
        if key in _NEUTRAL and value not in (_NEUTRAL[key], None) and value not in ([], {}):
            why = " without a tokenizer (--skip-tokenizer-init)" if key == "stop" else ""
            raise BadRequest(f"{where}.{key}={value!r} is not supported by moe-rl serve{why}")
    top_k = get_field(sp, "top_k", "int", -1, where)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"{where}.top_k={top_k}: expected -1 (the whole vocabulary) or an integer >= 1")
    stops = get_field(sp, "stop_token_ids", "list[int]", [], where)
    if any(t < 0 for t in stops):
        raise BadRequest(f"{where}.stop_token_ids: token ids are >= 0, got {min(stops)}")
    temperature = float(get_number(sp, "temperature", "num", 1.0, lo=0, where=where))
    params = SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,  # SGLang: greedy
        top_p=float(get_number(sp, "top_p", "num", 1.0, lo=0, hi=1, above=True, where=where)),
        top_k=-1 if top_k >= _TOP_K_ALL else top_k,
        max_new_tokens=get_number(sp, "max_new_tokens", "int", 128, lo=1, where=where),
        stop_token_ids=tuple(stops),
        ignore_eos=bool(get_field(sp, "ignore_eos", "bool", False, where)),
    )
    return params, get_number(sp, "sampling_seed", "int", None, lo=0, hi=MAX_SEED, where=where)


def text_options(sp: Any, where: str) -> tuple[tuple[str, ...], bool, bool]:
    """(stop strings, trim the matched one from the text, skip special tokens) of ``sampling_params``."""
    if not isinstance(sp, dict):
        return (), True, True
    stop = sp.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not check_kind(stop, "list[str]"):
        raise BadRequest(f"{where}.stop: expected a string or a list of strings, got {json.dumps(stop)[:80]}")
    trim = not get_field(sp, "no_stop_trim", "bool", False, where)
    skip = get_field(sp, "skip_special_tokens", "bool", True, where)
    return tuple(s for s in stop or () if s), trim, skip


def validate_hf_tensors(
    named: dict[str, torch.Tensor], meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> None:
    """Every name known, every shape and dtype equal to the served ones, every value finite;
    ValueError names the first tensor that is not."""
    for name, t in named.items():
        if name not in meta:
            raise ValueError(f"{name!r} is not a weight of the served model")
        shape, dtype = meta[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name!r}: shape {list(t.shape)} does not match the served {list(shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name!r}: dtype {t.dtype} does not match the served {dtype}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(
                f"{name!r}: {bad} of {t.numel()} values are NaN or infinite; the served weights are kept "
                "(push finite weights: the trainer's model is broken)"
            )
