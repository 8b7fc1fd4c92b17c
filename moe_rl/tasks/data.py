"""Data files of the jsonl task: JSONL or parquet, in the plain layout or verl's RL layout.

A file is parquet when its name ends in ``.parquet`` or it starts with parquet's magic bytes
(``PAR1``); it is read with pyarrow (``pip install pyarrow``, or the ``data`` extra), imported
only then. Any other file is JSONL: one JSON object per non-blank line. Rows are named
``path:line`` (JSONL, lines from 1) or ``path row i`` (parquet, rows from 0 as pandas and pyarrow
count them).

Layouts (``task.jsonl.format``; ``auto`` decides per file: verl when the first record, or the
parquet columns, hold ``reward_model``, else plain):

* plain: ``prompt_field`` and ``answer_field`` per record (any other keys are kept);
* verl: verl's RL layout (``examples/data_preprocess/gsm8k.py``): ``data_source``, ``prompt``
  (``prompt_field``, verl's ``data.prompt_key``), ``reward_model`` = ``{"style": ...,
  "ground_truth": ...}`` and an optional ``extra_info`` object; ``ability`` is not read.

A prompt is a string (used as it is) or a list of chat messages ``[{"role", "content"}]``,
rendered by :func:`render_chat`: with the tokenizer's chat template when it has one (as verl's
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``), else as plain
``role: content`` lines followed by ``assistant:``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.configlib import ConfigError

log = logging.getLogger(__name__)

LAYOUTS = ("plain", "verl")
"Row layouts a data file may have (task.jsonl.format, besides auto)."
VERL_FIELDS = ("data_source", "reward_model")
"Fields the verl layout needs besides the prompt field."
PLAIN_ASSISTANT_CUE = "assistant:"
"The last line of a chat rendered without a template: the model answers after it."


class JsonlDataError(ConfigError):
    """A data file or record that cannot be used; the message names the file and line (or row)."""

    kind = "data error"

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
        "The record field at fault (its rows are counted together), if one is."


@dataclass(frozen=True)
class Row:
    """One record of a data file, checked against its file's layout."""

    record: dict
    "The record as read (parquet: ``Table.to_pylist()``'s dict)."
    path: str
    "The file, as the recipe names it."
    line: int
    "JSONL line (from 1) or parquet row (from 0)."
    where: str
    "``path:line`` or ``path row i``, for messages."
    layout: str
    "plain | verl."
    prompt: Any
    "The prompt field's value: a string or a list of chat messages (checked by :func:`prompt_text`)."
    ground_truth: Any
    "plain: the answer field's value; verl: reward_model.ground_truth."
    data_source: Any
    "The record's data_source ('' when it has none)."
    extra_info: dict
    "The record's extra_info ({} when it has none or it is null)."


def is_parquet(path: Path) -> bool:
    """A ``.parquet`` name, or parquet's magic bytes at the start of the file."""
    if path.suffix.lower() == ".parquet":
        return True
    with path.open("rb") as f:
        return f.read(4) == b"PAR1"


def read_rows(
    path: str | Path,
    what: str,
    *,
    fmt: str,
    prompt_field: str,
    answer_field: str,
    extra: tuple[str, ...] = (),
) -> list[Row]:
    """Every record of ``path`` (JSONL or parquet) as a :class:`Row`, in its layout; the fields a
    layout needs (and ``extra``) must be there. ``what`` names the recipe field, for messages."""
    p = Path(path)
    if p.is_dir():
        raise JsonlDataError(f"{what}={str(path)!r} is a folder: give the JSONL or parquet file inside it")
    if not p.is_file():
        raise JsonlDataError(f"{what}={str(path)!r}: file does not exist")
    parquet = is_parquet(p)
    records = _parquet_records(p, what) if parquet else _jsonl_records(p)
    if not records:
        raise JsonlDataError(f"{what}={str(path)!r}: the file has no records")
    layout = fmt
    if fmt == "auto":
        layout = "verl" if "reward_model" in records[0][1] else "plain"
    needed = (prompt_field, *VERL_FIELDS) if layout == "verl" else (prompt_field, answer_field)
    needed += tuple(n for n in extra if n not in needed)
    if parquet:  # one schema: a missing column is the file's, not a row's
        _check_columns(p, layout, needed, records[0][1], fmt)
    rows, errors = [], {}
    for n, rec in records:
        try:
            rows.append(_row(p, parquet, n, rec, layout, needed, prompt_field, answer_field, fmt))
        except JsonlDataError as e:
            errors.setdefault(e.field, []).append(e)
    if errors:  # the field at fault in the earliest row, with how many rows it spoils
        first = next(iter(errors.values()))
        raise JsonlDataError(f"{first[0]} in {len(first)} of {len(records)} rows{_examples(first[1:])}")
    answer = "reward_model.ground_truth" if layout == "verl" else answer_field
    return _usable(
        rows, str(p), prompt_field, answer, [n for n in extra if n not in (prompt_field, answer_field)]
    )


def _where(p: Path, parquet: bool, n: int) -> str:
    return f"{p} row {n}" if parquet else f"{p}:{n}"


def _examples(errors: list) -> str:
    wheres = [str(e).split(": ", 1)[0] for e in errors[:3]]
    return f" (also {', '.join(wheres)}{', ...' if len(errors) > 3 else ''})" if wheres else ""


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _usable(rows: list[Row], path: str, prompt: str, answer: str, extra: list[str]) -> list[Row]:
    """The rows whose prompt, answer (and ``extra`` fields, e.g. the SFT response) hold a value. A field
    null or empty in every row is a refusal naming it; in some rows, a warning counting and naming
    them, and those rows are left out (a None answer would score every response 0)."""
    blank: dict[str, list[Row]] = {}
    for r in rows:
        if isinstance(r.prompt, str) and _blank(r.prompt):
            blank.setdefault(prompt, []).append(r)
        if _blank(r.ground_truth):
            blank.setdefault(answer, []).append(r)
        for name in extra:
            if _blank(r.record.get(name)):
                blank.setdefault(name, []).append(r)
    for name, bad in blank.items():
        shown = ", ".join(r.where.removeprefix(f"{path} ") for r in bad[:3])  # parquet: "row i"
        shown += ", ..." if len(bad) > 3 else ""
        if len(bad) == len(rows):
            raise JsonlDataError(
                f"{path}: field {name!r} is null or empty in all {len(rows)} rows ({shown}): no row has "
                f"an answer to score; fill it in, or point task.jsonl.*_field (or task.jsonl.format) at "
                "the field that holds it",
                name,
            )
        log.warning(
            "%s: %d of %d rows have no %r (null or empty; %s): left out of training and evaluation",
            path,
            len(bad),
            len(rows),
            name,
            shown,
        )
    spoiled = {id(r) for bad in blank.values() for r in bad}
    return [r for r in rows if id(r) not in spoiled]


def _fix(layout: str, fmt: str) -> str:
    if layout == "verl":
        other = "" if fmt == "verl" else " (found because the file has a reward_model field)"
        return (
            f"the verl layout{other} needs data_source, prompt and reward_model.ground_truth: fix the "
            "data, or set task.jsonl.format=plain"
        )
    return "fix the data or set task.jsonl.*_field to the right key"


def _check_columns(p: Path, layout: str, needed: tuple[str, ...], first: dict, fmt: str) -> None:
    for name in needed:
        if name not in first:
            raise JsonlDataError(
                f"{p}: missing column {name!r} (columns: {', '.join(first) or 'none'}); {_fix(layout, fmt)}"
            )


def _row(
    p: Path,
    parquet: bool,
    n: int,
    rec: Any,
    layout: str,
    needed: tuple[str, ...],
    prompt_field: str,
    answer_field: str,
    fmt: str,
) -> Row:
    where = _where(p, parquet, n)
    if not isinstance(rec, dict):
        raise JsonlDataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for name in needed:
        if name not in rec:
            keys = ", ".join(sorted(rec)) or "none"
            raise JsonlDataError(f"{where}: missing field {name!r} (keys: {keys}); {_fix(layout, fmt)}", name)
    extra_info = rec.get("extra_info")
    if layout == "verl":
        rm = rec["reward_model"]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise JsonlDataError(
                f"{where}: field 'reward_model' must be an object holding 'ground_truth', got {rm!r:.80}; "
                f"{_fix(layout, fmt)}",
                "reward_model",
            )
        ground_truth = rm["ground_truth"]
    else:
        ground_truth = rec[answer_field]
    if extra_info is not None and not isinstance(extra_info, dict):
        raise JsonlDataError(
            f"{where}: field 'extra_info' must be an object (a dict) or absent, got {extra_info!r:.80}",
            "extra_info",
        )
    source = rec.get("data_source")
    if source is not None and not isinstance(source, str):
        raise JsonlDataError(
            f"{where}: field 'data_source' must be a string, got {source!r:.80}", "data_source"
        )
    _check_prompt(rec[prompt_field], where, prompt_field)
    return Row(
        record=rec,
        path=str(p),
        line=n,
        where=where,
        layout=layout,
        prompt=rec[prompt_field],
        ground_truth=ground_truth,
        data_source=rec.get("data_source") or "",
        extra_info=extra_info or {},
    )


def _jsonl_records(p: Path) -> list[tuple[int, Any]]:
    out = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise JsonlDataError(
                    f"{p}:{lineno}: not UTF-8 text (byte {e.start} of the line): save the file as UTF-8"
                ) from e
            if line.strip():
                try:
                    out.append((lineno, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise JsonlDataError(f"{p}:{lineno}: not valid JSON ({e.msg})") from e
    return out


def _parquet_records(p: Path, what: str) -> list[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(
            f"{what}={str(p)!r} is a parquet file: reading it needs pyarrow: "
            "pip install pyarrow (or pip install 'moe-rl[data]')"
        ) from e
    try:
        table = pq.read_table(p)
    except Exception as e:  # ArrowInvalid, OSError, ...: all say the file is not usable
        msg = " ".join(str(e).split())
        raise JsonlDataError(
            f"{what}={str(p)!r}: not a readable parquet file ({type(e).__name__}: {msg[:200]}); write it "
            "with pyarrow.parquet.write_table or pandas DataFrame.to_parquet"
        ) from e
    return list(enumerate(table.to_pylist()))


# -- prompts -------------------------------------------------------------------------------------


def answer_text(value: object) -> str:
    """A reference answer as text: strings kept, anything else JSON-encoded."""
    return value if isinstance(value, str) else json.dumps(value)


def plain_chat(messages: list[dict]) -> str:
    """``role: content`` lines, then ``assistant:`` (the rendering without a chat template)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + PLAIN_ASSISTANT_CUE


def _bos_text(tokenizer: Any) -> str | None:
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str):
        return bos
    bos_id = getattr(tokenizer, "bos_id", None)
    return None if bos_id is None else tokenizer.decode([bos_id], skip_special_tokens=False)


def render_chat(messages: list[dict], tokenizer: Any = None) -> str:
    """The prompt text of chat ``messages``: the tokenizer's chat template with the generation
    prompt when the tokenizer has a template (``chat_template`` and ``apply_chat_template``), less
    a leading BOS text (the trainer adds the BOS id itself); else :func:`plain_chat`."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if not getattr(tokenizer, "chat_template", None) or not callable(apply):
        return plain_chat(messages)
    text = apply(messages, tokenize=False, add_generation_prompt=True)
    bos = _bos_text(tokenizer)
    return text[len(bos) :] if bos and text.startswith(bos) else text


def prompt_text(value: Any, where: str, field: str, tokenizer: Any = None) -> str:
    """The text of a prompt field's ``value``: a string as it is, chat messages rendered."""
    _check_prompt(value, where, field)
    if isinstance(value, str):
        return value
    try:
        return render_chat(value, tokenizer)
    except Exception as e:
        raise JsonlDataError(
            f"{where}: the tokenizer's chat template failed on field {field!r} ({type(e).__name__}: {e})",
            field,
        ) from e


def _check_prompt(value: Any, where: str, field: str) -> None:
    """A prompt field holds a string or a non-empty list of chat messages (JsonlDataError naming it)."""
    if isinstance(value, str):
        return
    bad = next(
        (
            i
            for i, m in enumerate(value if isinstance(value, list) else ())
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            )
        ),
        None,
    )
    if not isinstance(value, list) or not value or bad is not None:
        detail = "" if bad is None else f"; message {bad} is not an object with string role and content"
        raise JsonlDataError(
            f"{where}: field {field!r} must be a string, got {value!r:.80} (or a non-empty list of chat "
            f"messages [{{'role': 'user', 'content': '...'}}]{detail})",
            field,
        )
