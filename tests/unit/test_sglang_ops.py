"""How moe-rl operates SGLang: placement, version range, rendezvous address, auth, the update
session as current SGLang enforces it, aborts, and the colocated (memory saver) cycle.

Servers here are ``moe-rl serve`` (FastAPI + uvicorn) in a thread around a tiny echo engine.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from moe_rl.config import ConfigError, recipe_from_dict
from moe_rl.rollout import factory
from moe_rl.rollout.sglang_client import SGLangClient
from moe_rl.rollout.sglang_engine import SGLangEngine
from moe_rl.rollout.sglang_launcher import (
    SGLangLauncher,
    SGLangServerConfig,
    build_command,
    check_disjoint,
    plan_gpus,
)
from moe_rl.rollout.sglang_protocol import SGLangBadRequest, SGLangError, SGLangHTTPError, SGLangVersionError
from moe_rl.rollout.types import SamplingParams
from moe_rl.rollout.weight_sync import (
    DiskWeightSync,
    RendezvousAddressError,
    TensorWeightSync,
    trainer_address,
)
from moe_rl.rollout.weight_sync.tensor import (
    deserialize_bytes,
    dtype_buckets,
    flatten_bucket,
    serialize_bytes,
    unflatten_bucket,
)
from moe_rl.serve.http import ServerThread
from tests.unit.test_sglang_contract import _EchoEngine


class _Source:
    def __init__(self, named):
        self.named = named

    def hf_tensors(self):
        yield from self.named.items()


@pytest.fixture
def server():
    s = ServerThread(
        _EchoEngine(), weight_version="v0", enable_return_routed_experts=True, enable_memory_saver=True
    )
    yield s
    s.stop()


# ---------------------------------------------------------------- placement and launch
def test_gpu_placement_per_engine():
    assert plan_gpus([4, 5, 6, 7], 2, 2) == [(4, 5), (6, 7)]
    with pytest.raises(ValueError, match="need 4 GPUs, got 3"):
        plan_gpus([4, 5, 6], 2, 2)
    with pytest.raises(ValueError, match="twice"):
        plan_gpus([4, 4], 2, 1)
    with pytest.raises(ValueError, match=r"overlaps the trainer's GPUs \[0, 1\] at \[1\]"):
        check_disjoint([1, 2], [0, 1])
    cfg = SGLangServerConfig(
        model_path="/m", tp_size=2, gpu_ids=(6, 7), enable_memory_saver=True, admin_api_key="k"
    )
    assert cfg.env() == {"CUDA_VISIBLE_DEVICES": "6,7"}
    cmd = build_command(cfg, 30000)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "0" and "--enable-memory-saver" in cmd
    assert cmd[cmd.index("--admin-api-key") + 1] == "k"
    with pytest.raises(ValueError, match="exactly tp_size=2"):
        SGLangServerConfig(model_path="/m", tp_size=2, gpu_ids=(6,))


def test_engines_never_land_on_the_trainers_gpus():
    r = recipe_from_dict({}, ["rollout.sglang.engines=2", "rollout.sglang.tp=2"]).rollout.sglang
    with pytest.raises(ConfigError, match=r"rollout.sglang.gpus is not set.*\[0, 1\]"):
        factory.engine_gpus(r, 2, trainer=[0, 1])
    r = recipe_from_dict({}, ["rollout.sglang.gpus=[2,3,4,5]", "rollout.sglang.tp=2"]).rollout.sglang
    assert factory.engine_gpus(r, 2, trainer=[0, 1]) == [(2, 3), (4, 5)]
    r = recipe_from_dict({}, ["rollout.sglang.gpus=[1,2]"]).rollout.sglang
    with pytest.raises(ConfigError, match="overlaps"):
        factory.engine_gpus(r, 2, trainer=[0, 1])
    colocated = ["rollout.sglang.colocate=true", "rollout.weight_sync=tensor", "rollout.sglang.tp=2"]
    r = recipe_from_dict({}, colocated).rollout.sglang
    assert factory.engine_gpus(r, 1, trainer=[0, 1]) == [(0, 1)]  # colocated: the trainer's own
    assert factory.engine_gpus(r, 1, trainer=[]) == [None]  # CPU: nothing to place
    env = {"CUDA_VISIBLE_DEVICES": "3,5,6", "LOCAL_WORLD_SIZE": "2"}
    if torch.cuda.is_available():
        assert factory.trainer_gpus(env) == [3, 5]
    else:
        assert factory.trainer_gpus(env) == []
    with pytest.raises(ConfigError, match="tensor.*colocate"):
        recipe_from_dict({}, ["rollout.weight_sync=tensor"])
    # one GPU cannot hold two ranks of one NCCL group: colocated engines take tensor (or disk) pushes
    with pytest.raises(
        ConfigError, match=r"colocate=true with rollout.weight_sync=distributed.*Duplicate GPU"
    ):
        recipe_from_dict({}, ["rollout.sglang.colocate=true"])


def test_launcher_refuses_sglang_outside_the_range(monkeypatch, tmp_path):
    from moe_rl.rollout import sglang_launcher

    cfg = SGLangServerConfig(model_path="/m")  # module sglang.launch_server
    for installed, match in (
        ("0.5.4", r"sglang 0\.5\.4 is installed.*>=0\.5\.11,<0\.6"),
        (None, "not installed"),
    ):
        monkeypatch.setattr(sglang_launcher, "installed_sglang_version", lambda python, v=installed: v)
        launcher = SGLangLauncher(cfg, log_path=tmp_path / "x.log")
        with pytest.raises(SGLangVersionError, match=match):
            launcher.start()
        assert launcher.proc is None  # refused before anything was started


# ---------------------------------------------------------------- rendezvous address
def test_rendezvous_address_is_never_loopback_for_a_remote_server():
    assert trainer_address(["127.0.0.1", "localhost"], env={}) == "127.0.0.1"
    assert trainer_address(["10.1.2.3"], configured="10.1.2.9", env={}) == "10.1.2.9"
    assert trainer_address(["10.1.2.3"], env={"MOE_RL_TRAINER_ADDR": "10.1.2.8"}) == "10.1.2.8"
    for bad in ({"configured": "127.0.0.1", "env": {}}, {"env": {"MOE_RL_TRAINER_ADDR": "localhost"}}):
        with pytest.raises(RendezvousAddressError, match="loopback.*another host"):
            trainer_address(["10.1.2.3"], **bad)


def test_addresses_are_ipv6_safe():
    from moe_rl.rollout.weight_sync.address import host_port, tcp_url

    assert tcp_url("fd00::7", 29500) == "tcp://[fd00::7]:29500"
    assert tcp_url("[fd00::7]", 1) == "tcp://[fd00::7]:1" and tcp_url("10.0.0.2", 1) == "tcp://10.0.0.2:1"
    assert host_port("node-3", 80) == "node-3:80"
    launcher = SGLangLauncher(SGLangServerConfig(model_path="/m", host="::1", port=30000), log_path=None)
    assert launcher.url == "http://[::1]:30000"
    assert SGLangClient(launcher.url).base_url == "http://[::1]:30000"


def test_nccl_interface_is_pinned_before_the_first_communicator(monkeypatch):
    """NCCL reads NCCL_SOCKET_IFNAME once per process, at its first communicator: setting it around
    the weight-update group's creation (as before) did nothing. It is set before the trainer's
    process groups start, and left alone where the user set it or every engine is local."""
    from moe_rl.rollout.weight_sync import address

    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(address, "interface_of", lambda addr: {"10.0.0.2": "ens7"}.get(addr))
    recipe = recipe_from_dict(
        {},
        [
            "rollout.engine=sglang",
            "rollout.sglang.url=http://10.0.0.5:30000",
            "rollout.sglang.trainer_address=10.0.0.2",
        ],
    )
    assert factory.pin_nccl_for_engines(recipe, nccl=False) is None and "NCCL_SOCKET_IFNAME" not in os.environ
    assert factory.pin_nccl_for_engines(recipe, nccl=True) == "ens7"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ens7"
    with address.bound_to("10.0.0.2", "nccl"):  # the group's creation changes nothing
        assert os.environ["NCCL_SOCKET_IFNAME"] == "ens7"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ens7"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's choice stands
    assert (
        factory.pin_nccl_for_engines(recipe, nccl=True) is None and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    )
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    local = recipe_from_dict({}, ["rollout.engine=sglang"])  # launched on this node: loopback
    assert factory.pin_nccl_for_engines(local, nccl=True) is None and "NCCL_SOCKET_IFNAME" not in os.environ


def test_run_pins_nccl_before_its_process_groups(monkeypatch, tmp_path):
    from moe_rl.megatron import parallel
    from moe_rl.trainer import run as run_mod

    order = []
    monkeypatch.setattr(factory, "pin_nccl_for_engines", lambda recipe, nccl: order.append("pin"))

    def init_parallel(*a, **k):
        order.append("init_parallel")
        raise RuntimeError("stop here")

    monkeypatch.setattr(parallel, "init_parallel", init_parallel)
    recipe = recipe_from_dict({"train": {"out_dir": str(tmp_path)}}, ["rollout.engine=sglang"])
    with pytest.raises(RuntimeError, match="stop here"):
        run_mod.Run(recipe)
    assert order == ["pin", "init_parallel"]


# ---------------------------------------------------------------- auth
def test_api_keys_follow_sglang():
    s = ServerThread(_EchoEngine(), api_key="user", admin_api_key="admin")
    try:
        anon = SGLangClient(s.url, timeout_s=5, retries=0)
        assert anon.health()  # /health* is open
        with pytest.raises(SGLangHTTPError) as e:
            anon.model_info()
        assert e.value.status == 401
        user = SGLangClient(s.url, timeout_s=5, retries=0, api_key="user")
        assert user.get_weight_version() == "default"
        with pytest.raises(SGLangHTTPError, match="401"):
            user.update_weight_version("x")  # admin endpoint: the admin key only
        admin = SGLangClient(s.url, timeout_s=5, retries=0, api_key="admin")
        admin.update_weight_version("x")
        assert user.get_weight_version() == "x"
    finally:
        s.stop()


# ---------------------------------------------------------------- session, pushes, aborts
def test_update_session_misuse_fails_as_in_sglang(server):
    c = SGLangClient(server.url, timeout_s=5, retries=0)
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g"}
    with pytest.raises(
        SGLangBadRequest, match=r"must run between begin_weight_update\(\) and end_weight_update\(\)"
    ):
        c.request("POST", "/update_weights_from_distributed", body)
    payload = serialize_bytes(flatten_bucket([("w", torch.ones(2))]))
    with pytest.raises(SGLangBadRequest, match="update_weights_from_tensor must run between"):
        c.update_weights_from_tensor([payload])
    with pytest.raises(SGLangBadRequest, match="no weight-update session is open"):
        c.end_weight_update()
    assert c.begin_weight_update()
    with pytest.raises(SGLangBadRequest, match="already open"):
        c.request("POST", "/begin_weight_update", {})
    c.end_weight_update()


def test_disk_pushes_run_without_a_session(server, tmp_path):
    c = SGLangClient(server.url, timeout_s=5, retries=0)
    seen = []
    original = server.app.handle
    server.app.handle = lambda m, p, b: (seen.append(p), original(m, p, b))[1]
    sync = DiskWeightSync([c], tmp_path)
    report = sync.push(_Source({"w": torch.tensor([1.0, 1.0])}), "d1")
    assert not report.session and "/begin_weight_update" not in seen and "/update_weights_from_disk" in seen
    assert c.get_weight_version() == "d1"
    assert c.generate([[1]], {"max_new_tokens": 1})[0].logprobs == [-1.5]


def test_pause_aborts_in_flight_requests_and_abort_all_is_honoured(server):
    c = SGLangClient(server.url, timeout_s=10, retries=0)
    c.pause_generation(mode="in_place")  # queue requests behind a pause that does not abort
    results: dict = {}

    def send(rid):
        results[rid] = c.request("POST", "/generate", {"input_ids": [1], "rid": rid, "sampling_params": {}})

    threads = [threading.Thread(target=send, args=(r,)) for r in ("a", "b")]
    for t in threads:
        t.start()
    while len(server.app.inflight) < 2:
        time.sleep(0.01)
    c.pause_generation()  # mode abort: what is queued or running returns aborted
    for t in threads:
        t.join(10)
    assert {results[r]["meta_info"]["finish_reason"]["type"] for r in "ab"} == {"abort"}
    c.continue_generation()
    th = threading.Thread(target=send, args=("c",))
    c.pause_generation(mode="in_place")
    th.start()
    while "c" not in server.app.inflight:
        time.sleep(0.01)
    c.update_weight_version("v9", abort_all_requests=True)  # honoured: the waiting request is aborted
    th.join(10)
    assert results["c"]["meta_info"]["finish_reason"]["type"] == "abort"
    c.continue_generation()
    assert c.generate([[1]], {"max_new_tokens": 1})[0].weight_version == "v9"


# ---------------------------------------------------------------- colocated
def test_flattened_buckets_round_trip():
    named = [
        ("a", torch.arange(6.0).view(2, 3)),
        ("b", torch.ones(4)),
        ("c", torch.zeros(2, dtype=torch.bfloat16)),
    ]
    buckets = list(dtype_buckets(iter(named), bucket_bytes=1 << 20))
    assert [([n for n, _ in b], last) for b, last in buckets] == [(["a", "b"], False), (["c"], True)]
    back = unflatten_bucket(deserialize_bytes(serialize_bytes(flatten_bucket(buckets[0][0]))))
    assert [(n, t.tolist()) for n, t in back] == [(n, t.tolist()) for n, t in named[:2]]


def test_colocated_cycle_releases_memory_and_pushes_tensors(server):
    """Standalone colocated engine: a rollout holds every tag, a push the weights alone (the KV
    cache and CUDA graphs come back at the next rollout, not after the push: issue 45); after
    either, everything is released."""
    c = SGLangClient(server.url, timeout_s=10, retries=0)
    sync = TensorWeightSync([c], serializer="bytes")
    engine = SGLangEngine(c, num_layers=2, topk=2, num_experts=8, weight_sync=sync, colocated=True)
    calls, original = [], server.app.handle

    def handle(method, path, body):
        if "memory_occupation" in path:
            calls.append((path.split("_")[0].strip("/"), body.get("tags")))
        return original(method, path, body)

    server.app.handle = handle
    ro = engine.generate([[1]], 2, SamplingParams(max_new_tokens=1))
    assert server.app.released == {"kv_cache", "weights", "cuda_graph"}  # training may use the GPU now
    assert calls == [("release", ["weights", "kv_cache", "cuda_graph"])]  # it started holding all
    with pytest.raises(SGLangHTTPError, match="released"):
        c.generate([[1]], {"max_new_tokens": 1})
    assert not c.health_generate()
    seen = {}
    push = sync.push
    sync.push = lambda *a: (seen.setdefault("released", set(server.app.released)), push(*a))[1]
    calls.clear()
    engine.update_weights(_Source({"w": torch.tensor([2.0, 0.0])}), "t1")
    assert seen["released"] == {"kv_cache", "cuda_graph"}  # the push ran with the weights alone
    assert calls == [("resume", ["weights"]), ("release", ["weights"])]
    assert server.app.released == {"kv_cache", "weights", "cuda_graph"}
    assert engine.last_push.method == "tensor" and engine.last_push.session
    calls.clear()
    ro = engine.generate([[1]], 1, SamplingParams(max_new_tokens=1))
    assert ro.logprobs_BT[0, 1].item() == -2.5 and ro.weight_version == "t1"
    assert calls == [
        ("resume", ["weights"]),
        ("resume", ["kv_cache", "cuda_graph"]),
        ("release", ["weights", "kv_cache", "cuda_graph"]),
    ]
    assert server.app.released == {"kv_cache", "weights", "cuda_graph"}  # released again after rollout
    engine.resume_memory()
    assert server.app.released == set()
    with pytest.raises(SGLangHTTPError, match="was not released"):
        c.resume_memory_occupation(["weights"])  # as SGLang: resuming what was not released fails
    engine.auto_memory = False  # the trainer orders the calls: a push it did not prepare is refused
    engine.release_memory()
    with pytest.raises(SGLangError, match=r"push on colocated engines needs \['weights'\].*resume_memory"):
        engine.update_weights(_Source({"w": torch.tensor([2.0, 0.0])}), "t2")


def test_registry_names_the_sglang_engine():
    from moe_rl.rollout import get_engine_class

    assert get_engine_class("sglang") is SGLangEngine


def test_a_failed_row_is_retried_alone():
    import httpx

    from tests.unit.test_sglang_contract import PINNED_GENERATE

    sent: list[tuple[list[int], str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        if request.url.path != "/generate":
            return httpx.Response(404)
        body = json.loads(request.content)
        sent.append((body["input_ids"], body["rid"]))
        if body["input_ids"] == [5, 6] and len([s for s in sent if s[0] == [5, 6]]) == 1:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, json=PINNED_GENERATE[0 if body["input_ids"] == [1, 2, 3, 4] else 1])

    c = SGLangClient(
        "http://e:1", timeout_s=5, retries=2, backoff_s=0.01, transport=httpx.MockTransport(handler)
    )
    engine = SGLangEngine(c, num_layers=2, topk=2, num_experts=8, weight_version="step-7")
    ro = engine.generate([[1, 2, 3, 4], [5, 6]], 1, SamplingParams(max_new_tokens=4))
    assert ro.finish_reasons == ["stop", "length"]
    assert [s[0] for s in sent].count([1, 2, 3, 4]) == 1  # the healthy row was sent once
    rids = [s[1] for s in sent if s[0] == [5, 6]]
    assert len(rids) == 2 and rids[1] != rids[0]  # the failed row alone, under a new rid


def test_no_request_id_is_a_prefix_of_another(server):
    """SGLang aborts every request whose id starts with AbortReq.rid, so moe-rl's ids of one call
    (12 rows, one of them retried after a 503) must be prefix-free: ``moe-rl-<tag>-1`` would also
    abort rows 10 and 11. Aborting row 1 on the server (which matches by prefix, as SGLang does)
    aborts row 1 alone."""
    c = SGLangClient(server.url, timeout_s=10, retries=0)
    engine = SGLangEngine(c, num_layers=2, topk=2, num_experts=8, weight_version="v0")
    engine.retries, engine.client.backoff_s = 1, 0.0
    seen: list[str] = []
    row_of: dict[str, int] = {}
    original = server.app.handle
    failed_once: list[bool] = []

    def handle(method, path, body):
        if path == "/generate":
            seen.append(body["rid"])
            row_of[body["rid"]] = body["input_ids"][0]
            if body["input_ids"] == [3] and not failed_once:  # row 3's first try: retried under a new id
                failed_once.append(True)
                return 503, {"error": {"message": "busy"}}
        return original(method, path, body)

    server.app.handle = handle
    engine.generate([[b] for b in range(12)], 1, SamplingParams(max_new_tokens=1))
    assert len(seen) == 13 and failed_once
    prefixed = [(a, b) for a in seen for b in seen if a != b and b.startswith(a)]
    assert prefixed == []
    c.pause_generation(mode="in_place")  # queue the 12 rows' ids, then abort row 1's
    results: dict = {}

    def send(rid):
        results[rid] = c.request("POST", "/generate", {"input_ids": [1], "rid": rid, "sampling_params": {}})

    ids = sorted(seen, key=row_of.get)[:12]  # one id per row (row 3's first), in row order
    threads = [threading.Thread(target=send, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    while len(server.app.inflight) < len(ids):
        time.sleep(0.01)
    c.abort_request(ids[1])
    c.continue_generation()
    for t in threads:
        t.join(10)
    aborted = [r for r in ids if results[r]["meta_info"]["finish_reason"]["type"] == "abort"]
    assert aborted == [ids[1]]


@pytest.mark.parametrize(
    "rollout_dtype,flag",
    [("auto", "bfloat16"), ("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")],
)
def test_launched_engines_serve_rollout_dtype(monkeypatch, tmp_path, rollout_dtype, flag):
    """SGLang's --dtype auto serves an fp32 export in fp16: the launcher passes rollout.dtype, bf16
    unless set (what verl and slime serve); the embedded engine's auto is the policy's own."""
    from moe_rl.rollout import sglang_launcher

    started = []

    class Launcher:
        def __init__(self, cfg, **kw):
            self.cfg, self.url = cfg, "http://127.0.0.1:1"

        def start(self):
            started.append(build_command(self.cfg, 1))

    monkeypatch.setattr(sglang_launcher, "SGLangLauncher", Launcher)
    monkeypatch.setattr(factory, "trainer_gpus", lambda: [])
    recipe = recipe_from_dict({}, ["rollout.engine=sglang", f"rollout.dtype={rollout_dtype}"])
    factory.launch_fleet(recipe, tmp_path, "/m")
    (cmd,) = started
    assert cmd[cmd.index("--dtype") + 1] == flag
    own = (
        "fp32" if rollout_dtype == "auto" else rollout_dtype
    )  # the embedded engine, moe-rl serve: the policy's
    assert recipe_from_dict({}, [f"rollout.dtype={rollout_dtype}"]).rollout_dtype == own
    served = [
        "rollout.engine=sglang",
        "rollout.sglang.module=moe_rl.serve.embedded",
        f"rollout.dtype={rollout_dtype}",
    ]
    assert recipe_from_dict({}, served).rollout_dtype == own
