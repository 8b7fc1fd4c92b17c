"""Bad input to ``moe-rl serve``: every case asserts the status code, the message naming the limit or
field, and that nothing was lost (the server still serves, its weights and weight_version are
unchanged, and other requests are not blocked).

The servers are ``moe-rl serve`` (FastAPI + uvicorn) in a thread around the tiny echo engine of
the contract tests, with small limits (:class:`~moe_rl.serve.limits.ServeLimits`) so each case
runs in about a second.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from moe_rl.config import ConfigError
from moe_rl.rollout.weight_sync.tensor import flatten_bucket, serialize_bytes
from moe_rl.serve.http import ServerThread
from moe_rl.serve.http import main as serve_main
from moe_rl.serve.limits import ServeLimits
from tests.unit.test_sglang_contract import _EchoEngine

pytestmark = pytest.mark.bad_input("server")
DEMO_START = Path(__file__).resolve().parents[2] / "recipes/demo/start"

LIMITS = ServeLimits(
    max_body_bytes=64 << 10,
    read_timeout_s=1.0,
    max_running_requests=8,
    max_total_tokens=256,
    stall_timeout_s=2.0,
    health_timeout_s=0.5,
)
ONE = {"input_ids": [3], "sampling_params": {"max_new_tokens": 2}}


class _Engine(_EchoEngine):
    """The echo engine with a context length, a vocabulary check and an optional slow call."""

    max_context_length = 64

    def __init__(self):
        super().__init__()
        self.slow, self.running = threading.Event(), threading.Event()
        self.calls = 0

    def generate(self, prompts, n, sampling):
        self.calls += 1
        if any(t >= 16 for p in prompts for t in p):
            raise ValueError("prompt token ids must be in [0, 16)")
        if self.slow.is_set():
            self.running.set()
            time.sleep(1.5)
        return super().generate(prompts, n, sampling)


@pytest.fixture
def server():
    s = ServerThread(_Engine(), weight_version="v0", limits=LIMITS)
    yield s
    s.stop()


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json=body, timeout=kw.pop("timeout", 10), **kw)


def message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if "error" in body else body.get("message") or body.get("reason")


def assert_serves(server, version="v0", w=(0.0, 0.0)) -> None:
    """Nothing lost: the server answers /generate with the same weights and weight_version."""
    r = post(server, "/generate", {**ONE, "return_logprob": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert r.json()["output_ids"] == [4, 4] and meta["weight_version"] == version
    assert meta["output_token_logprobs"][0][0] == -0.5 - w[0]
    assert server.app.engine.w.tolist() == list(w)


def concurrent_generate(server) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        t0 = time.monotonic()
        out["r"] = post(server, "/generate", ONE)
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run)
    th.start()
    return th, out


# ---------------------------------------------------------------- bodies
def test_content_length_larger_than_the_body_times_out_and_blocks_nobody(server):
    sock = socket.create_connection((server.host, server.port), timeout=10)
    head = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    )
    sock.sendall(head + b'{"input_ids": [1')
    th, out = concurrent_generate(server)  # not blocked by the half-sent request
    th.join(10)
    assert out["r"].status_code == 200 and out["s"] < 1.0
    t0, answer = time.monotonic(), b""
    while chunk := sock.recv(4096):  # until the server closes the connection
        answer += chunk
    sock.close()
    assert time.monotonic() - t0 < 5
    assert answer.startswith(b"HTTP/1.1 408") and b"--moe-rl-read-timeout" in answer
    assert b"got 16 of 500 bytes" in answer
    assert_serves(server)


def test_a_slow_body_that_keeps_coming_is_read(server):
    """The read timeout is one of inactivity: a body sent over longer than it still counts."""
    body = b'{"input_ids": [3], "sampling_params": {"max_new_tokens": 2}}'
    sock = socket.create_connection((server.host, server.port), timeout=10)
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    sock.sendall(head.encode())
    t0 = time.monotonic()
    for i in range(0, len(body), len(body) // 4 + 1):
        time.sleep(0.4)
        sock.sendall(body[i : i + len(body) // 4 + 1])
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    sock.close()
    assert time.monotonic() - t0 > LIMITS.read_timeout_s
    assert answer.startswith(b"HTTP/1.1 200") and b'"output_ids":[4,4]' in answer
    assert_serves(server)


def test_body_over_the_limit_is_413_before_it_is_read(server):
    big = {"input_ids": [[1] * 8] * 2, "rid": ["a", "b"], "pad": "x" * (70 << 10)}
    r = post(server, "/generate", big)
    assert r.status_code == 413
    assert "exceeds the server's limit of 65536 bytes (--moe-rl-max-body-bytes)" in message(r)
    assert server.app.engine.calls == 0 and server.app.served == 0
    assert_serves(server)


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"input_ids": ['
        for _ in range(20):
            yield b"1, " * 2000

    r = httpx.post(server.url + "/generate", content=chunks(), timeout=10)
    assert r.status_code == 413 and "--moe-rl-max-body-bytes" in message(r)
    assert "at least" in message(r)
    assert_serves(server)


def test_weights_body_limit_is_its_own_flag(server):
    r = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["x" * (70 << 10)]})
    assert r.status_code == 400  # under --moe-rl-max-weights-body-bytes: read, then refused as a payload
    assert "load_format" in message(r)
    small = ServerThread(_Engine(), limits=ServeLimits(max_weights_body_bytes=1024))
    try:
        r = post(small, "/update_weights_from_tensor", {"serialized_named_tensors": ["x" * 2048]})
        assert r.status_code == 413 and "--moe-rl-max-weights-body-bytes" in message(r)
        assert small.app.engine.w.tolist() == [0.0, 0.0]
    finally:
        small.stop()
    assert_serves(server)


# ---------------------------------------------------------------- batch limits
@pytest.mark.parametrize("text", [{}, {"text": None}], ids=["input_ids", "text-null"])
def test_too_many_prompts_is_400_while_a_concurrent_generate_completes(server, text):
    th, out = concurrent_generate(server)
    body = {**text, "input_ids": [[1]] * 9, "sampling_params": {"max_new_tokens": 1}}
    r = post(server, "/generate", body)
    th.join(10)
    assert r.status_code == 400
    assert "number of prompts (9) exceeds the server's limit of 8 (--max-running-requests)" in message(r)
    assert out["r"].status_code == 200 and out["r"].json()["output_ids"] == [4, 4]
    assert server.app.engine.calls == 1  # only the concurrent request ran
    assert_serves(server)


def test_too_many_tokens_is_400(server):
    body = {"input_ids": [[1] * 28] * 8, "sampling_params": {"max_new_tokens": 4}}
    assert post(server, "/generate", body).status_code == 200  # 8 * (28 + 4) = 256: at the limit
    body["sampling_params"]["max_new_tokens"] = 5
    r = post(server, "/generate", body)
    assert r.status_code == 400
    assert (
        "prompt + max_new_tokens tokens (264) exceeds the server's limit of 256 (--max-total-tokens)"
        in message(r)
    )
    assert server.app.engine.calls == 1
    assert_serves(server)


def test_prompt_past_the_context_length_is_sglangs_400(server):
    r = post(server, "/generate", {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 8}})
    assert r.status_code == 400
    assert "exceeds the model's maximum context length of 64 tokens" in message(r)
    assert "a total of 68 tokens: 60 tokens from the input messages and 8 tokens" in message(r)
    assert server.app.engine.calls == 0
    assert_serves(server)


def test_a_refused_request_does_not_fail_the_requests_batched_with_it(server):
    server.app.batcher.window_s = 0.3  # both requests land in one engine call
    th, out = concurrent_generate(server)
    time.sleep(0.05)
    r = post(server, "/generate", {"input_ids": [99], "sampling_params": {"max_new_tokens": 2}})
    th.join(10)
    assert r.status_code == 400 and "token ids must be in [0, 16)" in message(r)
    assert out["r"].status_code == 200 and out["r"].json()["output_ids"] == [4, 4]
    assert server.app.engine.calls == 3  # one shared call failed, then each request alone
    server.app.batcher.window_s = 0.005
    assert_serves(server)


def test_a_rid_already_in_flight_is_refused(server):
    server.app.engine.slow.set()
    th = threading.Thread(target=lambda: post(server, "/generate", {**ONE, "rid": "r1"}))
    th.start()
    while "r1" not in server.app.inflight:
        time.sleep(0.01)
    r = post(server, "/generate", {**ONE, "rid": "r1"})
    assert r.status_code == 400 and "Duplicate request ID detected: r1" in message(r)
    th.join(10)
    server.app.engine.slow.clear()
    assert server.app.active == 0 and not server.app.inflight  # no counter left behind
    assert post(server, "/pause_generation", {}).status_code == 200  # drains: nothing stuck
    post(server, "/continue_generation", {})
    assert_serves(server)


# ---------------------------------------------------------------- JSON
@pytest.mark.parametrize(
    "raw, said",
    [
        (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "NaN is not a JSON number"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}', "Infinity is not a JSON number"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}', "1e999 overflows a double"),
    ],
    ids=["nan", "infinity", "overflow"],
)
def test_non_finite_numbers_in_a_request_are_400(server, raw, said):
    r = httpx.post(server.url + "/generate", content=raw, timeout=10)
    assert r.status_code == 400 and said in message(r) and message(r).startswith("body: invalid JSON")
    assert server.app.engine.calls == 0
    assert_serves(server)


@pytest.mark.parametrize(
    "raw, said",
    [
        (b"[" * 50_000, "recursion"),
        (b'{"input_ids": [1, \xff]}', "utf-8"),
        (b'{"input_ids": [1', "Expecting"),
    ],
    ids=["nested", "not-utf8", "truncated"],
)
def test_unparseable_bodies_are_400(server, raw, said):
    r = httpx.post(server.url + "/generate", content=raw, timeout=10)
    assert r.status_code == 400 and message(r).startswith("body: invalid JSON") and said in message(r)
    assert server.app.engine.calls == 0
    assert_serves(server)


def test_responses_never_carry_nan(server):
    server.app.engine.w = torch.tensor([float("nan"), 0.0])  # an engine that computes NaN log-probs
    r = post(server, "/generate", {**ONE, "return_logprob": True})
    assert r.status_code == 200 and "NaN" not in r.text and "Infinity" not in r.text
    assert r.json()["meta_info"]["output_token_logprobs"] == [[None, 4, None], [None, 4, None]]
    server.app.engine.w = torch.zeros(2)
    assert_serves(server)


# ---------------------------------------------------------------- weights
def test_non_finite_tensor_weights_are_refused_naming_the_tensor(server):
    assert post(server, "/begin_weight_update", {}).json()["success"]
    payload = serialize_bytes(flatten_bucket([("w", torch.tensor([float("nan"), 1.0]))]))
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "weight_version": "v1"}
    r = post(server, "/update_weights_from_tensor", body)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "'w': 1 of 2 values are NaN or infinite" in message(r)
    r = post(server, "/end_weight_update", {})
    assert r.status_code == 400 and "Nothing applied" in message(r)
    assert_serves(server, "v0")


def test_non_finite_disk_weights_are_refused_naming_the_tensor(server, tmp_path):
    save_file({"w": torch.tensor([float("inf"), 1.0])}, str(tmp_path / "model.safetensors"))
    before = (tmp_path / "model.safetensors").read_bytes()
    r = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "v1"})
    assert r.status_code == 400 and "'w': 1 of 2 values are NaN or infinite" in message(r)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert_serves(server, "v0")


# ---------------------------------------------------------------- stalls and health
def test_an_abandoned_update_session_is_aborted_and_reported(server, tmp_path):
    save_file({"w": torch.tensor([1.0, 2.0])}, str(tmp_path / "model.safetensors"))
    assert post(server, "/begin_weight_update", {}).json()["success"]
    assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}).json()["success"]
    r = httpx.get(server.url + "/health_generate", timeout=10)
    assert r.status_code == 503 and "weight-update session is open" in r.json()["reason"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # alive
    th, out = concurrent_generate(server)  # waits behind the session, then proceeds
    th.join(10)
    assert out["r"].status_code == 200 and out["s"] < 10  # the gate opened only by the abort
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    assert not info["moe_rl_state"]["update_session_open"]
    assert "1 staged tensors discarded" in info["moe_rl_aborts"][-1]["message"]
    assert "--moe-rl-stall-timeout 2" in info["moe_rl_aborts"][-1]["message"]
    r = post(server, "/end_weight_update", {})  # the trainer comes back: told why
    assert r.status_code == 400 and "no weight-update session is open" in message(r)
    assert "aborted after" in message(r)
    assert httpx.get(server.url + "/health_generate", timeout=10).status_code == 200
    assert_serves(server, "v0")  # the staged weights were discarded


def test_an_abandoned_pause_is_lifted_and_health_says_so_meanwhile(server):
    assert post(server, "/pause_generation", {"mode": "in_place"}).status_code == 200
    r = httpx.get(server.url + "/health_generate", timeout=10)
    assert r.status_code == 503 and "generation is paused" in r.json()["reason"]
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 503
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    th, out = concurrent_generate(server)
    th.join(10)
    assert out["r"].status_code == 200 and out["r"].json()["meta_info"]["finish_reason"]["type"] == "length"
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    assert (
        not info["moe_rl_state"]["paused"]
        and "generation pause aborted" in info["moe_rl_aborts"][-1]["message"]
    )
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    assert_serves(server)


def test_an_active_push_is_not_aborted(server, tmp_path):
    """Admin requests keep a session alive: only one with no request for the timeout is aborted."""
    save_file({"w": torch.tensor([1.0, 2.0])}, str(tmp_path / "model.safetensors"))
    assert post(server, "/pause_generation", {}).status_code == 200
    assert post(server, "/begin_weight_update", {}).json()["success"]
    for _ in range(3):
        time.sleep(1.0)
        assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}).json()["success"]
    assert post(server, "/update_weight_version", {"new_version": "v1"}).json()["success"]
    assert post(server, "/end_weight_update", {}).json()["success"]
    assert post(server, "/continue_generation", {}).status_code == 200
    assert server.app.aborts == []
    assert_serves(server, "v1", (1.0, 2.0))


def test_health_generate_is_503_when_the_engine_stays_busy(server):
    server.app.engine.slow.set()
    th, out = concurrent_generate(server)
    assert server.app.engine.running.wait(10)
    r = httpx.get(server.url + "/health_generate", timeout=10)
    assert r.status_code == 503 and "--moe-rl-health-timeout" in r.json()["reason"]
    th.join(10)
    server.app.engine.slow.clear()
    assert out["r"].status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=10).status_code == 200
    assert_serves(server)


# ---------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--moe-rl-read-timeout", "nan"], "--moe-rl-read-timeout nan"),
        (["--max-total-tokens", "0"], "--max-total-tokens 0"),
        (["--moe-rl-max-body-bytes", "-1"], "--moe-rl-max-body-bytes -1"),
    ],
    ids=["read-timeout-nan", "max-total-tokens-0", "max-body-negative"],
)
def test_a_bad_limit_flag_is_a_config_error_before_the_engine_is_built(argv, flag):
    built = []
    with pytest.raises(ConfigError, match=f"{flag}: expected a finite number > 0"):
        serve_main(argv, factory=built.append)
    assert built == []  # refused before any engine is built


def test_a_port_out_of_range_or_in_use_is_a_config_error(server):
    built = []
    with pytest.raises(ConfigError, match=r"--port 70000: expected 0\.\.65535"):
        serve_main(["--port", "70000"], factory=built.append)
    with pytest.raises(ConfigError, match=rf"--port {server.port}: cannot listen there"):
        serve_main(["--port", str(server.port)], factory=built.append)  # the running server's port
    assert built == []
    assert_serves(server)  # the server holding the port is untouched


# ---------------------------------------------------------------- what the server starts with
def _serve_embedded(*argv: str) -> None:
    """``moe-rl serve``'s embedded engine factory on ``argv`` (the server is not started)."""
    from moe_rl.serve import embedded
    from moe_rl.serve.http import build_arg_parser

    embedded.build_engine(build_arg_parser().parse_args(list(argv)))


@pytest.mark.parametrize("flag", ["--tp-size", "--ep-size"])
def test_a_parallel_size_the_server_does_not_run_is_refused(flag):
    """It used to run at TP 1 while /get_server_info reported 2."""
    with pytest.raises(ConfigError, match=f"{flag} 2: moe-rl serve runs the embedded engine in one process"):
        _serve_embedded("--model-path", str(DEMO_START), flag, "2")


def test_weights_with_a_nan_are_refused_at_start_naming_the_tensor(tmp_path):
    """It used to start, say healthy and answer every request with token 0 and null log-probs."""
    import shutil

    from safetensors.torch import load_file

    start = tmp_path / "start"
    shutil.copytree(DEMO_START, start)
    shard = sorted(start.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if "mlp.experts" in n and n.endswith("weight"))
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=rf"--model-path {start}: weights with NaN or infinite values \(.*experts"
    ):
        _serve_embedded("--model-path", str(start))


def test_weights_with_a_nan_from_the_recipes_checkpoint_load_are_refused_at_start(tmp_path, monkeypatch):
    """The other start docs/safety.md names: ``--model-path`` a recipe whose ``checkpoint.load`` holds
    a NaN (one is put into the loaded weights here: a saved checkpoint is finite by construction).
    Refused naming the checkpoint and the tensor, after the load (a check before it saw the
    random init and passed). Planted bug killed: the recipe's checkpoint.load not loaded."""
    import yaml

    import moe_rl.megatron.checkpoint as ck
    from moe_rl.config import ParallelConfig, recipe_from_dict
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.megatron.policy import build_policy
    from tests.badinput.conftest import RUN_MODEL

    model = recipe_from_dict({"model": RUN_MODEL}).model
    policy = build_policy(model, ParallelConfig(), init_parallel(ParallelConfig(), seed=0))
    saved = ck.save_checkpoint(tmp_path / "ckpt", 1, policy.model, keep=1, owner="t")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": RUN_MODEL, "checkpoint": {"load": str(saved)}}))
    real = ck.load_checkpoint

    def load_then_poison(where, model, **kw):
        out = real(where, model, **kw)
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "experts" in n).view(-1)[3] = float("nan")
        return out

    monkeypatch.setattr(ck, "load_checkpoint", load_then_poison)
    with pytest.raises(
        ConfigError,
        match=rf"--model-path {path} \(checkpoint\.load {saved}\): weights with NaN or infinite values \(.*experts",
    ):
        _serve_embedded("--model-path", str(path))
