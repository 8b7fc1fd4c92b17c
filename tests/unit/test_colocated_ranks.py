"""Colocated ranks in step (issue 45): no engine holds memory while any rank's trainer state does.

Two gloo ranks each run the trainer's own ``Run.generate`` and ``Run.push_weights`` (a ``Run``
holding only what they read) over the project's ``RankedSGLangEngine`` on an SGLang client whose
engine answers in process (``httpx.MockTransport``): its release takes 0.3 s, and rank 1's trainer
state takes 0.9 s to reach the host and 0.9 s to come back (a slow host copy). Every memory call
and every use of the engine is logged with its start and end. In each phase:

1. the engines resume only after every rank's trainer state has left the GPU;
2. no rank uses the engines before they resumed;
3. the engines release only after every rank is done with them;
4. no rank takes its state back before the engines released.

Before the fix rank 0 resumed the engines as soon as its own state was out (rank 1 still copying),
and rank 1 reloaded its state while rank 0's release was still running.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # two processes (conftest.py: the fast tier starts none)
DELAY = {"release": 0.3, "resume": 0.1, "host_copy_rank1": 0.9}


def _log(path: Path, rank: int, what: str, t0: float, t1: float) -> None:
    with open(path / f"events-{rank}.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "what": what, "t0": t0, "t1": t1}) + "\n")


class _Trainer:
    """The optimizer's memory calls, slow on rank 1."""

    step_count = 3

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank

    def _copy(self, what: str) -> None:
        t0 = time.time()
        time.sleep(DELAY["host_copy_rank1"] if self.rank == 1 else 0.01)
        _log(self.path, self.rank, what, t0, time.time())

    def release_memory(self, *, weights: bool) -> int:
        self._copy("trainer_out")
        return 1

    def resume_memory(self) -> int:
        self._copy("trainer_in")
        return 1


class _Source:
    def hf_tensors(self):
        yield "model.norm.weight", torch.ones(4)


class _Sync:
    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank

    def push(self, source, version):
        t0 = time.time()
        list(source.hf_tensors())
        time.sleep(0.05)
        _log(self.path, self.rank, "use", t0, time.time())


def _worker(rank: int, path_s: str) -> None:
    import httpx

    from moe_rl.config import recipe_from_dict
    from moe_rl.rollout.factory import RankedSGLangEngine
    from moe_rl.rollout.sglang_client import SGLangClient
    from moe_rl.rollout.sglang_engine import SGLangEngine
    from moe_rl.rollout.types import SamplingParams
    from moe_rl.trainer.context import Run
    from tests.unit.test_sglang_contract import PINNED_GENERATE

    path = Path(path_s)
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=2)
    version = {"now": "3"}

    def handler(request: httpx.Request) -> httpx.Response:
        t0, route = time.time(), request.url.path
        if route.endswith("_memory_occupation"):
            time.sleep(DELAY["release" if "release" in route else "resume"])
            _log(path, rank, route.strip("/").split("_")[0], t0, time.time())
            return httpx.Response(200, json=None)
        if route == "/generate":
            body = json.loads(PINNED_GENERATE_TEXT)
            body["meta_info"]["weight_version"] = version["now"]
            time.sleep(0.05)
            _log(path, rank, "use", t0, time.time())
            return httpx.Response(200, json=body)
        return httpx.Response(200, json={"weight_version": version["now"]})

    PINNED_GENERATE_TEXT = json.dumps(PINNED_GENERATE[0])
    client = SGLangClient("http://engine:1", timeout_s=30, retries=0, transport=httpx.MockTransport(handler))
    inner = SGLangEngine(
        client, weight_version="3", colocated=True, weight_sync=_Sync(path, rank) if rank == 0 else None
    )
    recipe = recipe_from_dict(
        {}, ["rollout.engine=sglang", "rollout.sglang.colocate=true", "rollout.weight_sync=tensor"]
    )
    run = Run.__new__(Run)  # what Run.generate / Run.push_weights read, nothing else built
    run.recipe, run.optimizer = recipe, _Trainer(path, rank)
    run.engine = RankedSGLangEngine(inner, rank)
    run.info = dataclasses.make_dataclass("Info", ["device"])(torch.device("cpu"))
    run.weights_for_engine = _Source
    run.generate([[1, 2, 3, 4]], 1, SamplingParams(max_new_tokens=3))
    run.push_weights()
    run.generate([[1, 2, 3, 4]], 1, SamplingParams(max_new_tokens=3))
    torch.distributed.destroy_process_group()


def _phases(events: list[dict]) -> list[dict[str, list[dict]]]:
    """The events cut into engine phases: each from a trainer_out round to the trainer_in after it."""
    phases, cur = [], None
    for e in sorted(events, key=lambda e: e["t0"]):
        if e["what"] == "trainer_out" and (cur is None or cur.get("trainer_in")):
            cur = {}
            phases.append(cur)
        cur.setdefault(e["what"], []).append(e)
    return phases


def test_ranks_and_engines_take_turns_in_order(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    events = [
        json.loads(line) for r in (0, 1) for line in (tmp_path / f"events-{r}.jsonl").read_text().splitlines()
    ]
    phases = _phases(events)
    assert len(phases) == 3, [sorted(p) for p in phases]
    for i, p in enumerate(phases):
        out, use, back = p["trainer_out"], p["use"], p["trainer_in"]
        assert len(out) == len(back) == 2 and use, (i, p)
        resumes, releases = p.get("resume", []), p.get("release", [])
        assert releases, (i, p)
        engine_in = min(e["t0"] for e in resumes) if resumes else None
        if engine_in is not None:  # (the first rollout: the engines start holding everything)
            assert engine_in >= max(e["t1"] for e in out), (
                f"phase {i}: engines resumed before every rank's state left"
            )
            assert min(e["t0"] for e in use) >= max(e["t1"] for e in resumes), (
                f"phase {i}: used before resumed"
            )
        assert min(e["t0"] for e in releases) >= max(e["t1"] for e in use), (
            f"phase {i}: released while in use"
        )
        assert min(e["t0"] for e in back) >= max(e["t1"] for e in releases), (
            f"phase {i}: state back beside the engines'"
        )
