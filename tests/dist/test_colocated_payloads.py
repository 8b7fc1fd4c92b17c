"""One bucket per engine GPU (issue 45): each engine rank reads a payload built on its own GPU.

A CUDA IPC handle opens only on a GPU its reader sees, and a colocated engine's
``CUDA_VISIBLE_DEVICES`` holds its own GPUs alone: engine i >= 1 could not open a bucket built on
trainer rank 0's GPU (SGLang's ``_device_from_maybe_uuid``: "Invalid device_uuid"). Eight gloo
ranks (one per GPU of one node of 8, or of two nodes of 4) push through the trainer's own
``RankedSGLangEngine`` and weight sync (built by ``factory._weight_sync`` on every rank); every
tensor a rank holds carries its rank in its values, so the decoded payload of each engine rank
says which trainer rank built it, and so on which GPU. For 8 engines of TP 1, 2 of TP 4, one of
TP 8, 2 across two nodes, and 2 on listed GPUs, engine i's TP rank j must read the bucket of the
trainer rank on its j-th GPU, in every bucket of the push.

Before the fix rank 0 built every payload: every engine rank read rank 0's GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
WORLD = 8
LAYOUTS = {  # name: (nodes, engines, tp, rollout.sglang.gpus, expected trainer rank of [engine][tp rank])
    "8 engines tp1": (1, 8, 1, None, [[r] for r in range(8)]),
    "2 engines tp4": (1, 2, 4, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "1 engine tp8": (1, 1, 8, None, [list(range(8))]),
    "2 nodes x 4, 2 engines tp4": (2, 2, 4, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "2 engines tp1 on gpus [2, 5]": (1, 2, 1, [2, 5], [[2], [5]]),
}
TENSORS = 5


class _Engine:
    """What a push asks of an engine; the payloads of each update call kept."""

    atomic_weight_updates, timeout_s, retries = True, 5.0, 0

    def __init__(self, i: int):
        self.base_url, self.version, self.calls = f"http://engine-{i}:1", "v0", []

    def pause_generation(self, mode="abort"):
        pass

    def continue_generation(self):
        pass

    def begin_weight_update(self, selector="all"):
        return True

    def end_weight_update(self, *, abort=False):
        pass

    def supports_weight_update_session(self):
        return True

    def update_weight_version(self, version, *, abort_all_requests=False):
        self.version = version

    def get_weight_version(self):
        return self.version

    def update_weights_from_tensor(self, payloads, **kw):
        self.calls.append(list(payloads))


class _Source:
    """Every rank's tensors: the same names and shapes, values rank * 100 + k."""

    def __init__(self, rank: int):
        self.rank = rank

    def hf_tensors(self):
        for k in range(TENSORS):
            yield f"model.layers.{k}.mlp.gate.weight", torch.full((2, 2), float(self.rank * 100 + k))


def _worker(rank: int, path_s: str) -> None:
    from moe_rl.config import recipe_from_dict
    from moe_rl.rollout import colocated, factory
    from moe_rl.rollout.sglang_engine import SGLangEngine
    from moe_rl.rollout.weight_sync.tensor import deserialize_bytes, unflatten_bucket

    path = Path(path_s)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{path}/store", rank=rank, world_size=WORLD
    )
    seen = {}
    for name, (nodes, n_engines, tp, gpus, _) in LAYOUTS.items():
        local = WORLD // nodes
        os.environ.update(
            LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local), GROUP_RANK=str(rank // local)
        )
        colocated.rank_gpu = lambda local=local: rank % local  # GPU LOCAL_RANK of its node (no CUDA here)
        over = ["rollout.engine=sglang", "rollout.sglang.colocate=true", "rollout.weight_sync=tensor"]
        over += [f"rollout.sglang.tp={tp}"] + ([f"rollout.sglang.gpus={gpus}"] if gpus else [])
        recipe = recipe_from_dict({}, over)
        engines = [_Engine(i) for i in range(n_engines)]
        sync = factory._weight_sync(recipe.rollout, path, engines)  # before the fix: rank 0's only
        sync.bucket_bytes = 32  # two tensors a bucket: three buckets
        inner = SGLangEngine(engines[0], engines=engines, weight_sync=sync, weight_version="v0")
        factory.RankedSGLangEngine(inner, rank).update_weights(_Source(rank), "v1")
        if rank == 0:
            seen[name] = [
                [
                    [int(unflatten_bucket(deserialize_bytes(p))[0][1][0, 0]) // 100 for p in call]
                    for call in e.calls
                ]
                for e in engines
            ]
    if rank == 0:
        (path / "seen.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


def test_each_engine_rank_reads_the_bucket_built_on_its_own_gpu(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    seen = json.loads((tmp_path / "seen.json").read_text())
    for name, (*_, expected) in LAYOUTS.items():
        calls = seen[name]
        assert [len(c) for c in calls] == [3] * len(expected), (name, calls)  # every engine, every bucket
        for i, want in enumerate(expected):
            assert all(call == want for call in calls[i]), f"{name}: engine {i} read {calls[i]}, want {want}"


# ---------------------------------------------------------------- colocated engines on every node
class _Launcher:
    """SGLangLauncher stand-in: a ``moe-rl serve`` echo server in this process, recording its GPUs."""

    fail = False

    def __init__(self, cfg, **kw):
        self.cfg, self.server = cfg, None

    def start(self):
        from moe_rl.rollout.sglang_launcher import SGLangLaunchError
        from moe_rl.serve.http import ServerThread
        from tests.unit.test_sglang_contract import _EchoEngine

        if _Launcher.fail:
            raise SGLangLaunchError("no GPU left")
        self.server = ServerThread(_EchoEngine(), weight_version="v0", enable_memory_saver=True)
        self.url = self.server.url

    def stop(self):
        if self.server is not None:
            self.server.stop()


class _Router(_Launcher):
    def __init__(self, urls, **kw):
        super().__init__(None)
        self.urls = urls

    def start(self):
        super().start()
        self.port = int(self.url.rsplit(":", 1)[1])


def _launch_worker(rank: int, path_s: str) -> None:
    from types import SimpleNamespace

    from moe_rl.config import recipe_from_dict
    from moe_rl.rollout import factory, sglang_launcher, sglang_router

    path = Path(path_s)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank)
    )
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=2)
    here = ("127.0.0.1", "127.0.0.1")  # both "nodes" are this machine: loopback is routable between them
    factory.own_address = lambda cfg, node, env=None: here
    factory.engine_address = lambda cfg, multi_node, env=None: here
    factory.check_reachable = lambda *a, **k: None
    sglang_launcher.SGLangLauncher, sglang_router.SGLangRouterLauncher = _Launcher, _Router
    factory.SGLangRouterLauncher = _Router  # imported by name at the factory's module level
    over = ["rollout.engine=sglang", "rollout.sglang.colocate=true", "rollout.weight_sync=tensor"]
    recipe = recipe_from_dict(
        {}, over + ["rollout.sglang.engines=2", "rollout.sglang.model_path=/m", "rollout.sglang.port=0"]
    )
    seen: dict = {}
    engine = factory.build_sglang_engine(
        recipe, policy=None, tokenizer=SimpleNamespace(pad_id=0, vocab_size=16), out=path, rank=rank
    )
    fleet = engine.inner.launcher
    seen["launched_here"] = [lc.url for lc in fleet.launchers] if fleet is not None else []
    seen["engines"] = [e.base_url for e in engine.inner.engines]
    seen["router"] = fleet.router.urls if fleet is not None and fleet.router is not None else None
    seen["versions"] = [e.get_weight_version() for e in engine.inner.engines]  # this rank reaches both
    torch.distributed.barrier()
    engine.close()
    _Launcher.fail = rank == 1  # node 1 cannot launch: every rank says so
    try:
        factory.build_sglang_engine(
            recipe, policy=None, tokenizer=SimpleNamespace(pad_id=0, vocab_size=16), out=path, rank=rank
        )
    except Exception as e:  # noqa: BLE001 - what each rank raised
        seen["failure"] = f"{type(e).__name__}: {e}"
    (path / f"launch-{rank}.json").write_text(json.dumps(seen))
    torch.distributed.destroy_process_group()


def test_colocated_engines_launch_on_every_node(tmp_path):
    """Two ranks as two nodes: each node's first rank launches that node's engine; every rank gets
    both URLs (node order) and reaches both; rank 0 starts the router over them; a launch that
    fails on node 1 fails on every rank, naming the node. Before: engines on rank 0's node only."""
    torch.multiprocessing.spawn(_launch_worker, args=(str(tmp_path),), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"launch-{r}.json").read_text()) for r in (0, 1)]
    urls = seen[0]["engines"]
    assert len(urls) == 2 and seen[1]["engines"] == urls
    assert seen[0]["launched_here"] == urls[:1] and seen[1]["launched_here"] == urls[1:]
    assert seen[0]["router"] == urls and seen[1]["router"] is None
    assert seen[0]["versions"] == seen[1]["versions"] == ["v0", "v0"]
    for s in seen:
        assert "node 1 could not launch its colocated SGLang engines: no GPU left" in s["failure"], s
