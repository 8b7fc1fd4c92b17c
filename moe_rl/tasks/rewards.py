"""User reward functions of the jsonl task: importing one, how it takes its arguments, and its value.

``REWARD_SIGNATURES`` is the one registry of the ways a reward function may take its arguments
(``task.jsonl.reward_signature``; ``auto`` picks by the function's parameter names):

* ``plain``: ``fn(response, answer, record) -> float``, positional; ``answer`` is the prompt's
  answer text and ``record`` the whole data row.
* ``verl``: verl's ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)``, by
  keyword as verl's NaiveRewardManager calls it; ``ground_truth`` is ``reward_model.ground_truth``
  as stored (not JSON-encoded) and ``extra_info`` the row's ``extra_info`` (``{}`` when absent).

With ``task.jsonl.reward_batched`` the function takes lists and returns a list, called once per
rollout batch: ``fn(responses, answers, records)`` or, as verl's BatchRewardManager calls it,
``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=)``.

A value is a real number, or a dict holding one under ``"score"`` (verl's convention; its other
keys are ignored). A raise, a non-number or a non-finite value is a :class:`RewardError` naming the
function and the row.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.configlib import ConfigError
from moe_rl.errors import UserError


class RewardError(UserError):
    """The user reward function raised or returned something other than a finite number; the
    message names the record (file and line) and what came back."""

    kind = "reward error"


@dataclass(frozen=True)
class RewardInput:
    """What one rollout row gives a reward function."""

    response: str
    "The decoded response."
    answer: str
    "The prompt's answer text (plain: the answer field; verl: the ground truth, JSON-encoded unless a string)."
    ground_truth: Any
    "The reference as stored (plain: the answer field's value; verl: reward_model.ground_truth)."
    data_source: str
    "The row's data_source ('' when it has none)."
    extra_info: dict
    "The row's extra_info ({} when it has none)."
    record: dict
    "The whole row."
    where: str
    "The row's file and line (parquet: row), for errors."


Args = tuple[tuple, dict]


@dataclass(frozen=True)
class RewardSignature:
    """One way of taking arguments: parameter names, and the call of one row and of a batch."""

    params: tuple[str, ...]
    "Parameter names of the per-row form."
    batched_params: tuple[str, ...]
    "Parameter names of the batched form."
    one: Callable[[RewardInput], Args]
    "(args, kwargs) of one row."
    batch: Callable[[Sequence[RewardInput]], Args]
    "(args, kwargs) of a batch of rows."
    keyword: bool
    "Called by keyword (so ``auto`` recognizes it by its parameter names)."


REWARD_SIGNATURES: dict[str, RewardSignature] = {
    "plain": RewardSignature(
        params=("response", "answer", "record"),
        batched_params=("responses", "answers", "records"),
        one=lambda r: ((r.response, r.answer, r.record), {}),
        batch=lambda rs: (([r.response for r in rs], [r.answer for r in rs], [r.record for r in rs]), {}),
        keyword=False,
    ),
    "verl": RewardSignature(
        params=("data_source", "solution_str", "ground_truth", "extra_info"),
        batched_params=("data_sources", "solution_strs", "ground_truths", "extra_infos"),
        one=lambda r: (
            (),
            {
                "data_source": r.data_source,
                "solution_str": r.response,
                "ground_truth": r.ground_truth,
                "extra_info": r.extra_info,
            },
        ),
        batch=lambda rs: (
            (),
            {
                "data_sources": [r.data_source for r in rs],
                "solution_strs": [r.response for r in rs],
                "ground_truths": [r.ground_truth for r in rs],
                "extra_infos": [r.extra_info for r in rs],
            },
        ),
        keyword=True,
    ),
}
"The ways a reward function takes its arguments (task.jsonl.reward_signature); see the module."


def import_reward_fn(spec: str) -> Callable:
    """Import ``module:function`` or ``path/to/file.py:function``; errors say what to fix."""
    where = f"task.jsonl.reward_fn={spec!r}"
    module_name, _, fn_name = spec.rpartition(":")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"{where}: file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"moe_rl_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(
                f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e}); "
                "put it on PYTHONPATH or write path/to/file.py:function"
            ) from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise ConfigError(f"{where}: {module_name}.{fn_name} is not callable")
    return fn


def _call_text(kind: str, batched: bool) -> str:
    sig = REWARD_SIGNATURES[kind]
    names = sig.batched_params if batched else sig.params
    return f"fn({', '.join(f'{n}=' if sig.keyword else n for n in names)})"


def resolve_signature(fn: Callable, spec: str, wanted: str, batched: bool) -> str:
    """The key of ``REWARD_SIGNATURES`` that ``fn`` follows: ``wanted``, or for ``auto`` the first
    keyword signature whose parameter names (per-row or batched) ``fn`` has, else ``plain``. A
    function that cannot be called that way (or whose names say batched when ``batched`` is off,
    or the reverse) is a :class:`ConfigError` saying which field to set."""
    where = f"task.jsonl.reward_fn={spec!r}"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return "plain" if wanted == "auto" else wanted
    names = set(params)
    kind = wanted
    if wanted == "auto":
        kind = next(
            (
                k
                for k, s in REWARD_SIGNATURES.items()
                if s.keyword and (set(s.params) <= names or set(s.batched_params) <= names)
            ),
            "plain",
        )
    sig = REWARD_SIGNATURES[kind]
    if sig.keyword:
        if not batched and set(sig.batched_params) <= names and not set(sig.params) <= names:
            raise ConfigError(
                f"{where} takes lists ({', '.join(sig.batched_params)}): set task.jsonl.reward_batched=true "
                "to call it once per rollout batch"
            )
        if batched and set(sig.params) <= names and not set(sig.batched_params) <= names:
            raise ConfigError(
                f"{where} takes one row ({', '.join(sig.params)}), but task.jsonl.reward_batched=true "
                f"calls it with lists ({', '.join(sig.batched_params)}): set reward_batched=false"
            )
    probe = RewardInput("", "", "", "", {}, {}, "")
    args, kwargs = sig.batch([probe]) if batched else sig.one(probe)
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{where} cannot be called as {_call_text(kind, batched)} ({e}): fix its parameters, or set "
            f"task.jsonl.reward_signature (auto, {', '.join(REWARD_SIGNATURES)}) / reward_batched"
        ) from e
    return kind


def score_value(value: object) -> float | None:
    """A reward value as a float: a finite real number, or a dict holding one under ``"score"``
    (verl's convention); None for anything else."""
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    return None


class RewardFn:
    """A user reward function with its signature: :meth:`one` scores a row, :meth:`many` a batch
    (one call when ``batched``, else one per row)."""

    def __init__(self, spec: str, wanted: str = "auto", batched: bool = False) -> None:
        self.spec, self.batched = spec, batched
        self.fn = import_reward_fn(spec)
        self.kind = resolve_signature(self.fn, spec, wanted, batched)
        self.signature = REWARD_SIGNATURES[self.kind]

    def _call(self, args: Args, what: str, response: str) -> object:
        try:
            return self.fn(*args[0], **args[1])
        except (Exception, SystemExit) as e:  # sys.exit() in a reward ended the run with no word
            raise RewardError(
                f"task.jsonl.reward_fn={self.spec} {what} raised {type(e).__name__}: {e} "
                f"(response {response[:60]!r})"
                + (": a reward function must return a number, not exit" if isinstance(e, SystemExit) else "")
            ) from e

    def _checked(self, value: object, where: str) -> float:
        out = score_value(value)
        if out is None:
            extra = " (a dict needs a finite number under 'score')" if isinstance(value, dict) else ""
            raise RewardError(
                f"task.jsonl.reward_fn={self.spec} on the record at {where} returned {value!r:.200} "
                f"({type(value).__name__}){extra}: it must return a finite number, e.g. 0.0 or 1.0, "
                "or {'score': number}"
            )
        return out

    def one(self, row: RewardInput) -> float:
        """The value of one row (a batched function gets one-element lists)."""
        return self.many([row])[0]

    def many(self, rows: Sequence[RewardInput]) -> list[float]:
        """The values of ``rows``: one call of a batched function, else one call per row."""
        if not self.batched:
            sig = self.signature
            return [
                self._checked(self._call(sig.one(r), f"on the record at {r.where}", r.response), r.where)
                for r in rows
            ]
        if not rows:
            return []
        what = f"on the batch of {len(rows)} rows from the record at {rows[0].where}"
        values = self._call(self.signature.batch(rows), what, rows[0].response)
        if isinstance(values, str | bytes | dict) or not isinstance(values, (Sequence, *_array_types())):
            raise RewardError(
                f"task.jsonl.reward_fn={self.spec} {what} returned {type(values).__name__}: "
                f"with task.jsonl.reward_batched=true it must return a list of {len(rows)} numbers"
            )
        values = list(values)
        if len(values) != len(rows):
            raise RewardError(
                f"task.jsonl.reward_fn={self.spec} {what} returned {len(values)} values for {len(rows)} rows: "
                "return one value per row, in order"
            )
        return [self._checked(v, r.where) for v, r in zip(values, rows, strict=True)]


def _array_types() -> tuple[type, ...]:
    """numpy arrays count as lists of values when numpy is loaded (never imported here)."""
    np = sys.modules.get("numpy")
    return (np.ndarray,) if np is not None else ()
