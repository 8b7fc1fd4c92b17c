"""A trainer world across two "nodes" (network namespaces) with SGLang engines they both reach.

Three namespaces made for this test on one private bridge (in a fourth namespace; addresses only
they use): trainer rank 0 on 192.168.77.1, rank 1 on 192.168.77.2, and 192.168.77.3 for an
engine started apart from the trainer. Each rank is one process (``ip netns exec``) with the
variables torchrun sets (RANK, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR the
first namespace's address), so the world spans two nodes; a gloo world of 2 trains with data
parallel 2 and rollout.engine=sglang (``moe_rl.serve.embedded``, CPU), pushing weights by the
distributed path (gloo) after each of 2 RL steps.

(a) launched: rank 0 starts the engine on its own node. It must listen on an address rank 1
    reaches (the node's routable address, not 127.0.0.1) and broadcast that URL; before the fix
    it bound 127.0.0.1 and rank 1 dialled its own loopback.
(b) attached: an engine in the third namespace (``rollout.sglang.url``, with an API key),
    reached by both ranks.
(c) refused: ``rollout.sglang.host=127.0.0.1`` across nodes fails on both ranks with one line
    (rank 0 tells rank 1, which would otherwise wait for the URL), nothing launched.

In (a) and (b) both ranks must generate from the engine, the engine must serve each pushed
version (asked by each rank), the last step must sample with the pushed weights (trainer
recompute), and the losses must be finite. Needs root and ``ip netns`` (CI runs as root); the
namespaces are deleted even when the test fails. The address choice itself is checked without
namespaces at the end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.config import ConfigError
from tests.dist.test_sglang_netns import IFNAME, bridged_namespaces, stop_group

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RANK0_IP, RANK1_IP, ENGINE_IP = "192.168.77.1", "192.168.77.2", "192.168.77.3"
MASTER_PORT, ENGINE_PORT = 29611, 30411  # each namespace is fresh: any port is free there


@pytest.fixture
def lan():
    """Namespaces rank0, rank1 and engine on one bridge; yields their names."""
    with bridged_namespaces({"rank0": RANK0_IP, "rank1": RANK1_IP, "engine": ENGINE_IP}) as ns:
        yield ns


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("MOE_RL_TRAINER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SLURMD_NODENAME"):
        env.pop(var, None)
    return env


def _recipe(tmp_path: Path, sglang: dict) -> Path:
    from tests.tiny import TINY_E2E as TINY

    data = {k: dict(v) for k, v in TINY.items()}
    data["model"]["moe_aux_loss_coeff"] = 0.01  # a gradient without reward: the pushes change weights
    data["train"].update(
        stages=["rl"], rl_steps=2, eval_prompts=2, max_new_tokens=6, out_dir=str(tmp_path / "run")
    )
    data["parallel"] = {"data_parallel": 2, "backend": "gloo", "timeout_s": 120}
    data["algo"] = {"name": "grpo"}
    data["rollout"] = {"engine": "sglang", "weight_sync": "distributed", "timeout_s": 60, "retries": 1}
    data["rollout"]["sglang"] = {"startup_timeout_s": 120.0, **sglang}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(data))
    return path


def _train(
    lan: dict[str, str], recipe: Path, tmp_path: Path, timeout_s: float = 150, codes_want=(0, 0)
) -> list[str]:
    """Both ranks, each in its node's namespace; their output (rank order)."""
    procs, logs = [], []
    try:
        for rank, node in enumerate(("rank0", "rank1")):
            env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
            env.update(MASTER_ADDR=RANK0_IP, MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME=IFNAME)
            log = tmp_path / f"rank{rank}.log"
            logs.append(log)
            with open(log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            lan[node],
                            sys.executable,
                            str(HERE / "sglang_multinode_trainer.py"),
                            str(recipe),
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=tmp_path,
                        start_new_session=True,
                    )
                )
        for p in procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        text = [log.read_text(errors="replace") for log in logs]
        codes = [p.poll() for p in procs]
        detail = "\n".join(
            f"--- rank {r} (exit {c}):\n{t[-4000:]}" for r, (c, t) in enumerate(zip(codes, text))
        )
        assert tuple(codes) == tuple(codes_want), detail
        return text
    finally:
        for p in procs:
            stop_group(p)


def _check(text: list[str], url: str) -> None:
    seen = [json.loads(t.strip().splitlines()[-1]) for t in text]
    for rank, s in enumerate(seen):
        assert s["rank"] == rank
        assert s["url"] == url, (rank, s["url"])  # every rank dials the engine, none its own loopback
        assert len(s["generate"]) >= 4 and all(g["rows"] > 0 for g in s["generate"])  # eval, 2 steps, eval
        pushes = s["pushes"]
        assert len(pushes) == 2 and all(p["served"] == p["pushed"] for p in pushes), pushes
        # each step and the final evaluation sample with the version pushed after the last step
        assert [g["version"] for g in s["generate"][-2:]] == [p["pushed"] for p in pushes]
        assert s["non_finite"] == [], s["non_finite"]
        losses = {k: v for k, v in s["rl"].items() if "loss" in k}
        assert losses and all(math.isfinite(v) for v in losses.values()), s["rl"]
        assert s["rl"]["weights/finite"] == 1.0 and s["rl"]["grad_norm"] > 0, s["rl"]
        # the last step sampled with the weights pushed after the one before (trainer recompute)
        assert s["rl"]["mismatch/abs_log_ratio"] < 1e-4, s["rl"]


def test_launched_engine_on_rank0s_node_is_reached_from_another_node(lan, tmp_path):
    recipe = _recipe(tmp_path, {"module": "moe_rl.serve.embedded", "port": ENGINE_PORT})
    _check(_train(lan, recipe, tmp_path), f"http://{RANK0_IP}:{ENGINE_PORT}")


def test_attached_engine_on_a_third_node_is_reached_by_both_ranks(lan, tmp_path):
    from tests.tiny import TINY_E2E as TINY

    model = tmp_path / "engine.yaml"  # moe-rl serve takes a recipe: random init, replaced by the first push
    model.write_text(json.dumps({"model": TINY["model"]}))
    url = f"http://{ENGINE_IP}:{ENGINE_PORT}"
    with open(tmp_path / "engine.log", "wb") as f:
        engine = subprocess.Popen(
            ["ip", "netns", "exec", lan["engine"], sys.executable, "-m", "moe_rl.serve.embedded",
             "--model-path", str(model), "--host", ENGINE_IP, "--port", str(ENGINE_PORT),
             "--skip-tokenizer-init", "--weight-version", "v0", "--api-key", "multinode-key"],
            stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90  # attached engines are up before the trainer starts
        while "listening on" not in (tmp_path / "engine.log").read_text(errors="replace"):
            assert engine.poll() is None and time.monotonic() < deadline, (
                tmp_path / "engine.log"
            ).read_text()
            time.sleep(0.2)
        recipe = _recipe(tmp_path, {"url": url, "api_key": "multinode-key"})
        try:
            text = _train(lan, recipe, tmp_path)
        except AssertionError as e:
            raise AssertionError(
                f"{e}\n--- engine:\n{(tmp_path / 'engine.log').read_text()[-3000:]}"
            ) from None
        _check(text, url)
    finally:
        stop_group(engine)


def test_colocated_engines_run_on_every_node(lan, tmp_path):
    """Colocated (issue 45): each node's first rank launches that node's engine, listening at the
    node's own address (rank 1's: the local end of its route to rank 0), rank 0 the router over
    both; rollouts, memory phases and tensor pushes reach both engines across the namespaces.
    Before: both engines ran on rank 0's node."""
    sglang = {"module": "moe_rl.serve.embedded", "port": ENGINE_PORT, "colocate": True, "engines": 2}
    recipe = _recipe(tmp_path, sglang)
    data = json.loads(recipe.read_text())
    data["rollout"]["weight_sync"] = "tensor"
    recipe.write_text(json.dumps(data))
    text = _train(lan, recipe, tmp_path, timeout_s=240)
    seen = [json.loads(t.strip().splitlines()[-1]) for t in text]
    engines = seen[0]["engines"]
    assert engines == seen[1]["engines"] == [f"http://{RANK0_IP}:{ENGINE_PORT}", engines[1]], engines
    assert engines[1].startswith(f"http://{RANK1_IP}:"), engines
    assert seen[0]["launched_here"] == engines[:1] and seen[1]["launched_here"] == engines[1:]
    _check(text, seen[0]["url"])
    assert seen[0]["url"].startswith(f"http://{RANK0_IP}:") and seen[0]["url"] not in engines  # the router


def test_a_loopback_engine_across_nodes_is_refused_on_every_rank(lan, tmp_path):
    """rollout.sglang.host=127.0.0.1 across nodes: rank 0 refuses before launching, and tells rank 1
    (which would otherwise wait in the broadcast of the URL); both exit with the same one line."""
    recipe = _recipe(tmp_path, {"module": "moe_rl.serve.embedded", "port": ENGINE_PORT, "host": "127.0.0.1"})
    text = _train(lan, recipe, tmp_path, timeout_s=90, codes_want=(1, 1))
    for t in text:
        assert (
            "ConfigError: rollout.sglang.host=127.0.0.1 is loopback but the trainer spans several nodes" in t
        )
    assert not (tmp_path / "run" / "logs" / "sglang-0.log").exists()  # nothing was launched


# -- where launched engines listen, without namespaces ---------------------------------------------
def _sglang(**kw):
    from moe_rl.config import recipe_from_dict

    return recipe_from_dict({"rollout": {"engine": "sglang", "sglang": kw}}).rollout.sglang


def test_the_world_spans_nodes_when_local_world_is_smaller():
    from moe_rl.rollout.factory import spans_nodes

    assert spans_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert not spans_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})
    assert not spans_nodes({"WORLD_SIZE": "2"}) and not spans_nodes({})


def test_engines_listen_where_every_node_reaches_them():
    from moe_rl.rollout.factory import engine_address

    one = {"MASTER_ADDR": "127.0.0.1"}
    assert engine_address(_sglang(), multi_node=False, env=one) == ("127.0.0.1", "127.0.0.1")
    assert engine_address(_sglang(host="::1"), multi_node=False, env={}) == ("::1", "::1")
    keyed = _sglang(host="0.0.0.0", api_key="k")
    assert engine_address(keyed, multi_node=False, env={}) == ("0.0.0.0", "127.0.0.1")
    # across nodes: rank 0's routable address (here the route to a documentation address; a UDP
    # connect sends nothing), never loopback; all interfaces are dialled at that address too
    from moe_rl.rollout.weight_sync.address import route_address

    routed = route_address("192.0.2.1")
    if routed is None or routed.startswith("127."):
        pytest.skip("this machine has no route off loopback")
    env = {"MASTER_ADDR": "192.0.2.1"}
    assert engine_address(_sglang(), multi_node=True, env=env) == (routed, routed)
    assert engine_address(keyed, multi_node=True, env=env) == ("0.0.0.0", routed)
    assert engine_address(_sglang(host=routed), multi_node=True, env={}) == (routed, routed)


@pytest.mark.parametrize(
    "sglang, env, needle",
    [
        ({"host": "127.0.0.1"}, {}, r"^rollout\.sglang\.host=127\.0\.0\.1 is loopback but the trainer spans"),
        ({}, {"MASTER_ADDR": "localhost"}, r"MASTER_ADDR=localhost gives the loopback address"),
        ({}, {"MOE_RL_TRAINER_ADDR": "192.0.2.77"}, r"^\$MOE_RL_TRAINER_ADDR gives '192\.0\.2\.77', which"),
        ({}, {}, r"no routable address of rank 0's node is known.*set rollout\.sglang\.host$"),
    ],
)
def test_across_nodes_a_loopback_or_foreign_address_is_refused(sglang, env, needle):
    from moe_rl.rollout.factory import engine_address

    with pytest.raises(ConfigError, match=needle) as e:
        engine_address(_sglang(**sglang), multi_node=True, env=env)
    assert "\n" not in str(e.value)


def test_all_interfaces_need_an_api_key():
    with pytest.raises(
        ConfigError, match=r"^rollout\.sglang\.host=0\.0\.0\.0 listens on every interface: set "
    ):
        _sglang(host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.api_key"):
        _sglang(host="::")
    assert _sglang(host="::", api_key="k").host == "::"
    assert _sglang(host="0.0.0.0", url="http://10.0.0.5:30000").url  # attached: the host is not used


def test_a_loopback_url_across_nodes_is_refused():
    from moe_rl.rollout.factory import check_reachable

    check_reachable(["http://127.0.0.1:1"], None, multi_node=False, what="rollout.sglang.url")
    check_reachable(
        ["http://10.0.0.5:1", "http://[fd00::5]:1"], "http://10.0.0.6:2", multi_node=True, what="x"
    )
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.url http://localhost:1 is loopback"):
        check_reachable(["http://localhost:1"], None, multi_node=True, what="rollout.sglang.url")
    with pytest.raises(ConfigError, match=r"http://\[::1\]:2 is loopback"):
        check_reachable(["http://10.0.0.5:1"], "http://[::1]:2", multi_node=True, what="router")


def test_launched_servers_do_not_inherit_the_trainer_ranks_torchrun_variables():
    from moe_rl.rollout.sglang_launcher import SGLangServerConfig, server_environ

    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "TORCHELASTIC_RUN_ID": "x",
        "PATH": "/b",
    }
    env.update(GLOO_SOCKET_IFNAME="eth1", LOCAL_WORLD_SIZE="1")
    assert server_environ(env) == {"PATH": "/b", "GLOO_SOCKET_IFNAME": "eth1"}
    cfg = SGLangServerConfig(model_path="/m", host="0.0.0.0", advertise_host="10.0.0.1", api_key="k")
    assert cfg.dial_host == "10.0.0.1" and SGLangServerConfig(model_path="/m", host="::").dial_host == "::1"
