"""Colocated SGLang on a GPU (issue 45): the two checks of ``make gpu-check`` that need CUDA.

- ``ipc``: a colocated push's buckets (moe-rl's ``flatten_bucket`` on this GPU, serialized by
  ``serialize_ipc``: SGLang's ``MultiprocessingSerializer`` after its
  ``monkey_patch_torch_reductions``) are opened by an unrelated process (a fresh interpreter, not a
  child torch.multiprocessing made) with SGLang's own deserializer and its model runner's
  ``_update_weights_from_flattened_bucket``; every tensor must come back bit for bit, on the GPU.
  The same payload read by a process that sees no GPU fails (what an engine whose
  ``CUDA_VISIBLE_DEVICES`` lacks the bucket's GPU meets, and why each engine rank reads a bucket
  built on its own GPU). The writer runs in a process of its own too, so SGLang's modules (and
  the stubs for what their imports need) never enter the caller.
- ``offload``: ``HostOffload`` on CUDA storages (fp32 and bf16): ``torch.cuda.mem_get_info``
  before, while released and after resume over three cycles; the device bytes must be freed and
  taken back, the values bit-equal after each resume, the pinned host arena the same size every
  cycle.

``--dry-run`` runs both on CPU with tiny shapes (the buckets then go by the ``bytes`` serializer,
values, as CUDA IPC needs a GPU; the reader is the same process and SGLang code), with every
third-party module SGLang's imports could stub stubbed, installed or not (``import_sglang``'s
``stub_all``): the lent image lacks some that this machine has.

SGLang's code is its wheel's pure-Python files: ``.sglang/<version>`` (``make sglang-wheels``) or,
on the lent GPU, ``.whl/sglang/<version>``, where ``make gpu-wheels`` copies the files the reader
imports (:func:`export_sglang`, well under 1 MiB). Imported without the package ``__init__`` files
(they import the whole engine), third-party modules this interpreter lacks stubbed
(:data:`STUBBABLE`: none of them is used by the functions here).

    python -m tools.gpu_colocated [--dry-run]          # both checks, JSON on stdout
    python -m tools.gpu_colocated --export-sglang DIR  # the reader's SGLang files into DIR/<version>
"""

from __future__ import annotations
import __future__

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.5.23"
STUBBABLE = frozenset(
    "requests pynvml torchvision sgl_kernel triton PIL starlette orjson psutil numpy msgspec "
    "pydantic fastapi transformers zmq setproctitle uvloop aiohttp huggingface_hub einops uvicorn "
    "prometheus_client tqdm safetensors sentencepiece tiktoken IPython openai anthropic interegular "
    "outlines xgrammar partial_json_parser compressed_tensors torchao decord av cv2 soundfile scipy "
    "flashinfer jinja2 yaml numba ninja modelscope datasets llguidance blobfile hf_transfer".split()
)
RUNNER_FILES = (  # where each version's model runner keeps _update_weights_from_flattened_bucket
    "sglang/srt/model_executor/model_runner_components/weight_updater.py",  # 0.5.23
    "sglang/srt/model_executor/model_runner.py",  # 0.5.11
)


# -- SGLang's own code, from its wheel -----------------------------------------------------------------
def sglang_root(version: str = VERSION) -> Path | None:
    """Where SGLang ``version``'s pure-Python files are (module docstring), or None."""
    for root in (ROOT / ".whl" / "sglang" / version, ROOT / ".sglang" / version):
        if (root / "sglang" / "srt" / "weight_sync" / "tensor_bucket.py").is_file():
            return root
    return None


def import_sglang(root: str | Path, stub_all: bool = False) -> list[str]:
    """SGLang's serializer, patch and bucket modules from ``root``, skipping the package inits;
    returns the third-party modules stubbed because they are missing. ``stub_all``: every module of
    :data:`STUBBABLE` not imported yet (but numpy) is stubbed, installed or not, as on an image that
    has none of them (``--dry-run``: the lent image lacks some, msgspec among them)."""
    import importlib
    import importlib.abc
    import importlib.machinery
    import types

    stubbed: list[str] = []

    class _AnyBase:
        """A stubbed base class (``msgspec.Struct``, ``pydantic.BaseModel``): takes class keywords,
        and its instances their fields as keywords."""

        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__()

        def __init__(self, *args, **kwargs):
            self.__dict__.update(kwargs)

    class _Any:
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any()

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any()

        def __mro_entries__(self, bases):
            return (_AnyBase,)

        def __getitem__(self, key):
            return _Any()

        def __iter__(self):
            return iter(())

        def __bool__(self):
            return False

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any()

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def __init__(self, names: frozenset[str]):
            self.names = names

        def find_spec(self, name, path, target=None):
            top = name.split(".")[0]
            if top not in self.names or ("." in name and not isinstance(sys.modules.get(top), _Stub)):
                return None
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            stubbed.append(spec.name)
            m = _Stub(spec.name)
            m.__path__ = []
            return m

        def exec_module(self, module):
            pass

    root = str(root)
    sys.path.insert(0, root)
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = m
    sys.meta_path.append(_Finder(STUBBABLE))  # last: only what no real finder has
    if stub_all:  # first: before any real finder
        sys.meta_path.insert(0, _Finder(frozenset(n for n in STUBBABLE - {"numpy"} if n not in sys.modules)))
    importlib.import_module("sglang.srt.utils.common")
    importlib.import_module("sglang.srt.utils.patch_torch")
    importlib.import_module("sglang.srt.weight_sync.tensor_bucket")
    return stubbed


def sglang_function(root: str | Path, name: str):
    """SGLang's model-runner method ``name`` compiled from the wheel's own source."""
    from sglang.srt.weight_sync import tensor_bucket

    for rel in RUNNER_FILES:
        path = Path(root, rel)
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if fn is not None:
            flags = __future__.annotations.compiler_flag
            code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec", flags)
            ns = {
                "FlattenedTensorBucket": tensor_bucket.FlattenedTensorBucket,
                "FlattenedTensorMetadata": tensor_bucket.FlattenedTensorMetadata,
            }
            exec(code, ns)
            return ns[name]
    raise RuntimeError(f"no {name} in {RUNNER_FILES} under {root}")


def sglang_loader(root: str | Path):
    """SGLang's ``_update_weights_from_flattened_bucket`` on a model whose ``load_weights``
    records what it is given; returns bucket dict -> [(name, tensor)]."""
    import types

    method = sglang_function(root, "_update_weights_from_flattened_bucket")
    loaded: list = []
    model = types.SimpleNamespace(load_weights=loaded.extend)
    runner = types.SimpleNamespace(model=model, get_model=lambda: model)

    def load(bucket_dict) -> list:
        loaded.clear()
        ok, msg = method(runner, flattened_tensor_bucket_dict=bucket_dict)
        assert ok, msg
        return [(n, t.clone()) for n, t in loaded]

    return load


def export_sglang(dest: Path, versions: tuple[str, ...] = (VERSION,)) -> list[Path]:
    """Copy the files the reader imports (found by importing them in a fresh interpreter), the
    runner files and pybase64 of each unpacked version under ``.sglang`` into ``dest/<version>``."""
    done = []
    for version in versions:
        src = ROOT / ".sglang" / version
        code = (
            "import json, os, sys; from tools.gpu_colocated import import_sglang; "
            f"root = {str(src)!r}; import_sglang(root); "
            "print(json.dumps(sorted({os.path.relpath(m.__file__, root) for m in list(sys.modules.values()) "
            "if (getattr(m, '__file__', None) or '').startswith(root + os.sep)})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        )
        files = [f for f in json.loads(out.stdout.splitlines()[-1]) if not f.startswith("pybase64")]
        files += [f for f in RUNNER_FILES if (src / f).is_file()]
        target = dest / version
        shutil.rmtree(target, ignore_errors=True)
        for rel in files:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, target / rel)
        shutil.copytree(src / "pybase64", target / "pybase64", ignore=shutil.ignore_patterns("__pycache__"))
        done.append(target)
    return done


# -- ipc: buckets opened by an unrelated process ----------------------------------------------------------
def _named(dry: bool, device) -> list:
    """fp32 and bf16 tensors of odd shapes with values that compare only bit for bit (64 MiB a
    dtype on the GPU; a few KiB dry)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    rows = 16 if dry else 4096
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40], device=device)
    out = [("model.layers.0.input_layernorm.weight", special)]
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        for j, cols in enumerate((2048, 2047) if not dry else (8, 7)):
            t = torch.randn(rows, cols, generator=g, device=device).to(dtype)
            out.append((f"model.layers.{i}.mlp.experts.{j}.down_proj.weight", t))
    return out


def _bits(t) -> bytes:
    import torch

    return (
        t.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes()
    )  # a copy: numpy would pin t


def read_payloads(root: str, inp: str, out: str, stub_all: bool = False) -> None:
    """The reader (a fresh interpreter): as SGLang's TP worker, ``monkey_patch_torch_reductions``,
    then each payload through ``MultiprocessingSerializer.deserialize`` and the model runner's
    flattened-bucket loader; what came back (on the host, with the device it was on), or the error."""
    import torch

    import_sglang(root, stub_all)
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    load, res = sglang_loader(root), []
    for payload in json.loads(Path(inp).read_text()):
        try:
            named = load(MultiprocessingSerializer.deserialize(payload))
            res.append({"tensors": [(n, t.cpu(), str(t.device)) for n, t in named]})
        except Exception as e:  # noqa: BLE001 - recorded: the caller expects it where no GPU is seen
            res.append({"error": f"{type(e).__name__}: {e}"[:500]})
    torch.save(res, out)


def _read(root: Path, payloads: list[str], work: Path, visible: str | None, stub_all: bool) -> list[dict]:
    import torch

    inp, out = work / "payloads.json", work / "read.pt"
    inp.write_text(json.dumps(payloads))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    cmd = [sys.executable, "-m", "tools.gpu_colocated", "--read", str(root), str(inp), str(out)]
    cmd += ["--stub-all"] if stub_all else []
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    if r.returncode != 0:
        raise RuntimeError(f"the reader failed: {r.stderr[-2000:]}")
    return torch.load(out, weights_only=False)


def ipc_bucket(dry: bool) -> dict:
    """The writer (module docstring ``ipc``): build, serialize, have an unrelated process read."""
    import torch

    from moe_rl.rollout.weight_sync import tensor as T

    root = sglang_root()
    if root is None:
        raise RuntimeError("SGLang's files are not here: `make sglang-wheels` (or `make gpu-wheels`) first")
    t0 = time.perf_counter()
    import_sglang(root, stub_all=dry)
    T.sglang_parts.cache_clear()
    device = torch.device("cpu" if dry else "cuda")
    named = _named(dry, device)
    buckets = [T.flatten_bucket(b) for b, _ in T.dtype_buckets(iter(named), 1 << 30)]
    serialize = T.serialize_bytes if dry else lambda b: T.serialize_ipc(b, 1)[0]
    payloads = [serialize(b) for b in buckets]
    with tempfile.TemporaryDirectory() as work:
        got = _read(root, payloads, Path(work), None, dry)
        hidden = None if dry else _read(root, payloads[:1], Path(work), "", dry)
    want = {n: _bits(t) for n, t in named}
    seen = {n: (_bits(t), dev) for r in got for n, t, dev in r.get("tensors", [])}
    errors = [r["error"] for r in got if "error" in r]
    res = {
        "sglang": str(root.relative_to(ROOT)),
        "serializer": "bytes (dry run)" if dry else "ipc",
        "bytes": sum(b["flattened_tensor"].numel() for b in buckets),
        "buckets": len(buckets),
        "tensors": len(named),
        "errors": errors,
        "bit_equal": not errors and sorted(seen) == sorted(want) and all(seen[n][0] == want[n] for n in want),
        "reader_devices": sorted({dev for _, dev in seen.values()}),
        "no_gpu_reader_error": None if hidden is None else hidden[0].get("error"),
        "seconds": time.perf_counter() - t0,
    }
    res["ok"] = res["bit_equal"] and (
        dry or (res["reader_devices"] == ["cuda:0"] and bool(res["no_gpu_reader_error"]))
    )
    return res


def check_ipc(dry: bool) -> dict:
    """:func:`ipc_bucket` in a process of its own (SGLang's modules stay out of the caller)."""
    cmd = [sys.executable, "-m", "tools.gpu_colocated", "--ipc"] + (["--dry-run"] if dry else [])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"the ipc check failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


# -- offload: HostOffload on CUDA storages ------------------------------------------------------------
def host_offload(dry: bool, cycles: int = 3) -> dict:
    """The trainer's offload on this GPU (module docstring ``offload``)."""
    import torch

    from moe_rl.megatron.offload import HostOffload

    cuda = not dry
    device = torch.device("cuda" if cuda else "cpu")
    n = 16 << 10 if dry else 64 << 20  # elements per tensor: 4 x 256 MiB fp32 + bf16 on the GPU
    g = torch.Generator(device=device).manual_seed(1)
    tensors = [torch.randn(n, generator=g, device=device).to(d) for d in (torch.float32, torch.bfloat16) * 2]
    want = [_bits(t) for t in tensors]
    size = sum(t.numel() * t.element_size() for t in tensors)
    if cuda:
        torch.cuda.empty_cache()  # the casts' fp32 temporaries out of the baseline

    def free() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    off, rows = HostOffload(), []
    for _ in range(cycles):
        before = free()
        t0 = time.perf_counter()
        released = off.release(tensors)
        t1 = time.perf_counter()
        during = free()
        taken = off.resume()
        t2 = time.perf_counter()
        rows.append(
            {
                "released": released,
                "taken": taken,
                "freed": during - before,
                "after_minus_before": free() - before,
                "release_s": t1 - t0,
                "resume_s": t2 - t1,
                "arena_bytes": off.host_bytes,
                "pinned": bool(off._arena is not None and off._arena.is_pinned()),
                "bit_equal": [_bits(t) for t in tensors] == want,
            }
        )
    slack = 64 << 20
    ok = (
        all(r["released"] == r["taken"] == size and r["bit_equal"] for r in rows)
        and len({r["arena_bytes"] for r in rows}) == 1
        and (
            dry
            or all(
                r["freed"] >= size - slack and abs(r["after_minus_before"]) <= slack and r["pinned"]
                for r in rows
            )
        )
    )
    return {
        "bytes": size,
        "cycles": rows,
        "ok": ok,
        "gbps_to_host": size / max(rows[-1]["release_s"], 1e-9) / 1e9,
    }


def section_colocated(ck, cap: float) -> dict:
    """``make gpu-check``'s ``colocated`` section: both checks (``ck.dry``: on CPU, tiny)."""
    from tools.gpu_check import CheckFailed, need_cuda

    need_cuda(ck)
    out = {"ipc": check_ipc(ck.dry), "offload": host_offload(ck.dry)}
    if not (out["ipc"]["ok"] and out["offload"]["ok"]):
        raise CheckFailed("colocated: a bucket or an offload did not come back bit for bit", out)
    return out


def colocated_headline(c: dict) -> dict:
    """The section's numbers for ``make gpu-check``'s headline."""
    ipc, off = c.get("ipc", {}), c.get("offload", {})
    cycles = off.get("cycles") or [{}]
    return {
        "ipc_ok": ipc.get("ok"),
        "ipc_bytes": ipc.get("bytes"),
        "ipc_reader_devices": ipc.get("reader_devices"),
        "no_gpu_reader_error": ipc.get("no_gpu_reader_error"),
        "offload_ok": off.get("ok"),
        "offload_bytes": off.get("bytes"),
        "offload_freed": [r.get("freed") for r in cycles],
        "offload_gbps_to_host": off.get("gbps_to_host"),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--ipc", action="store_true", help="the ipc check alone, in this process (the writer)")
    ap.add_argument("--read", nargs=3, metavar=("ROOT", "IN", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--stub-all", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--export-sglang", type=Path, metavar="DIR", help="copy the reader's SGLang files to DIR")
    args = ap.parse_args(argv)
    if args.read:
        read_payloads(*args.read, stub_all=args.stub_all)
    elif args.export_sglang:
        print("\n".join(str(p) for p in export_sglang(args.export_sglang)))
    elif args.ipc:
        print(json.dumps(ipc_bucket(args.dry_run), default=str))
    else:
        print(json.dumps({"ipc": check_ipc(args.dry_run), "offload": host_offload(args.dry_run)}, indent=1))


if __name__ == "__main__":  # one line for a user error, a file error or a stop signal
    from moe_rl.argparsing import run_main

    raise SystemExit(run_main(main))
