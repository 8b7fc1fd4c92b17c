"""The machinery under every configuration dataclass: errors, type checks, YAML loading.

Section dataclasses (``moe_rl.config``, ``moe_rl.tasks.config``) are frozen and keyword-only.
A choice field is annotated ``Literal[...]`` or with a ``str`` :class:`enum.Enum` (whose members
the recipe writes as their values, and the field holds as members): :func:`_check_type` refuses
any other value and names the allowed ones, both when a recipe is built (:func:`build_dataclass`) and when a
section is constructed in code (:func:`check_choices`, called first in ``__post_init__``).
A section may declare ``moved_keys: ClassVar[dict[str, str]]`` (old field -> new dotted
path) so a recipe or override that still uses an old key is told the new one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from moe_rl.errors import UserError


class ConfigError(UserError):
    """A recipe or override is wrong; the message names the field and the fix."""

    kind = "configuration error"


def require(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)


def one_of(choices: typing.Iterable[Any]) -> str:
    """``a, b or c``: the allowed values of a choice, for error messages."""
    names = [str(c) for c in choices]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def require_registered(value: str, registry: typing.Collection[str], where: str) -> None:
    """Refuse a name missing from a registry (``LOSSES``, ``TASKS``), listing the valid names."""
    require(value in registry, f"{where}={value!r} is unknown: use one of {', '.join(sorted(registry))}")


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def _is_choice(tp: Any) -> bool:
    """Whether annotation ``tp`` contains a ``Literal`` or an Enum (directly, in a union or a tuple)."""
    if typing.get_origin(tp) is Literal or _is_enum(tp):
        return True
    return any(_is_choice(a) for a in typing.get_args(tp))


@functools.cache
def _choice_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if _is_choice(hints[f.name]))


def _is_float(tp: Any) -> bool:
    return tp is float or float in typing.get_args(tp)


@functools.cache
def _float_fields(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if _is_float(hints[f.name]))


def require_finite(value: Any, where: str) -> None:
    """Refuse an infinite or NaN number (``.inf``, ``nan``) and a subnormal one (``5e-324``, below
    the smallest normal double: a learning rate, a temperature or an epsilon no computation can
    use): no field of a recipe means one."""
    require(
        not isinstance(value, float) or math.isfinite(value),
        f"{where}={value} is not a finite number: give a finite value",
    )
    require(
        not isinstance(value, float) or value == 0 or abs(value) >= sys.float_info.min,
        f"{where}={value} is below the smallest normal number ({sys.float_info.min:.3g}): give 0 or a "
        "value a computation can use",
    )


INT_RANGE = (-(2**63), 2**63 - 1)
"Every integer field is a 64-bit integer (torch's and the checkpoints' integers)."


def require_text(value: Any, where: str) -> None:
    """Refuse an empty or blank string (``""``, ``" "``): no text field of a recipe means one (a
    path, a key, a name); an optional one is null instead."""
    require(
        not isinstance(value, str) or bool(value.strip()),
        f"{where}={value!r} is empty: give a value (or null where the field is optional)",
    )


@functools.cache
def _text_fields(cls: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(cls)

    def text(tp: Any) -> bool:
        return tp is str or any(text(a) for a in typing.get_args(tp) if typing.get_origin(tp) is not Literal)

    return tuple(f.name for f in dataclasses.fields(cls) if text(hints[f.name]))


def check_choices(obj: Any, section: str) -> None:
    """The rules of every field's type, for dataclass ``obj`` (called first in ``__post_init__``):
    a ``Literal`` holds one of its values, an Enum field one of its members (a value given as text
    becomes the member) and a float is finite and normal; errors name ``section.field``.
    :func:`check_text` (called last) refuses blank strings."""
    for name, tp in _choice_fields(type(obj)):
        value = _check_type(getattr(obj, name), tp, f"{section}.{name}")
        object.__setattr__(obj, name, value)  # frozen: the parsed member in place of its text
    for name in _float_fields(type(obj)):
        require_finite(getattr(obj, name), f"{section}.{name}")


def check_text(obj: Any, section: str) -> None:
    """No string field of dataclass ``obj`` (alone or in a list) is empty or blank; called last in
    ``__post_init__``, after the checks whose messages say more about a field (``train.out_dir``)."""
    for name in _text_fields(type(obj)):
        value = getattr(obj, name)
        for i, v in enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]:
            require_text(v, f"{section}.{name}" + ("" if i is None else f"[{i}]"))


def require_positive(obj: Any, section: str, *names: str, strict: bool = True) -> None:
    """Each field ``names`` of ``obj`` (unless None) is > 0 (``strict``) or >= 0."""
    for name in names:
        v = getattr(obj, name)
        if v is not None:
            ok, bound = (v > 0, "> 0") if strict else (v >= 0, ">= 0")
            require(ok, f"{section}.{name}={v} must be {bound}")


SEED_MAX = 2**32 - 1
"The largest seed (numpy's and most samplers' limit; torch's generators take it too)."


def require_seed(obj: Any, section: str, name: str) -> None:
    """Seed field ``name`` of ``obj`` is a whole number in ``[0, SEED_MAX]``."""
    require_in(obj, section, name, 0, SEED_MAX, f"[0, {SEED_MAX}]")


def require_in(obj: Any, section: str, name: str, low: float, high: float, interval: str) -> None:
    """Field ``name`` of ``obj`` lies in ``interval`` ("[0, 1)", "(0, 1]", ...) from ``low`` to ``high``."""
    v = getattr(obj, name)
    if v is None:
        return
    ok_low = v >= low if interval[0] == "[" else v > low
    ok_high = v <= high if interval[-1] == "]" else v < high
    require(ok_low and ok_high, f"{section}.{name}={v} must be in {interval}")


def _check_union(value: Any, tp: Any, where: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return _check_type(value, a, where)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")


def _check_scalar(value: Any, tp: type, where: str) -> Any:
    if tp is bool:
        require(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        require(
            isinstance(value, int) and not isinstance(value, bool),
            f"{where} must be an integer, got {value!r}",
        )
        require(
            INT_RANGE[0] <= value <= INT_RANGE[1],
            f"{where}={value} is outside the 64-bit integer range: give a smaller value",
        )
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 3e-4 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        require(
            isinstance(value, (int, float)) and not isinstance(value, bool),
            f"{where} must be a number, got {value!r}",
        )
        require_finite(float(value), where)
        return float(value)
    if tp is str:
        require(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Return ``value`` coerced to annotation ``tp`` or raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        require(value in allowed, f"{where}={value!r}: use {one_of(allowed)}")
        return value
    if _is_enum(tp):
        values = [m.value for m in tp]
        require(value in values, f"{where}={value!r}: use {one_of(values)}")
        return tp(value)
    if origin in (typing.Union, types.UnionType):
        return _check_union(value, tp, where)
    if origin in (list, tuple):
        require(isinstance(value, (list, tuple)), f"{where} must be a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return origin(_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        require(isinstance(value, dict), f"{where} must be a mapping of fields, got {value!r}")
        return build_dataclass(tp, value, where)
    return _check_scalar(value, tp, where)


def check_type(value: Any, tp: Any, where: str) -> Any:
    """``value`` coerced to annotation ``tp`` (as a recipe field of that type holds it), or
    ConfigError naming ``where``."""
    return _check_type(value, tp, where)


def build_dataclass(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown or moved keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    moved = getattr(cls, "moved_keys", {})
    stale = sorted(set(data) & set(moved))
    if stale:
        raise ConfigError("; ".join(f"{prefix}{k} moved: use {prefix}{moved[k]}" for k in stale))
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + u for u in unknown)}; "
            f"valid keys of {where or 'the recipe'}: {', '.join(sorted(names))}"
        )
    kwargs = {k: _check_type(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - kw_only dataclasses report missing fields here
        raise ConfigError(f"{where or 'recipe'}: {e}") from e


# ---------------------------------------------------------------------------------------
# YAML: overrides, includes.


def set_path(data: dict, dotted: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``dotted = "a.b.c"``, creating sections on the way."""
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        nxt = cur.setdefault(k, {})
        require(isinstance(nxt, dict), f"override {dotted}: {k} is not a section")
        cur = nxt
    cur[keys[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Parse ``key.sub=value`` strings; values are YAML scalars (``1e-4``, ``true``, ``null``)."""
    out = []
    for o in overrides:
        require("=" in o, f"override {o!r} must look like section.field=value")
        k, v = o.split("=", 1)
        require(bool(k.strip()), f"override {o!r} has an empty key")
        try:
            value = _load_yaml(v, f"override {o!r}, line") if v != "" else None
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or "not a YAML value"
            raise ConfigError(
                f"override {o!r}: {problem}; quote the value if it is text, e.g. {k.strip()}='\"...\"'"
            ) from e
        out.append((k.strip(), value))
    return out


def deep_merge(base: dict, top: dict) -> dict:
    """``base`` with ``top`` merged in; mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key repeated in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden key by key
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{key_node.start_mark.name}:{line}: key {key!r} repeated (first at line {seen[key]}): "
                    "keep one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, name: str) -> Any:
    """``text`` parsed by :class:`_UniqueKeyLoader`; marks (line:column) carry ``name``."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _yaml_where(e: yaml.YAMLError, path: Path) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return str(path)
    return f"{path}:{mark.line + 1}:{mark.column + 1}"


def load_yaml_file(path: str | Path, what: str = "recipe") -> Any:
    """A YAML file's content; a missing file, a folder, non-UTF-8 bytes, a syntax error or a repeated
    key raise ConfigError naming the file (and line:column)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist: check the path")
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder: give the YAML file inside it")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: {what} is not UTF-8 text (byte {e.start}): save it as UTF-8"
        ) from e
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror or e}") from e
    try:
        return _load_yaml(text, str(path))
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{_yaml_where(e, path)}: YAML syntax error: {problem}") from e


def read_yaml_with_includes(path: str | Path, paths: tuple[str, ...] = (), _seen: tuple = ()) -> dict:
    """A YAML mapping, with ``include: other.yaml`` (relative to the file) deep-merged under it.

    ``paths``: the dotted keys holding input files (:data:`moe_rl.config.RECIPE_PATHS`); a relative
    one is made absolute against the folder of the file that writes it (:func:`resolve_paths`), so
    a recipe reads the files beside it from any working directory."""
    path = Path(path)
    require(path.resolve() not in _seen, f"recipe include cycle through {path}")
    data = load_yaml_file(path)
    require(
        bool(data) or data == [],
        f"recipe {path} is empty: write at least one section (e.g. train:, model:), or copy recipes/tiny.yaml",
    )
    require(isinstance(data, dict), f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    inc = data.pop("include", None)
    data = resolve_paths(data, path.parent, paths)
    if inc is not None:
        require(isinstance(inc, str) and bool(inc), f"{path}: include must be a file name, got {inc!r}")
        base = read_yaml_with_includes(path.parent / inc, paths, (*_seen, path.resolve()))
        data = deep_merge(base, data)
    return data


KEEP_AS_WRITTEN = ("char",)
"Values of a path key that name no file (``model.tokenizer: char``)."


def resolve_path(value: str, folder: str | Path) -> str:
    """``value`` (a path, or ``path/to/file.py:function``) made absolute against ``folder``: an
    absolute path, a ``module:function`` and :data:`KEEP_AS_WRITTEN` stay as they are."""
    head, sep, tail = value.rpartition(":")
    if sep and not head.endswith(".py"):  # module:function, or a Windows drive: not a file to resolve
        return value
    file = head if sep else value
    if value in KEEP_AS_WRITTEN or not file or os.path.isabs(os.path.expanduser(file)):
        return value
    return os.path.abspath(os.path.join(folder, file)) + (sep + tail if sep else "")


def resolve_paths(data: dict, folder: str | Path, paths: tuple[str, ...]) -> dict:
    """``data`` (one recipe file's mapping) with each string at a dotted key of ``paths`` resolved
    against ``folder`` (:func:`resolve_path`); other values, and blank strings (refused by the
    field's own check, naming it), are left to the type checks."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for dotted in paths:
        *sections, last = dotted.split(".")
        node = out
        for k in sections:
            if not isinstance(node.get(k), dict):
                node = None
                break
            node[k] = dict(node[k])
            node = node[k]
        if node is not None and isinstance(node.get(last), str) and node[last].strip():
            node[last] = resolve_path(node[last], folder)
    return out


def dataclass_from_dict(cls: type, data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Build ``cls`` (e.g. the Recipe) from a parsed YAML mapping plus ``section.field=value`` overrides."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (data or {}).items()}
    for k, v in parse_overrides(overrides):
        set_path(data, k, v)
    return build_dataclass(cls, data)


def to_dict(obj: Any) -> Any:
    """A recipe (or any config dataclass) as plain YAML-able data (an Enum member as its value)."""
    return dataclasses.asdict(obj, dict_factory=lambda items: {k: _plain(v) for k, v in items})


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value
