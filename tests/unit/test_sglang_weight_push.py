"""Contract: every colocated push moe-rl builds decodes with SGLang's own code, 0.5.11 and 0.5.23.

The payloads are built by moe-rl (``TensorWeightSync.push``, its ``flatten_bucket`` and
serializers) and read in a subprocess per SGLang version by that version's own functions, from
its wheel unpacked without dependencies into ``.sglang/<version>`` (``make sglang-wheels``):
``MultiprocessingSerializer.deserialize`` of the rank's own payload after
``monkey_patch_torch_reductions()`` (as ``tp_worker``), then the model runner's
``_update_weights_from_flattened_bucket`` (its source compiled out of the wheel, with a model
whose ``load_weights`` records what it is given), which builds SGLang's
``FlattenedTensorMetadata`` from the metadata's attributes and calls
``FlattenedTensorBucket.reconstruct_tensors``. Every named tensor must come back bit for bit.

Importing SGLang's modules: the package ``__init__`` files of ``sglang``, ``sglang.srt`` and
``sglang.srt.utils`` are skipped (they import the whole engine); ``sglang.srt.utils.common``,
``sglang.srt.utils.patch_torch`` and ``sglang.srt.weight_sync.tensor_bucket`` are imported as they
are, and third-party modules missing here (``STUBBABLE``: ``requests``, ``pynvml``, ``torchvision``,
``sgl_kernel``, ...; which ones is printed) are empty stubs: none of them is used by the functions
under test, which need only pickle, ``pybase64`` (installed next to the wheel) and torch (the
loader, :mod:`tools.gpu_colocated`, is the one ``make gpu-check`` uses).
CUDA IPC itself needs a GPU: here the ``ipc`` layout is checked with CPU tensors in one process;
``make gpu-check`` opens an IPC bucket from an unrelated process (tools/gpu_colocated.py).
"""

from __future__ import annotations

import base64
import inspect
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.rollout.weight_sync import tensor as T
from tools.gpu_colocated import import_sglang, sglang_loader

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".sglang"
VERSIONS = ("0.5.11", "0.5.23")
SGLANG_META = "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata"


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    """HF-like names, three float dtypes, odd sizes, a 0-d tensor, a non-contiguous one, and
    values that compare only bit for bit (NaN, -0.0, inf)."""
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, 3.0])
    return [
        ("model.embed_tokens.weight", torch.randn(5, 4, generator=g)),
        ("model.layers.0.self_attn.o_proj.weight", torch.randn(4, 6, generator=g).t()),
        ("model.layers.0.input_layernorm.weight", special),
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.tensor(0.25)),
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(3, 7, generator=g).bfloat16()),
        ("model.layers.0.mlp.experts.3.up_proj.weight", torch.randn(7, 3, generator=g).bfloat16()),
        ("model.norm.weight", torch.randn(7, generator=g).half()),
    ]


class _Source:
    """An ``HFStateSource`` without the ``device`` keyword (moved by ``source_tensors``)."""

    def __init__(self, named):
        self.named = named

    def hf_tensors(self):
        yield from self.named


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def capture_push(
    monkeypatch, serializer: str, tp_sizes: list[int], bucket_bytes: int = 64
) -> list[list[list[str]]]:
    """The ``serialized_named_tensors`` of every update call of one push, per bucket, per engine."""
    calls: list[list[list[str]]] = []

    class Client:
        def update_weights_from_tensor(
            self, payloads, *, load_format, flush_cache, weight_version, timeout_s
        ):
            assert load_format == "flattened_bucket"
            calls[-1].append(list(payloads))

    def drive(method, clients, version, buckets, send):
        for bucket, last in buckets:
            calls.append([])
            send(bucket, last)

    monkeypatch.setattr(T, "push_buckets", drive)
    sync = T.TensorWeightSync([Client() for _ in tp_sizes], tp_sizes=tp_sizes, serializer=serializer)
    sync.bucket_bytes = bucket_bytes
    sync.push(_Source(named_tensors()), "v1")
    return calls


def megatron_load_from_bytes(b: bytes):
    """megatron-core 0.19's ``safe_load_from_bytes``, which its import puts in place of
    ``torch.storage._load_from_bytes`` (``megatron/core/__init__.py``): the same bytes read
    ``weights_only``, from a module of its own, so a storage pickled after it names that module."""
    return torch.load(io.BytesIO(b), weights_only=True)


@pytest.fixture
def megatron_storage_loader(monkeypatch):
    """The trainer's process as megatron-core 0.19 leaves it (0.16 swaps nothing)."""
    monkeypatch.setattr(torch.storage, "_load_from_bytes", megatron_load_from_bytes)


def run_sglang(version: str, job: dict, tmp_path: Path) -> dict:
    """Run this file as a script against ``.sglang/<version>``; returns what it decoded."""
    root = WHEELS / version
    if not (root / "sglang" / "srt" / "weight_sync" / "tensor_bucket.py").is_file():
        pytest.skip(f"SGLang {version}'s code is not in {root}: run `make sglang-wheels` (needs PyPI)")
    inp, out = tmp_path / f"in-{version}.pt", tmp_path / f"out-{version}.pt"
    torch.save(job, inp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, __file__, str(root), str(inp), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(r.stdout[-4000:], r.stderr[-4000:], sep="\n")
    assert r.returncode == 0, f"SGLang {version} subprocess failed:\n{r.stderr[-4000:]}"
    return torch.load(out, weights_only=True)


def assert_every_rank_got_every_tensor(decoded: list[list[list[list]]], tp_sizes: list[int]) -> None:
    """decoded[bucket][engine][rank] = [(name, tensor), ...] -> each rank of each engine holds all."""
    expected = dict(named_tensors())
    for e, tp in enumerate(tp_sizes):
        for r in range(tp):
            got = [pair for bucket in decoded for pair in bucket[e][r]]
            names = [n for n, _ in got]
            assert sorted(names) == sorted(expected), (e, r, names)
            for name, t in got:
                assert bitwise_equal(t, expected[name]), (e, r, name, t, expected[name])


# ----------------------------------------------------------------- SGLang's own decoding
@pytest.mark.integration
@pytest.mark.parametrize("version", VERSIONS)
def test_bytes_push_decodes_with_sglangs_own_code(version, monkeypatch, tmp_path, megatron_storage_loader):
    """The ``bytes`` payloads of a push from a trainer without sglang, 2 engines (TP 2 and 1),
    several buckets: SGLang's deserializer + flattened-bucket loader rebuild every tensor on
    every rank; and the same push built with SGLang importable (its FlattenedTensorBucket). The
    trainer runs megatron-core 0.19's storage loader: SGLang's ``SafeUnpickler`` admits only
    ``torch.storage._load_from_bytes``."""
    tp_sizes = [2, 1]
    calls = capture_push(monkeypatch, "bytes", tp_sizes)
    assert len(calls) > 2 and all(len(c) == 2 and [len(p) for p in c] == tp_sizes for c in calls)
    res = run_sglang(version, {"calls": calls, "tp_sizes": tp_sizes}, tmp_path)
    print(f"SGLang {version}: stubbed {res['stubbed']}")
    assert_every_rank_got_every_tensor(res["decoded"], tp_sizes)
    assert set(res["meta_types"]) <= {
        "types.SimpleNamespace",
        SGLANG_META,
    }  # the latter where sglang is installed
    # built in the subprocess, where sglang is importable: SGLang's own bucket and metadata
    assert_every_rank_got_every_tensor(res["built_with_sglang"], tp_sizes)
    assert set(res["built_meta_types"]) == {SGLANG_META}
    assert_every_rank_got_every_tensor(res["built_with_sglang_read_by_serve"], tp_sizes)


@pytest.mark.integration
@pytest.mark.parametrize("version", VERSIONS)
def test_ipc_layout_and_reductions_against_sglang(version, tmp_path):
    """``flatten_bucket`` with and without SGLang, through SGLang's MultiprocessingSerializer
    (ForkingPickler; CPU tensors in one process) and its loader; ``serialize_ipc`` refuses CPU
    buckets; the torch-reductions patch is SGLang's inside the block and undone after it."""
    res = run_sglang(version, {"ipc": True}, tmp_path)
    for key in ("ipc_fallback_bucket", "ipc_sglang_bucket"):
        assert_every_rank_got_every_tensor(res[key], [1])
    assert "use serializer='bytes'" in res["ipc_cpu_refused"]
    assert res["patched_inside"] and res["restored_after"], res


# ----------------------------------------------------------------- moe-rl's side
@pytest.mark.parametrize("megatron", ["0.16", "0.19"])
def test_bytes_payloads_decode_in_moe_rl_serve_and_keep_tensors_exact(monkeypatch, megatron, request):
    """Whichever storage loader megatron-core left in torch (0.19 puts its own in), the payload
    names torch's, which ``moe-rl serve`` (and SGLang) admit, and every tensor comes back."""
    if megatron == "0.19":
        request.getfixturevalue("megatron_storage_loader")
    calls = capture_push(monkeypatch, "bytes", [1])
    for raw in (base64.b64decode(c[0][0]) for c in calls):
        assert b"torch.storage" in raw and b"megatron_load" not in raw
    got = [pair for c in calls for pair in T.unflatten_bucket(T.deserialize_bytes(c[0][0]))]
    expected = dict(named_tensors())
    assert sorted(n for n, _ in got) == sorted(expected)
    assert all(bitwise_equal(t, expected[n]) for n, t in got)


def test_one_ipc_serialization_per_engine_rank(monkeypatch):
    """CUDA IPC counts references per serialization: every rank of every engine gets its own."""
    made: list[int] = []

    def fake_ipc(bucket, copies=None):  # copies=None: the old one-payload call
        out = [f"payload-{len(made) + i}" for i in range(copies or 1)]
        made.extend(out)
        return out[0] if copies is None else out

    monkeypatch.setitem(T.SERIALIZERS, "ipc", fake_ipc)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    tp_sizes = [2, 3]
    calls: list[list[list[str]]] = []

    class Client:
        def update_weights_from_tensor(self, payloads, **kw):
            calls[-1].append(payloads)

    def drive(method, clients, version, buckets, send):
        for bucket, last in buckets:
            calls.append([])
            send(bucket, last)

    monkeypatch.setattr(T, "push_buckets", drive)
    on_cpu = {"device": "cpu"} if "device" in inspect.signature(T.TensorWeightSync).parameters else {}
    sync = T.TensorWeightSync([Client(), Client()], tp_sizes=tp_sizes, serializer="ipc", **on_cpu)
    sync.push(_Source(named_tensors()), "v")
    for c in calls:
        assert [len(p) for p in c] == tp_sizes
        assert all(isinstance(p, str) for engine in c for p in engine)
        flat = [p for engine in c for p in engine]
        assert len(set(flat)) == len(flat) == sum(tp_sizes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_ipc_without_a_gpu_is_refused_up_front():
    with pytest.raises(ValueError, match="needs a GPU"):
        T.TensorWeightSync([object()], serializer="ipc")


def test_buckets_are_sglangs_byte_layout_on_the_tensors_device():
    named = named_tensors()[:2]
    b = T.flatten_bucket(named)
    flat, meta = b["flattened_tensor"], b["metadata"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == (20 + 24) * 4
    assert [(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel) for m in meta] == [
        (named[0][0], torch.Size([5, 4]), torch.float32, 0, 80, 80),
        (named[1][0], torch.Size([6, 4]), torch.float32, 80, 176, 96),
    ]
    with pytest.raises(ValueError, match="one dtype per bucket"):
        T.flatten_bucket([("a", torch.ones(1, dtype=torch.bfloat16)), ("b", torch.ones(1))])
    bad = {"flattened_tensor": flat, "metadata": [{"name": "x"}]}
    with pytest.raises(ValueError, match="not a FlattenedTensorMetadata"):
        T.unflatten_bucket(bad)


def test_source_tensors_asks_policy_sources_for_the_device():
    seen = {}

    class DeviceSource:
        def hf_tensors(self, *, device="cpu"):
            seen["device"] = device
            yield "w", torch.ones(2)

    assert [n for n, _ in T.source_tensors(DeviceSource(), torch.device("cpu"))] == ["w"]
    assert seen["device"] == torch.device("cpu")
    assert [n for n, _ in T.source_tensors(_Source([("v", torch.ones(1))]), torch.device("cpu"))] == ["v"]


def test_policy_source_leaves_tensors_on_the_asked_device(parallel_info, tiny_model_cfg):
    """``PolicyHFSource.hf_tensors(device=...)``: CPU copies by default; elsewhere no CPU copy
    (``meta`` stands for a GPU here), same names and shapes; a colocated push asks for it."""
    from moe_rl.config import ParallelConfig
    from moe_rl.megatron.hf import PolicyHFSource
    from moe_rl.megatron.policy import build_policy

    source = PolicyHFSource(build_policy(tiny_model_cfg, ParallelConfig(), parallel_info))
    cpu = list(source.hf_tensors())
    params = {p.data_ptr() for p in source.policy.model.parameters()}
    assert all(t.device.type == "cpu" and t.data_ptr() not in params for _, t in cpu)
    meta = list(T.source_tensors(source, torch.device("meta")))
    assert [(n, t.shape) for n, t in meta] == [(n, t.shape) for n, t in cpu]
    assert {t.device.type for _, t in meta} == {"meta"}


def test_serve_decoder_runs_no_code():
    import pickle

    evil = base64.b64encode(pickle.dumps({"flattened_tensor": print, "metadata": []})).decode()
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        T.deserialize_bytes(evil)


# ----------------------------------------------------------------- the subprocess (one SGLang version)
def _subprocess_main(root: str, inp: str, out: str) -> None:
    stubbed = import_sglang(root)
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    load = sglang_loader(root)
    job = torch.load(inp, weights_only=True)
    res: dict = {"stubbed": sorted(set(stubbed))}

    def tp_worker(payloads: list[str], rank: int) -> tuple[list, list[str]]:
        # tp_worker.update_weights_from_tensor / deserialize_own_rank, then the model runner
        data = MultiprocessingSerializer.deserialize(payloads[rank])
        return load(data), [f"{type(m).__module__}.{type(m).__qualname__}" for m in data["metadata"]]

    def decode(calls) -> tuple[list, set[str]]:
        decoded, kinds = [], set()
        for engines in calls:
            decoded.append([])
            for payloads in engines:
                decoded[-1].append([])
                for rank in range(len(payloads)):
                    got, types_ = tp_worker(payloads, rank)
                    decoded[-1][-1].append(got)
                    kinds.update(types_)
        return decoded, kinds

    if "calls" in job:
        monkey_patch_torch_reductions()  # as SGLang's tp_worker does before deserializing
        res["decoded"], kinds = decode(job["calls"])
        res["meta_types"] = sorted(kinds)
        T.sglang_parts.cache_clear()
        assert T.sglang_parts() is not None, "sglang should be importable in this subprocess"
        import pytest as _pytest

        mp = _pytest.MonkeyPatch()
        calls = capture_push(mp, "bytes", job["tp_sizes"])
        mp.undo()
        res["built_with_sglang"], kinds = decode(calls)
        res["built_meta_types"] = sorted(kinds)
        res["built_with_sglang_read_by_serve"] = [
            [[T.unflatten_bucket(T.deserialize_bytes(p)) for p in engine] for engine in c] for c in calls
        ]
    if job.get("ipc"):
        buckets = [b for b, _ in T.dtype_buckets(named_tensors(), 1 << 20)]  # one dtype each, as a push

        def through_forking_pickler(bucket) -> list:  # CPU tensors: file descriptors, same process only
            payload = MultiprocessingSerializer.serialize(bucket, output_str=True)
            return [[load(MultiprocessingSerializer.deserialize(payload))]]

        real = getattr(T, "sglang_parts", None)
        T.sglang_parts = lambda: None  # as in a trainer without sglang
        res["ipc_fallback_bucket"] = [through_forking_pickler(T.flatten_bucket(b)) for b in buckets]
        T.sglang_parts = real
        real.cache_clear()
        res["ipc_sglang_bucket"] = [through_forking_pickler(T.flatten_bucket(b)) for b in buckets]
        try:
            T.serialize_ipc(T.flatten_bucket(buckets[0]), 2)
            res["ipc_cpu_refused"] = ""
        except ValueError as e:
            res["ipc_cpu_refused"] = str(e)
        from sglang.srt.utils import patch_torch

        parts = T.sglang_parts()
        with T.torch_reductions_patched(parts):
            res["patched_inside"] = reductions.reduce_tensor is patch_torch._reduce_tensor_modified
        res["restored_after"] = not hasattr(reductions, "_reduce_tensor_original") and (
            reductions.reduce_tensor is not patch_torch._reduce_tensor_modified
        )
        MultiprocessingSerializer.serialize({"t": torch.ones(1)})  # CPU tensors pickle again (no IndexError)
    torch.save(res, out)
    print(json.dumps({"stubbed": res["stubbed"]}))


if __name__ == "__main__":
    _subprocess_main(*sys.argv[1:4])
