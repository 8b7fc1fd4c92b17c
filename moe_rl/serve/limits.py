"""What one client may ask of ``moe-rl serve``, and JSON that never carries NaN (no engine, no sockets).

:class:`ServeLimits` holds the limits and timeouts; :func:`add_limit_args` puts them on the
``moe-rl serve`` command line. Where SGLang has an option for the same resource its flag name is
kept (``--max-running-requests``, ``--max-total-tokens``; SGLang reads them as scheduler sizes, we
as per-request and per-engine-call caps, the embedded engine having no scheduler); the others are
ours and start with ``--moe-rl-``. A refused request names the limit and the flag that raises it:

- body larger than ``max_body_bytes`` (``max_weights_body_bytes`` for the serialized tensors of
  ``/update_weights_from_tensor``): 413, before the body is read;
- no body byte received for ``read_timeout_s`` (a ``Content-Length`` larger than what is sent): 408;
- more prompts than ``max_running_requests`` or more prompt + new tokens than ``max_total_tokens``
  in one ``/generate``: 400 (``{"error": {"message"}}``, SGLang's generate-error body);
- an update session or a pause with no admin request for ``stall_timeout_s`` is aborted (the app).

JSON, both ways (as SGLang's orjson responses, which write null for NaN and infinities):
requests holding ``NaN``, ``Infinity`` or a number that overflows a double are refused (400, the
body is not JSON); in responses a non-finite float becomes ``null`` and a warning names the field
(a log-prob: SGLang's LogprobEntry allows null; anything else is a number we report). Non-finite
*weights* are refused at update (:func:`moe_rl.serve.protocol.validate_hf_tensors`), so a served
model does not produce them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class ServeLimits:
    """Limits and timeouts of ``moe-rl serve`` (the flag of each in :data:`FLAGS`)."""

    max_body_bytes: int = 16 * MiB
    "Largest request body (413 above); 16 MiB is ~2M prompt token ids as JSON."
    max_weights_body_bytes: int = 2048 * MiB
    "Largest ``/update_weights_from_tensor`` body: a 512 MiB bucket is ~700 MiB as base64."
    read_timeout_s: float = 30.0
    "Seconds a request body may stall (no byte received) before the request is refused (408)."
    max_running_requests: int = 256
    "Most prompts in one ``/generate`` and rows in one engine call."
    max_total_tokens: int = 262144
    "Most prompt + max_new_tokens tokens in one ``/generate`` and in one engine call."
    stall_timeout_s: float = 900.0
    "An update session or pause with no admin request this long is aborted."
    health_timeout_s: float = 20.0
    "``/health_generate`` answers 503 when the engine is busy this long (SGLang's HEALTH_CHECK_TIMEOUT)."

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok = isinstance(value, (int, float)) and math.isfinite(value) and value >= sys.float_info.min
            if not (ok and value <= 2**63 - 1):  # > 0, not subnormal, a 64-bit size
                raise ValueError(f"{FLAGS[f.name]} {value}: expected a finite number > 0")


FLAGS = {
    "max_body_bytes": "--moe-rl-max-body-bytes",
    "max_weights_body_bytes": "--moe-rl-max-weights-body-bytes",
    "read_timeout_s": "--moe-rl-read-timeout",
    "max_running_requests": "--max-running-requests",
    "max_total_tokens": "--max-total-tokens",
    "stall_timeout_s": "--moe-rl-stall-timeout",
    "health_timeout_s": "--moe-rl-health-timeout",
}
"ServeLimits field -> the ``moe-rl serve`` flag that sets it."


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The limit flags, defaults from :class:`ServeLimits`."""
    d = ServeLimits()
    g = p.add_argument_group("limits (a request over one is refused, naming the flag)")
    for name, flag in FLAGS.items():
        kind = int if isinstance(getattr(d, name), int) else float  # ranges: ServeLimits, one line
        metavar = "BYTES" if name.endswith("_bytes") else ("SECONDS" if name.endswith("_s") else "N")
        help_ = _HELP[name] + " (%(default)s)"
        g.add_argument(flag, dest=name, type=kind, default=getattr(d, name), metavar=metavar, help=help_)


_HELP = {
    "max_body_bytes": "largest request body in bytes, 413 above",
    "max_weights_body_bytes": "largest /update_weights_from_tensor body in bytes, 413 above",
    "read_timeout_s": "seconds a request body may stall (no byte received), 408 after",
    "max_running_requests": "most prompts in one /generate and rows in one engine call, 400 above",
    "max_total_tokens": "most prompt + max_new_tokens tokens in one /generate and engine call, 400 above",
    "stall_timeout_s": "seconds an update session or pause may go without an admin request before it is aborted",
    "health_timeout_s": "seconds /health_generate waits for a busy engine before answering 503",
}


def limits_from_args(args: argparse.Namespace) -> ServeLimits:
    """The ServeLimits of parsed ``moe-rl serve`` arguments (ValueError naming a bad flag)."""
    return ServeLimits(**{name: getattr(args, name) for name in FLAGS})


def limit_message(what: str, value: int, name: str, limits: ServeLimits) -> str:
    """``"<what> (<value>) exceeds <limit> (<flag>); ..."`` for a refused request."""
    limit = getattr(limits, name)
    return (
        f"{what} ({value}) exceeds the server's limit of {limit} ({FLAGS[name]}): "
        f"split the request, or restart moe-rl serve with a larger {FLAGS[name]}"
    )


# ----------------------------------------------------------------- JSON
class NonFiniteJSON(ValueError):
    """A request body with NaN, Infinity or a number too large for a double."""


def _no_constant(name: str) -> float:
    raise NonFiniteJSON(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteJSON(f"{text[:40]} overflows a double; send a finite number")
    return value


def strict_loads(raw: bytes | str) -> Any:
    """``json.loads`` refusing NaN, Infinity and overflowing numbers (ValueError names the token)."""
    return json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)


def finite(obj: Any, where: str = "$", found: list[str] | None = None) -> Any:
    """``obj`` with every non-finite float replaced by None; the JSON paths replaced go to ``found``."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        if found is not None:
            found.append(where)
        return None
    if isinstance(obj, dict):
        return {k: finite(v, f"{where}.{k}", found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v, f"{where}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def dumps(payload: Any, route: str = "") -> bytes:
    """JSON of a response, never NaN or Infinity: such floats become null, with a warning."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        found: list[str] = []
        clean = finite(payload, "$", found)
        logger.warning(
            "%s: %d non-finite number(s) sent as null, first %s", route or "response", len(found), found[:3]
        )
        return json.dumps(clean, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
