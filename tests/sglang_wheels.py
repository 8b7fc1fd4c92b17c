"""SGLang's own files, read from the released wheels (no CUDA, no install): helpers of test_sglang_wheels.

- :func:`wheel` downloads ``sglang==<v>`` with ``pip download --no-deps`` into ``.cache/sglang-wheels``
  (or ``$MOE_RL_WHEEL_CACHE``) once (``make sglang-wheels`` fetches the tested ones first); the test
  skips only when PyPI cannot be reached. :func:`cached_wheel` reads a fetched one and never downloads.
- :func:`route_table` reads ``sglang/srt/entrypoints/http_server.py`` with ``ast``: every
  ``@app.get/post/put/api_route`` path with its methods, request class, auth level, and whether
  it is deprecated (docstring or warning says so) or removed (raises a 404 that says so).
- :func:`struct_fields` reads the request classes of ``sglang/srt/managers/io_struct.py`` (dataclasses
  in 0.5.11, msgspec Structs in 0.5.23) with their inherited fields.
- :func:`load_api_types` imports ``sglang/api/v1/api_types.py`` by path (it needs only msgspec);
  None where the wheel has no such file (0.5.11).
- :func:`openai_models` builds SGLang's own pydantic response models of the OpenAI endpoints from
  ``sglang/srt/entrypoints/openai/protocol.py``: the module itself imports ``openai`` and ``zmq``
  (through ``sglang/__init__``), which the dev environment lacks, so only the class definitions
  the named models need are executed, as written, with pydantic.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
SERVER_ARGS = "sglang/srt/server_args.py"
OPENAI_PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"
WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_RL_WHEEL_CACHE") or REPO / ".cache" / "sglang-wheels")


def cached_wheel(version: str) -> zipfile.ZipFile | None:
    """The sglang wheel of ``version`` if it was fetched already (``make sglang-wheels`` fetches the
    tested ones), else None: what the fast tier reads, which starts no download."""
    found = sorted(cache_dir().glob(f"sglang-{version}-*.whl"))
    return zipfile.ZipFile(found[-1]) if found else None


def wheel(version: str) -> zipfile.ZipFile:
    """The sglang wheel of ``version`` (downloaded once, ~7-40 MB); skips only if PyPI is unreachable."""
    if (cached := cached_wheel(version)) is not None:
        return cached
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"sglang=={version}", "-d", str(cache)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not found:
        text = out.stdout + out.stderr
        if any(
            s in text for s in ("Network is unreachable", "Temporary failure", "connection", "Connection")
        ):
            pytest.skip(f"PyPI unreachable, cannot fetch sglang=={version}: {text.strip()[-300:]}")
        raise RuntimeError(f"pip download sglang=={version} failed: {text.strip()[-2000:]}")
    return zipfile.ZipFile(found[-1])


def read(whl: zipfile.ZipFile, member: str) -> str | None:
    """A file of the wheel as text, or None where this version has no such file."""
    try:
        return whl.read(member).decode("utf-8")
    except KeyError:
        return None


@dataclass
class Route:
    """One endpoint of http_server.py."""

    path: str
    methods: set[str]
    handler: str
    request_class: str | None = None
    auth: str | None = None
    deprecated: bool = False
    removed: bool = False
    messages: list[str] = field(default_factory=list)


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _strings(node: ast.AST) -> list[str]:
    """Every string constant (and f-string piece) under ``node``."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _request_class(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> str | None:
    """``obj: X`` or ``obj: Annotated[X, Body()]`` of the handler."""
    for arg in fn.args.args:
        if arg.arg != "obj" or arg.annotation is None:
            continue
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.slice, ast.Tuple):
            ann = ann.slice.elts[0]
        if isinstance(ann, ast.Name):
            return ann.id
    return None


def route_table(src: str) -> dict[str, Route]:
    """path -> Route for every FastAPI decorator of http_server.py (paths built from env vars are skipped)."""
    table: dict[str, Route] = {}
    for fn in ast.walk(ast.parse(src)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, auth = [], None
        for dec in fn.decorator_list:
            if not isinstance(dec, ast.Call) or not isinstance(dec.func, ast.Attribute):
                continue
            if isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app" and dec.args:
                path = _const_str(dec.args[0])
                kind = dec.func.attr
                methods = {kind.upper()} if kind in ("get", "post", "put", "delete") else set()
                for kw in dec.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, (ast.List, ast.Tuple)):
                        methods = {_const_str(e) for e in kw.value.elts}
                if path is not None:
                    paths.append((path, methods))
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id == "auth_level":
                arg = dec.args[0] if dec.args else None
                auth = arg.attr if isinstance(arg, ast.Attribute) else None
        if not paths:
            continue
        doc = (ast.get_docstring(fn) or "").lower()
        body_strings = [s for stmt in fn.body for s in _strings(stmt)]
        deprecated = "deprecated" in doc or any("deprecated" in s.lower() for s in body_strings)
        removed = any(
            isinstance(n, ast.Raise)
            and any("deprecated" in s.lower() for s in _strings(n))
            and any(isinstance(k, ast.keyword) and k.arg == "status_code" for k in ast.walk(n))
            for n in ast.walk(fn)
        )
        for path, methods in paths:
            table[path] = Route(
                path, methods, fn.name, _request_class(fn), auth, deprecated, removed, body_strings
            )
    return table


def struct_fields(src: str) -> dict[str, set[str]]:
    """class name -> its field names (annotated class attributes, bases of the same file included)."""
    classes = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.ClassDef)}

    def own(cls: ast.ClassDef) -> set[str]:
        return {
            s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }

    def all_fields(name: str, seen: frozenset = frozenset()) -> set[str]:
        cls = classes[name]
        out = own(cls)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in seen:
                out |= all_fields(base.id, seen | {name})
        return out

    return {name: all_fields(name) for name in classes}


def init_params(src: str, class_name: str) -> set[str]:
    """What ``class_name(...)`` accepts: its ``__init__`` parameters (SamplingParams in 0.5.11) or,
    without an ``__init__``, its fields (a msgspec Struct in 0.5.23)."""
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    return {a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs}
            return struct_fields(src)[class_name]
    raise KeyError(class_name)


def load_api_types(whl: zipfile.ZipFile, tmp: Path, version: str) -> ModuleType | None:
    """``sglang/api/v1/api_types.py`` imported by path, or None where the wheel lacks it."""
    src = read(whl, API_TYPES)
    if src is None:
        return None
    path = tmp / f"sglang_api_types_{version.replace('.', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # msgspec resolves the Structs' annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def openai_models(src: str, names: list[str]) -> dict[str, type]:
    """The pydantic classes ``names`` of SGLang's ``openai/protocol.py`` source, with the classes and
    module-level names they reference (transitively), executed as written; name -> class."""
    import __future__

    tree = ast.parse(src)
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
    need: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in need or name not in defs:
            continue
        need.add(name)
        for n in ast.walk(defs[name]):
            if isinstance(n, ast.Name):
                stack.append(n.id)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):  # forward references
                stack.append(n.value)
    body = [n for n in tree.body if any(n is defs[name] for name in need)]
    ns: dict = {"__name__": "sglang_openai_protocol"}
    exec(
        "import time, uuid\nfrom typing import *\nfrom typing_extensions import Literal\nfrom pydantic import *\n",
        ns,
    )
    code = compile(
        ast.Module(body=body, type_ignores=[]),
        OPENAI_PROTOCOL,
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, ns)
    for name in names:
        ns[name].model_rebuild(_types_namespace=ns)
    return {name: ns[name] for name in names}
