"""Several SGLang-protocol engines behind the real ``sglang-router`` (PyPI, a Rust binary run on CPU).

- What the router does to our traffic, pinned: it balances per-sample /generate across engines,
  drops ``return_routed_experts`` from the body it forwards, and answers /abort_request with 404.
- RL steps: 2 ``moe-rl serve`` processes (the tiny MoE of test_sglang_e2e) behind the router;
  rollouts with R3 routes (sent straight to the engines, least in-flight) and without (through the
  router); weight pushes over one gloo group with per-engine rank offsets; every row's version,
  log-probs and routes checked against the trainer's weights; versions checked per engine.
- Stragglers at the step deadline are aborted and come back as partial rows.
- The trainer itself (``moe_rl.trainer.run``) with ``rollout.sglang.engines: 2``: the factory
  launches both engines and the router, and RL with R3 runs through them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.sglang_router import SGLangRouterLauncher
from moe_rl.rollout.types import SamplingParams
from moe_rl.rollout.weight_sync import DistributedWeightSync
from moe_rl.serve.http import ServerThread
from tests.integration.test_sglang_e2e import DictSource, E, K, L, _check_matches, _launcher, init_weights
from tests.unit.test_sglang_contract import _EchoEngine

pytestmark = pytest.mark.dist


@pytest.fixture
def echo_fleet(tmp_path):
    workers = [
        ServerThread(_EchoEngine(), weight_version="v0", enable_return_routed_experts=True) for _ in range(2)
    ]
    router = SGLangRouterLauncher(
        [w.url for w in workers], policy="round_robin", log_path=tmp_path / "router.log"
    )
    try:
        yield workers, router.start()
    finally:
        router.stop()
        for w in workers:
            w.stop()


LEFT_RUNNING = """
import sys
from moe_rl.rollout.sglang_router import SGLangRouterLauncher
from moe_rl.serve.http import ServerThread
from tests.unit.test_sglang_contract import _EchoEngine

worker = ServerThread(_EchoEngine(), weight_version="v0")
router = SGLangRouterLauncher([worker.url], log_path=sys.argv[1])
router.start()
print(router.proc.pid, flush=True)
try:
    raise RuntimeError("a step failed")  # the router is never stopped by the code
finally:
    worker.stop()
"""


def test_a_router_left_running_ends_with_the_process_that_launched_it(tmp_path):
    """A trainer that ends on an exception before it stops its router (a failed step, a bug in a
    caller) left the router serving on its port, orphaned in its own session (seen after a failing
    test: a ``sglang::router`` of PPID 1 an hour later); the launcher now stops it as the process
    ends. The same holds for the SGLang servers' launcher (same code path)."""
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", LEFT_RUNNING, str(tmp_path / "router.log")],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=120,
    )
    pid = int(res.stdout.split()[0])
    try:
        assert res.returncode == 1 and "a step failed" in res.stderr, res.stderr[-2000:]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the router's process is gone (stopped and reaped by its launcher)
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)  # the old code's orphan: never left behind by the test
        except (ProcessLookupError, PermissionError):
            pass


def test_what_the_router_does_to_our_requests(echo_fleet):
    workers, router = echo_fleet
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    direct = SGLangClient(workers[0].url).request("POST", "/generate", body)
    assert "routed_experts" in direct["meta_info"]
    via_router = router.request("POST", "/generate", body)
    assert "routed_experts" not in via_router["meta_info"]  # the router dropped return_routed_experts
    with pytest.raises(Exception, match="404"):
        router.abort_request("x")  # not forwarded: the engine aborts on each engine itself
    engine = SGLangEngine(
        router, engines=[SGLangClient(w.url) for w in workers], num_layers=2, topk=2, num_experts=8
    )
    before = [w.app.served for w in workers]
    ro = engine.generate([[1, 2], [3]], 4, SamplingParams(max_new_tokens=3))  # through the router
    assert ro.tokens_BT[:4, 2:5].tolist() == [[3, 3, 3]] * 4 and ro.weight_version == "v0"
    spread = [w.app.served - b for w, b in zip(workers, before)]
    assert sum(spread) == 8 and min(spread) > 0, spread  # per-sample requests, on both engines
    ro = engine.generate([[1, 2]], 4, SamplingParams(max_new_tokens=3, return_routes=True))  # straight
    assert ro.routes_BTLK is not None and ro.routes_BTLK[:, :4].sum() > 0
    assert min(w.app.served - b - s for w, b, s in zip(workers, before, spread)) > 0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    servers = [_launcher(tmp, f"engine{i}", routes=True) for i in range(2)]
    router = None
    try:
        for s in servers:
            s.start()
        router = SGLangRouterLauncher([s.url for s in servers], log_path=tmp / "router.log")
        yield servers, router.start()
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop(grace_s=10)


def test_rl_steps_through_the_router_with_two_engines(fleet):
    servers, router = fleet
    engines = [SGLangClient(s.url, timeout_s=30, retries=1) for s in servers]
    sync = DistributedWeightSync(engines, backend="gloo", bucket_bytes=4096, timeout_s=60)
    assert (sync.rank_offsets, sync.world_size, sync.master_address) == ([1, 2], 3, "127.0.0.1")
    engine = SGLangEngine(router, engines=engines, num_layers=L, topk=K, num_experts=E, weight_sync=sync)
    w = init_weights(0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    try:
        for step in range(3):
            sp = SamplingParams(max_new_tokens=5, temperature=1.0, seed=100 * step, return_routes=True)
            ro = engine.generate(prompts, 4, sp)  # R3: every row's routes and log-probs checked
            assert ro.batch_size == 12 and ro.weight_version == engine.weight_version
            _check_matches(ro, w, 1.0)
            plain = engine.generate(prompts, 2, SamplingParams(max_new_tokens=4, temperature=0.0))
            assert plain.routes_BTLK is None and plain.num_response_tokens > 0
            g = torch.Generator().manual_seed(step)
            w = {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in w.items()}
            engine.update_weights(DictSource(w), f"step-{step}")
            assert [e.get_weight_version() for e in engines] == [f"step-{step}"] * 2  # per engine
            assert engine.last_push.num_tensors == len(w) and engine.last_push.session
        ro = engine.generate(
            prompts, 2, SamplingParams(max_new_tokens=5, temperature=0.0, return_routes=True)
        )
        _check_matches(ro, w, 0.0)  # the last push reached both engines
    finally:
        sync.close()


def test_stragglers_are_aborted_at_the_step_deadline(tmp_path):
    slow = _launcher(tmp_path, "slow", routes=False, TINY_MOE_DELAY_S="0.3")
    slow.start()
    try:
        client = SGLangClient(slow.url, timeout_s=30, retries=0)
        engine = SGLangEngine(client, num_layers=L, topk=K, num_experts=E, step_deadline_s=0.8)
        t0 = time.monotonic()
        ro = engine.generate(
            [[1, 2, 3]], 3, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
        )
        assert ro.extras["aborted"] == 3 and ro.finish_reasons == ["abort"] * 3
        assert (ro.response_mask_BT.sum(-1) > 0).all()  # kept with what they generated
        # not left hanging (the rows run ~7 s in all; under a loaded CI machine up to ~20 s)
        assert time.monotonic() - t0 < 60
        assert client.health_generate()  # the engine is not left paused or stuck
    finally:
        slow.stop(grace_s=10)


def test_trainer_runs_rl_with_two_engines_behind_a_launched_router(tmp_path, parallel_info):
    from moe_rl.config import recipe_from_dict
    from moe_rl.trainer.metrics import read_metrics
    from moe_rl.trainer.run import run
    from tests.tiny import TINY_E2E as TINY

    data = {k: dict(v) for k, v in TINY.items()}
    data["train"].update(stages=["rl"], rl_steps=2, out_dir=str(tmp_path / "run"))
    data["algo"] = {"name": "grpo", "routing": "r3"}
    data["rollout"] = {
        "engine": "sglang",
        "weight_sync": "distributed",
        "sglang": {"module": "moe_rl.serve.embedded", "port": 0, "engines": 2, "startup_timeout_s": 180.0},
    }
    run(recipe_from_dict(data))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "rl")
    assert len(rows) == 2
    for r in rows:  # each step samples, on both engines, with the weights pushed after the last one
        assert r["mismatch/abs_log_ratio"] < 1e-5, r["mismatch/abs_log_ratio"]
        assert r["flip/rollout_vs_trainer/rate"] == 0.0
        assert r["time/sync"] > 0
    logs = tmp_path / "run" / "logs"
    assert (logs / "sglang-0.log").exists() and (logs / "sglang-1.log").exists()
    assert (logs / "sglang-router.log").exists()
